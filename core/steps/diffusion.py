"""Diffusion stage step: PDE-Refiner-style denoising of the operator's latent residual.

Legend: B batch, L tokens, D latent dim, K noise levels.

The denoiser learns the residual ``r = z_next - z_op`` with ``z_op = operator(z_t)``,
conditioned on ``z_op``. Levels follow ``core.noise.refiner_sigmas`` (sigma_0 = 1 down to
``sigma_min``); level 0 sees zeros (the one-step prediction of r), level k >= 1 sees
``r + sigma_k eps``. The Denoiser (EDM-preconditioned inside) predicts the clean residual;
the loss is EDM's ``|(D - r) / c_out|^2`` (see core/steps/common.py), which is
eps-prediction at small sigma, so the finest levels keep their gradient.

The residual is far smaller than the latents (RMS ~5e-3 of theirs on advection), so the
Denoiser's ``sigma_data`` must be its RMS, not 1: ``residual_square_sum`` gives the sums the
entry measures it from before training.

Batch keys: ``z_t``, ``z_next`` [B, L, D]; ``dt`` [B]; ``task_id`` [B]; ``sample_id`` [B];
``z_op`` [B, L, D] (added by ``attach_operator_prediction``, or computed in the step from
the frozen ``operator=``).
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn
from torch.func import functional_call

from core.noise import karras_sigmas, refiner_sigmas
from core.steps.common import (NoiseSource, RefinerStepConfig, draw_normal, make_metrics, refiner_loss, refiner_sample,
                               sample_keys, step_seed)


DiffusionStepConfig = RefinerStepConfig
"""Settings of the residual denoiser (see `RefinerStepConfig`)."""


@torch.no_grad()
def attach_operator_prediction(operator: nn.Module, batch: TensorDictBase) -> TensorDictBase:
    """A shallow copy of ``batch`` with ``z_op = operator(z_t, dt, task_id)`` (no grad)."""
    out = batch.copy()
    out["z_op"] = operator(batch["z_t"], batch["dt"], batch["task_id"]).detach()
    return out


@torch.no_grad()
def residual_square_sum(operator: nn.Module, batch: TensorDictBase) -> Tensor:
    """``[sum of r**2, number of elements]`` of the residual ``r = z_next - operator(z_t)``. -> float64 [2].

    Sums, not a mean, so batches and ranks combine exactly; ``sqrt(sum / count)`` is the
    residual's RMS, the EDM ``sigma_data`` of the diffusion stage. The RMS about zero, not the
    std about the mean: the Denoiser's c_skip and c_in are optimal for the second moment.
    """
    r = batch["z_next"].float() - attach_operator_prediction(operator, batch)["z_op"].float()
    return torch.stack([r.square().sum(dtype=torch.float64),
                        torch.tensor(r.numel(), dtype=torch.float64, device=r.device)])


def diffusion_step(model: nn.Module, params: dict[str, Tensor], batch: TensorDictBase, *,
                   cfg: DiffusionStepConfig, generator: torch.Generator,
                   operator: nn.Module | None = None) -> tuple[Tensor, TensorDict]:
    """Refiner loss of a Denoiser ``(x_noisy, cond=z_op, sigma, dt, task_id) -> r_hat``; batch mean.

    Metrics: ``denoised_mse`` (x-space error of the residual estimate) and ``level_mean``.
    """
    if "z_op" not in batch.keys():
        if operator is None:
            raise ValueError("diffusion step needs 'z_op' in the batch or the frozen operator= module")
        batch = attach_operator_prediction(operator, batch)
    z_op = batch["z_op"]
    residual = batch["z_next"] - z_op
    keys = sample_keys(step_seed(generator), batch)
    sigmas_K = refiner_sigmas(cfg.num_levels, cfg.sigma_min)

    def fn(*args: Tensor) -> Tensor:
        return functional_call(model, params, args)

    loss_B, denoised_B, level_B = refiner_loss(fn, residual, z_op, batch["dt"], batch["task_id"], keys,
                                               sigmas_K=sigmas_K, sigma_data=cfg.sigma_data,
                                               continuous=cfg.continuous_levels)
    return loss_B.mean(), make_metrics(denoised_mse=denoised_B.mean(), level_mean=level_B.float().mean())


@torch.no_grad()
def refine(denoiser: nn.Module, z_op: Tensor, dt: Tensor, task_id: Tensor, *, num_levels: int, sigma_min: float,
           generator: NoiseSource) -> Tensor:
    """K-step PDE-Refiner inference: ``z_op + r`` with r refined over all levels. -> [B, L, D].

    No grad; draws from (and advances) ``generator``; use the training config's values.
    """
    sigmas_K = refiner_sigmas(num_levels, sigma_min)
    r = refiner_sample(denoiser, z_op, dt, task_id, sigmas_K=sigmas_K, generator=generator)
    return z_op + r


ODE_RHO = 2.0
"""Karras grid exponent of `ode_sample`. EDM's 7 is made for 18 or more levels; at the 4 to 8 a
rollout step can afford, a residual of the kind the preconditioning assumes (Gaussian, RMS
sigma_data from 0.02 to 0.5, levels from 5 sigma_data to 2e-3) comes out 8-21% too wide at 5 levels
with 7, within 4% with 2 (tests/test_steps.py)."""
ODE_SPAN = 5.0
"""`ode_sample` starts at ``min(1, ODE_SPAN * sigma_data)``: noise well above the residual (its signal
is 1/26 of the start's variance), and a grid that spends its few levels where the residual is."""


@torch.no_grad()
def ode_sample(denoiser: nn.Module, z_op: Tensor, dt: Tensor, task_id: Tensor, *, steps: int, sigma_min: float,
               generator: NoiseSource) -> Tensor:
    """``z_op + r`` with r drawn by EDM's deterministic sampler (Karras et al. 2022, algorithm 1):
    noise at ``sigma_max = min(1, ODE_SPAN * sigma_data)`` (the denoiser's), Heun steps of the probability-flow ODE ``dx/dsigma = (x - D(x)) / sigma``
    down a Karras grid of ``steps`` levels (`ODE_RHO`) to ``sigma_min``, then the clean estimate there.
    -> [B, L, D].

    A sample of the residual the denoiser learned, its spread set by the start noise (one draw from
    ``generator``, advanced), unlike PDE-Refiner's levels, which start from the level-0 prediction
    and can spread no wider than their first noise. It queries the denoiser between the sampler's
    levels, so the denoiser must be trained on all of them (``RefinerStepConfig.continuous_levels``).
    ``2 * steps - 2`` denoiser calls in all: Heun's two on each interval but the last (Euler's
    one, as in EDM), and the final estimate.
    """
    if steps < 2:
        raise ValueError(f"steps must be >= 2, got {steps}")
    b = z_op.shape[0]
    sd = float(denoiser.sigma_data)
    sigma_max = min(1.0, ODE_SPAN * sd)
    if not sigma_min < sigma_max:
        raise ValueError(f"sigma_min {sigma_min} must lie below the start {sigma_max} (5 sigma_data, at most 1)")
    sigmas = karras_sigmas(steps, sigma_min, sigma_max, rho=ODE_RHO).tolist()

    def clean(x: Tensor, sigma: float) -> Tensor:
        return denoiser(x, z_op, torch.full((b,), sigma, device=z_op.device, dtype=torch.float32), dt, task_id)

    # The marginal at sigma_max has variance sigma_max^2 + sigma_data^2; EDM's sigma_max of 80 makes the
    # second term negligible, ours of 5 sigma_data does not.
    start = math.sqrt(sigma_max**2 + sd**2)
    x = start * draw_normal(generator, tuple(z_op.shape), dtype=z_op.dtype, device=z_op.device)
    for i, (hi, lo) in enumerate(zip(sigmas[:-1], sigmas[1:])):
        slope = (x - clean(x, hi)) / hi
        x_next = x + (lo - hi) * slope
        if i < steps - 2:  # Heun's correction; the last interval is an Euler step, as in EDM
            x_next = x + (lo - hi) * 0.5 * (slope + (x_next - clean(x_next, lo)) / lo)
        x = x_next
    return z_op + clean(x, sigmas[-1])
