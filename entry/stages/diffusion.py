"""The diffusion stage's record (`SPEC`) and build: PDE-Refiner style, the trained operator, frozen, predicts z_op and a
denoiser learns the residual z_next - z_op from noised copies at a few noise levels (with
`diffusion.sigma_data: 0` the residual's RMS is measured first); and its prediction at test time,
a refiner of the operator's prediction."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import nn

from core.rollout import diffusion_refiner
from core.steps.diffusion import DiffusionStepConfig, diffusion_step, residual_square_sum
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.cache_plan import cache_plan, open_cache
from entry.distributed.memory_sim import StageProbe
from entry.distributed.process_group import DistInfo, all_reduce_mean
from entry.distributed.sharding import unwrap
from entry.models.build import build_denoiser, build_operator
from entry.models.weights import load_frozen
from entry.stages.parts import StageParts
from entry.stages.spec import BASE_SECTIONS, StageSpec, has_dynamic, latent_batch
from entry.stages.stage_build import from_source, latent_pair_loader, optimizer_for, place_model, upstream_weights
from pipelines.datasets import LatentPairs

MEASURE_BATCHES = 16
"""Global batches of training pairs (at most) that the residual RMS is measured on."""


def diffusion_step_config(cfg: Config) -> DiffusionStepConfig:
    """The residual denoiser's step settings (its sigma_data is the build's)."""
    return DiffusionStepConfig(num_levels=cfg.diffusion.noise_levels, sigma_min=cfg.diffusion.sigma_min,
                               continuous_levels=cfg.diffusion.continuous_levels)


def measure_sigma_data(cfg: Config, info: DistInfo, operator: nn.Module) -> tuple[float, int]:
    """RMS of the residual ``z_next - operator(z_t)`` over training pairs. -> (rms, pairs used).

    A collective: every rank gets the same value. The pairs are a fixed, evenly spaced subset
    of the training set (at most ``MEASURE_BATCHES`` global batches), split contiguously over
    the ranks, so the value does not depend on the world size and a resumed run measures the
    same. Rounded to float32, the Denoiser buffer's dtype, so the step config's sigma_data
    equals the model's exactly.
    """
    # Not the stage's loader: iterating it here would move its position and shuffle state.
    dataset = LatentPairs(open_cache(cache_plan(cfg, "dynamic", "train")), horizon_k=cfg.operator.horizon)
    n = min(len(dataset), MEASURE_BATCHES * cfg.diffusion.batch_size)
    index = torch.linspace(0, len(dataset) - 1, n, dtype=torch.float64).round().long()
    mine = index.tensor_split(info.world_size)[info.rank]
    chunk = max(1, cfg.diffusion.batch_size // info.world_size)
    sums = torch.zeros(2, dtype=torch.float64, device=info.device)
    for s in range(0, len(mine), chunk):
        sums += residual_square_sum(operator, dataset.gather(mine[s:s + chunk]).to(info.device))
    # Mean over ranks of both sums: their ratio is the global mean square. A sync point, once.
    total, count = all_reduce_mean(sums, info).tolist()
    rms = math.sqrt(total / count) if count > 0 else float("nan")
    if not (math.isfinite(rms) and rms > 0):
        raise ConfigError(f"diffusion.sigma_data: the operator's residual RMS measured over {n} training pairs "
                          f"is {rms}; set diffusion.sigma_data > 0 explicitly")
    return float(torch.tensor(rms, dtype=torch.float32)), n


def build(cfg: Config, info: DistInfo, run_dir: Path, logger) -> StageParts:
    """Frozen operator, data, sigma_data (measured when the config has 0), then the denoiser
    (placed, blocks compiled, sharded) and the step config with the same sigma_data, then optimizer."""
    op_weights = upstream_weights(run_dir, "operator")
    operator = load_frozen(lambda: build_operator(cfg), op_weights, info,
                           made_by="python -m entry.operator --config CFG", compile=cfg.training.compile)
    loader = latent_pair_loader(cfg, info, "dynamic", "train", global_batch=cfg.diffusion.batch_size,
                                horizon=cfg.operator.horizon)
    dc = cfg.diffusion
    if dc.sigma_data > 0:
        sigma_data = float(torch.tensor(dc.sigma_data, dtype=torch.float32))  # the buffer's value
        logger.info(f"diffusion: sigma_data {sigma_data:.4g} (diffusion.sigma_data)")
    else:
        sigma_data, pairs = measure_sigma_data(cfg, info, operator)
        logger.info(f"diffusion: sigma_data {sigma_data:.4g} (the operator's residual RMS over {pairs} "
                    f"training pairs)")
    if dc.sigma_min >= sigma_data:
        logger.warning(f"diffusion: sigma_min {dc.sigma_min:g} is not below sigma_data {sigma_data:.4g}: the "
                       f"finest level's noise swamps the residual, so refining adds little; lower diffusion.sigma_min")
    # Fine-tuning: the source run's denoiser, with the sigma_data measured here.
    model = place_model(from_source(lambda: build_denoiser(cfg, dc.pdet, sigma_data=sigma_data), cfg, "diffusion"),
                        cfg, info)
    assert unwrap(model).sigma_data == sigma_data, "the loss weight must use the model's own sigma_data"
    optimizer, scheduler = optimizer_for(model, dc, info)
    step_cfg = dataclasses.replace(diffusion_step_config(cfg), sigma_data=sigma_data)
    return StageParts("diffusion", model, diffusion_step, step_cfg, loader, optimizer, scheduler,
                      frozen={"operator": operator})


def predict(cfg: Config, model: nn.Module, generator):
    """The denoiser at test time: a refiner ``(z_op, dt, task_id) -> z`` of the operator's
    prediction, drawing its noise from ``generator``."""
    return diffusion_refiner(model, num_levels=cfg.diffusion.noise_levels, sigma_min=cfg.diffusion.sigma_min,
                             generator=generator, sampler=cfg.diffusion.sampler,
                             sample_steps=cfg.diffusion.sample_steps)


def probe(cfg: Config) -> StageProbe:
    """One step of the denoiser on latent pairs, the operator frozen beside it."""
    return StageProbe("diffusion", lambda: build_denoiser(cfg, cfg.diffusion.pdet), diffusion_step,
                      diffusion_step_config(cfg), latent_batch(cfg), {"operator": (lambda: build_operator(cfg), False)})


SPEC = StageSpec("diffusion", ("operator",), ("autoencoder", "operator"),
                 BASE_SECTIONS + ("operator", "diffusion", "evaluation"), has_dynamic, lambda c: c.diffusion,
                 diffusion_step_config, probe, model=lambda c: build_denoiser(c, c.diffusion.pdet),
                 evaluated="optional", build=build, cache_kind="dynamic", predict=predict, refines="operator",
                 samples=True)
"""The residual refiner: trains on the dynamic cache against the frozen operator, refines its prediction."""
