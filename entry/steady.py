"""`torchrun --nproc_per_node=N -m entry.steady --config CFG`: the steady prior (Darcy).

A denoiser maps the coefficient latent to the solution latent; trained on steady tasks only,
from the steady cache (coefficient, solution) pairs. With `steady.subtract_mean` (the default)
each task's mean solution latent is measured over the training pairs first and the prior learns
the deviation from it (core/steps/steady.py). With `evaluation.val_every > 0` it samples the
steady tasks' validation solutions every `val_every` steps and logs their nRMSE.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from core.steps.steady import steady_sample
from entry.config.schema import Config
from entry.data.pair_statistics import per_task_mean
from entry.distributed.process_group import DistInfo
from entry.distributed.sharding import unwrap
from entry.models.build import build_denoiser
from entry.stages.record import stage_spec
from entry.stages.steps import steady_pairs_step
from entry.training.runner import Stage
from entry.training.stage_build import latent_pair_loader, optimizer_for, place_average, place_model
from entry.training.stage_command import stage_command
from entry.training.step import StageParts
from entry.training.validation import build_validation


def measure_solution_mean(cfg: Config, info: DistInfo) -> tuple[torch.Tensor, int]:
    """Each task's mean solution latent over the steady training pairs. -> ([T, L, D] float32, pairs).
    A collective (entry.data.pair_statistics); tasks without steady pairs get zeros."""
    mean, counts = per_task_mean(cfg, info, "steady", lambda pairs: pairs["z_next"])
    return mean, int(counts.sum())


def validation_sampler(cfg: Config, info: DistInfo) -> Callable[[nn.Module, int], Callable]:
    """`(denoiser, task_index) -> step_fn` for validation: the steady sampler of entry.evaluation.scoring,
    drawing from a generator seeded afresh at each call, identically on every rank, so that
    successive validations differ only by the weights and every rank computes the same numbers."""
    sc = stage_spec("steady").step_config(cfg)

    def for_task(model: nn.Module, task_index: int) -> Callable:
        generator = torch.Generator(info.device).manual_seed(cfg.training.seed + task_index)
        mean = unwrap(model).solution_mean
        return lambda z, dt, tid: steady_sample(model, z, tid, num_levels=sc.num_levels, sigma_min=sc.sigma_min,
                                                generator=generator, solution_mean=mean)

    return for_task


def build(cfg: Config, info: DistInfo, run_dir: Path, logger) -> StageParts:
    """Data and the solution mean, then the denoiser (placed, blocks compiled, sharded), then optimizer."""
    loader = latent_pair_loader(cfg, info, "steady", "train", global_batch=cfg.steady.batch_size)
    validate, floor = build_validation(cfg, info, run_dir, steady=True, step_fn_for=validation_sampler(cfg, info))
    mean = None
    if cfg.steady.subtract_mean:
        mean, pairs = measure_solution_mean(cfg, info)
        logger.info(f"steady: solution mean of {pairs} training pairs, RMS {float(mean.square().mean().sqrt()):.4g} "
                    f"(steady.subtract_mean)")

    def make() -> nn.Module:
        return build_denoiser(cfg, cfg.steady.pdet, solution_mean=mean)

    model = place_model(make, cfg, info)
    average = place_average(make, cfg, info, cfg.steady)
    optimizer, scheduler = optimizer_for(model, cfg.steady, info)
    step_cfg = stage_spec("steady").step_config(cfg)
    frozen = {} if mean is None else {"solution_mean": unwrap(model).solution_mean}
    return StageParts("steady", model, steady_pairs_step, step_cfg, loader, optimizer, scheduler, frozen=frozen,
                      validate=validate, val_extras=floor, ema=average)


STAGE = Stage("steady", lambda c: c.steady, build)

main = stage_command(STAGE, __doc__)


if __name__ == "__main__":
    sys.exit(main())
