"""The steady stage's record (`SPEC`) and build: a denoiser maps the coefficient latent to the solution latent, trained
on the steady cache's (coefficient, solution) pairs; with `steady.subtract_mean` each task's mean
solution latent is measured first and the prior learns the deviation from it. And its prediction
at test time: the steady sampler, defined here once for validation and evaluation."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from core.steps.steady import SteadyStepConfig, steady_sample, steady_step
from entry.config.schema import Config
from entry.data.pair_statistics import per_task_mean
from entry.distributed.memory_sim import StageProbe
from entry.distributed.process_group import DistInfo
from entry.distributed.sharding import unwrap
from entry.models.build import build_denoiser
from entry.stages.parts import StageParts
from entry.stages.spec import BASE_SECTIONS, StageSpec, has_steady, latent_batch, validation_resident
from entry.stages.stage_build import from_source, latent_pair_loader, optimizer_for, place_with_copy


def steady_step_config(cfg: Config) -> SteadyStepConfig:
    """The steady prior's step settings, also its sampler's (levels, sigma_min)."""
    return SteadyStepConfig(num_levels=cfg.steady.noise_levels)


def steady_pairs_step(model, params, batch, *, cfg, generator, solution_mean=None):
    """The steady step on a cache pair: coefficient latent (z_t) -> solution latent (z_next).
    Returns (loss, metrics) as `core.steps.steady.steady_step` does."""
    batch = batch.copy()
    batch["z_coef"], batch["z_sol"] = batch["z_t"], batch["z_next"]
    return steady_step(model, params, batch, cfg=cfg, generator=generator, solution_mean=solution_mean)


def measure_solution_mean(cfg: Config, info: DistInfo) -> tuple[torch.Tensor, int]:
    """Each task's mean solution latent over the steady training pairs. -> ([T, L, D] float32, pairs).
    A collective (entry.data.pair_statistics); tasks without steady pairs get zeros."""
    mean, counts = per_task_mean(cfg, info, "steady", lambda pairs: pairs["z_next"])
    return mean, int(counts.sum())


def build(cfg: Config, info: DistInfo, run_dir: Path, logger) -> StageParts:
    """Data and the solution mean, then the denoiser (placed, blocks compiled, sharded), then optimizer."""
    loader = latent_pair_loader(cfg, info, "steady", "train", global_batch=cfg.steady.batch_size)
    mean = None
    if cfg.steady.subtract_mean:
        mean, pairs = measure_solution_mean(cfg, info)
        logger.info(f"steady: solution mean of {pairs} training pairs, RMS {float(mean.square().mean().sqrt()):.4g} "
                    f"(steady.subtract_mean)")

    def built() -> nn.Module:
        return build_denoiser(cfg, cfg.steady.pdet, solution_mean=mean)

    make = from_source(built, cfg, "steady")  # fine-tuning: the source run's prior, this run's solution mean

    model, average = place_with_copy(make, cfg, info, copied=cfg.steady.ema_decay > 0)
    optimizer, scheduler = optimizer_for(model, cfg.steady, info)
    step_cfg = steady_step_config(cfg)
    frozen = {} if mean is None else {"solution_mean": unwrap(model).solution_mean}
    return StageParts("steady", model, steady_pairs_step, step_cfg, loader, optimizer, scheduler, frozen=frozen,
                      ema=average)


def predict(cfg: Config, model: nn.Module, generator):
    """The steady prior at test time: ``(z_coef, dt, task_id) -> z_sol``, sampled with the
    training config's levels and sigma_min from ``generator``, its solution mean added back."""
    sc = steady_step_config(cfg)
    mean = unwrap(model).solution_mean
    return lambda z, dt, tid: steady_sample(model, z, tid, num_levels=sc.num_levels, sigma_min=sc.sigma_min,
                                            generator=generator, solution_mean=mean)


def probe(cfg: Config) -> StageProbe:
    """One step of the prior on steady pairs of the 2D fields' tokens."""
    return StageProbe("steady", lambda: build_denoiser(cfg, cfg.steady.pdet), steady_pairs_step,
                      steady_step_config(cfg), latent_batch(cfg, ndim=2), resident=validation_resident(cfg))


SPEC = StageSpec("steady", ("cache",), ("autoencoder",), BASE_SECTIONS + ("steady", "evaluation"), has_steady,
                 lambda c: c.steady, steady_step_config, probe, model=lambda c: build_denoiser(c, c.steady.pdet),
                 evaluated="required", build=build, cache_kind="steady", validates="rollout", predict=predict,
                 samples=True)
"""The steady prior: trains on the steady cache, validated by rollouts (one step), a variant of its own."""
