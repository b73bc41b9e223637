"""The consistency stage's record (`SPEC`) and build: the student starts from the trained diffusion denoiser (the
teacher, frozen) and matches an EMA target, a second module sharded like the student and updated
after every optimizer step; all three carry the teacher's sigma_data. And its prediction at test
time, a one- or two-step refiner of the operator's prediction."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch import nn

from core.rollout import consistency_refiner
from core.steps.consistency import ConsistencyStepConfig, consistency_step
from core.steps.diffusion import attach_operator_prediction
from entry.config.schema import Config
from entry.distributed.memory_sim import StageProbe
from entry.distributed.process_group import DistInfo
from entry.distributed.sharding import unwrap
from entry.models.build import build_denoiser, build_operator
from entry.models.weights import load_frozen, load_weights
from entry.stages.parts import StageParts, update_average
from entry.stages.spec import BASE_SECTIONS, StageSpec, has_dynamic, latent_batch
from entry.stages.stage_build import from_source, latent_pair_loader, optimizer_for, place_with_copy, upstream_weights


def consistency_step_config(cfg: Config) -> ConsistencyStepConfig:
    """The consistency student's step settings (its sigma_data is the teacher's)."""
    return ConsistencyStepConfig(sigma_min=cfg.diffusion.sigma_min)


def consistency_with_operator(model, params, batch, *, cfg, generator, operator, teacher, target):
    """The consistency step on a batch completed with the frozen operator's prediction z_op.
    Returns (loss, metrics) as `core.steps.consistency.consistency_step` does."""
    batch = attach_operator_prediction(operator, batch)
    return consistency_step(model, params, batch, cfg=cfg, generator=generator, teacher=teacher, target=target)


def build(cfg: Config, info: DistInfo, run_dir: Path, logger) -> StageParts:
    """Frozen operator and teacher, data, student and EMA target (both sharded), optimizer."""
    compile_ = cfg.training.compile
    operator = load_frozen(lambda: build_operator(cfg),
                           upstream_weights(run_dir, "operator"), info,
                           made_by="python -m entry.operator --config CFG", compile=compile_)
    teacher_weights = upstream_weights(run_dir, "diffusion")
    teacher = load_frozen(lambda: build_denoiser(cfg, cfg.diffusion.pdet), teacher_weights, info,
                          made_by="python -m entry.diffusion --config CFG", compile=compile_)
    loader = latent_pair_loader(cfg, info, "dynamic", "train", global_batch=cfg.consistency.batch_size,
                                horizon=cfg.operator.horizon)

    def from_teacher():
        net = build_denoiser(cfg, cfg.diffusion.pdet)
        return load_weights(net, teacher_weights, made_by="python -m entry.diffusion --config CFG")

    # Fine-tuning: student and target start from the source run's student (the teacher's sigma_data).
    start = from_source(from_teacher, cfg, "consistency")
    model, target = place_with_copy(start, cfg, info, copied=True)
    sigma_data = teacher.sigma_data  # restored from the teacher's weights by load_state_dict
    assert unwrap(model).sigma_data == unwrap(target).sigma_data == sigma_data, "student/target/teacher disagree"
    logger.info(f"consistency: sigma_data {sigma_data:.4g} (the teacher's)")
    optimizer, scheduler = optimizer_for(model, cfg.consistency, info)
    decay = cfg.consistency.target_decay

    step_cfg = dataclasses.replace(consistency_step_config(cfg), sigma_data=sigma_data)
    return StageParts("consistency", model, consistency_with_operator, step_cfg, loader, optimizer, scheduler,
                      frozen={"operator": operator, "teacher": teacher, "target": target},
                      after_step=lambda: update_average(target, model, decay))


def predict(cfg: Config, model: nn.Module, generator):
    """The student at test time: a refiner ``(z_op, dt, task_id) -> z`` of the operator's
    prediction in `consistency.sample_steps` steps, drawing its noise from ``generator``."""
    return consistency_refiner(model, generator=generator, steps=cfg.consistency.sample_steps,
                               sigma_min=cfg.diffusion.sigma_min, sigma_mid=cfg.consistency.sigma_mid or None)


def probe(cfg: Config) -> StageProbe:
    """One step of the student on latent pairs, the operator, the teacher and the EMA target beside it."""
    teacher = lambda: build_denoiser(cfg, cfg.diffusion.pdet)  # noqa: E731
    return StageProbe("consistency", lambda: build_denoiser(cfg, cfg.diffusion.pdet), consistency_with_operator,
                      consistency_step_config(cfg), latent_batch(cfg),
                      {"operator": (lambda: build_operator(cfg), False), "teacher": (teacher, False),
                       "target": (teacher, True)})


SPEC = StageSpec("consistency", ("diffusion",), ("autoencoder", "operator", "diffusion"),
                 BASE_SECTIONS + ("operator", "diffusion", "consistency", "evaluation"), has_dynamic,
                 lambda c: c.consistency, consistency_step_config, probe,
                 model=lambda c: build_denoiser(c, c.diffusion.pdet), evaluated="optional", build=build,
                 cache_kind="dynamic", predict=predict, refines="operator", samples=True)
"""The distilled refiner: the diffusion denoiser's student, refines the operator's prediction in 1-2 steps."""
