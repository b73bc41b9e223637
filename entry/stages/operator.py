"""The operator stage's record (`SPEC`) and build: the latent operator trained on the dynamic tasks'
latent-cache pairs (with `operator.task_weighting: step_size`, each task's loss weighed by the
inverse of its mean square latent step), and its prediction at test time (the operator is its own
step function)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from core.steps.operator import OperatorStepConfig, operator_step
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.pair_statistics import per_task_mean
from entry.distributed.memory_sim import StageProbe
from entry.distributed.process_group import DistInfo
from entry.models.build import build_operator
from entry.stages.parts import StageParts
from entry.stages.spec import BASE_SECTIONS, StageSpec, has_dynamic, latent_batch, validation_resident
from entry.stages.stage_build import from_source, latent_pair_loader, optimizer_for, place_with_copy


def operator_step_config(cfg: Config) -> OperatorStepConfig:
    """The operator step's settings: latent loss only. The step's decoded loss
    (`OperatorStepConfig.decoded_loss_weight`) is not a config key: the latent-cache loader's
    batches hold latents, not the decoded target fields that loss needs."""
    op = cfg.operator
    return OperatorStepConfig(input_noise=op.input_noise, unroll_grad=op.unroll_grad)


def build(cfg: Config, info: DistInfo, run_dir: Path, logger) -> StageParts:
    """Data, then model (placed, blocks compiled, sharded), then optimizer; the task weights with
    `operator.task_weighting: step_size`."""
    loader = latent_pair_loader(cfg, info, "dynamic", "train", global_batch=cfg.operator.batch_size,
                                horizon=cfg.operator.horizon, unroll=cfg.operator.unroll_steps)
    # Fine-tuning: the model and its average start from the source run's operator.
    make = from_source(lambda: build_operator(cfg), cfg, "operator")
    model, average = place_with_copy(make, cfg, info, copied=cfg.operator.ema_decay > 0)
    optimizer, scheduler = optimizer_for(model, cfg.operator, info)
    logger.info(f"operator: {sum(p.numel() for p in model.parameters())} parameters (this rank's shard), "
                f"{len(loader)} batches per epoch")
    step_cfg = operator_step_config(cfg)
    frozen = {}
    if cfg.operator.task_weighting == "step_size":
        frozen["task_weight"] = step_size_weights(cfg, info).to(info.device)
        logger.info(f"operator: task weights {[round(w, 4) for w in frozen['task_weight'].tolist()]} "
                    f"(operator.task_weighting: step_size)")
    return StageParts("operator", model, operator_step, step_cfg, loader, optimizer, scheduler, frozen=frozen,
                      ema=average)


def step_size_weights(cfg: Config, info: DistInfo) -> torch.Tensor:
    """Per-task loss weights 1 / mean |z_next - z_t|^2 over each task's training pairs, normalised
    to mean 1 over the tasks that have pairs (the others get 1; they are never sampled). -> [T].
    A collective (entry.data.pair_statistics)."""
    squares, counts = per_task_mean(cfg, info, "dynamic", lambda p: (p["z_next"] - p["z_t"]).square().mean((1, 2)),
                                    horizon=cfg.operator.horizon)
    has = counts > 0
    if not bool((squares[has] > 0).all()):
        raise ConfigError("operator.task_weighting: step_size needs every dynamic task's latents to change "
                          "between steps; a task's training pairs have z_next == z_t")
    weight = torch.ones(len(counts))
    weight[has] = 1.0 / squares[has]
    weight[has] = weight[has] / weight[has].mean()
    return weight


def predict(cfg: Config, model: nn.Module, generator) -> nn.Module:
    """The operator's step function at test time: the operator itself (it draws no noise)."""
    return model


def probe(cfg: Config) -> StageProbe:
    """One step of the operator on latent pairs (unrolled as training unrolls them)."""
    return StageProbe("operator", lambda: build_operator(cfg), operator_step, operator_step_config(cfg),
                      latent_batch(cfg, cfg.operator.unroll_steps), resident=validation_resident(cfg))


SPEC = StageSpec("operator", ("cache",), ("autoencoder",), BASE_SECTIONS + ("operator", "evaluation"), has_dynamic,
                 lambda c: c.operator, operator_step_config, probe, model=build_operator, evaluated="required",
                 build=build, cache_kind="dynamic", validates="rollout", predict=predict)
"""The latent time-stepper: trains on the dynamic cache, validated by rollouts, a variant of its own."""
