"""Consistency stage step: distil the residual denoiser into a 1-2 step sampler.

Legend: B batch, L tokens, D latent dim, N Karras grid points.

Consistency distillation (Song et al. 2023) of the diffusion stage's Denoiser (the
``teacher=``): per sample, adjacent levels ``sigma_hi > sigma_lo`` of a Karras grid,
``x_hi = r + sigma_hi eps`` on the residual ``r = z_next - z_op``, one Euler (DDIM) step of
the teacher's probability-flow ODE in x-space using its clean estimate D_T,
``x_lo = D_T + sigma_lo / sigma_hi * (x_hi - D_T)``, and the loss
``|| f_student(x_hi, sigma_hi) - f_target(x_lo, sigma_lo) ||^2 / sigma_data^2`` (mean over
L, D; ``sigma_data`` the teacher's, so the loss has unit scale like the teacher's).

Consistency function: ``f(x, sigma) = denoiser(x, cond, sigma - sigma_min, ...)``. The
Denoiser is EDM-preconditioned inside, so its skip scale at the shifted level is
``sd^2 / ((sigma - sigma_min)^2 + sd^2)``, exactly Song et al.'s c_skip, and its output
scale vanishes at ``sigma = sigma_min``: ``f(x, sigma_min) = x`` holds exactly (c_out and
c_in differ from theirs by O(sigma_min), which is immaterial). A student initialised
from the teacher starts as ``D_T`` at a slightly lower level.

Teacher and EMA target (``target=``, same class as the student) run with their own
parameters under no_grad; the training loop calls ``ema_update_`` after each optimizer
step. The teacher was trained at PDE-Refiner's few levels; keep the grid on the same range
(``sigma_max = 1``, the teacher's ``sigma_min``) so it is queried where it was trained.
Both ends are in latent units, like ``sigma_data``: ``sigma_max`` must stay well above it
(the one-step sample starts from pure noise) and ``sigma_min`` below it.

Batch keys: ``z_next``, ``z_op`` [B, L, D] (``diffusion.attach_operator_prediction``);
``dt`` [B]; ``task_id`` [B]; ``sample_id`` [B].
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn
from torch.func import functional_call

from core.noise import karras_sigmas
from core.steps.common import (
    NoiseSource, draw_normal,
    STREAM_EPS, STREAM_LEVEL, bcast, make_metrics, per_sample_mse, sample_index, sample_keys, sample_normal, step_seed,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ConsistencyStepConfig:
    """Settings of consistency distillation."""

    num_scales: int = 18
    """Points N of the Karras grid (N - 1 adjacent pairs)."""
    sigma_min: float = 2e-3
    """Smallest level: the boundary f(x, sigma_min) = x; the teacher's sigma_min (latent units)."""
    sigma_max: float = 1.0
    """Largest level (PDE-Refiner's level 0 has sigma 1); should be well above ``sigma_data``."""
    rho: float = 7.0
    """Karras grid exponent."""
    sigma_data: float = 1.0
    """The teacher's (and student's) ``Denoiser.sigma_data``: the loss is divided by its square."""

    def __post_init__(self):
        if self.num_scales < 2:
            raise ValueError(f"num_scales must be >= 2, got {self.num_scales}")
        if not 0.0 < self.sigma_min < self.sigma_max:
            raise ValueError(f"need 0 < sigma_min < sigma_max, got {self.sigma_min}, {self.sigma_max}")
        if self.rho <= 0:
            raise ValueError(f"rho must be > 0, got {self.rho}")
        if not self.sigma_data > 0:
            raise ValueError(f"sigma_data must be > 0, got {self.sigma_data}")


def consistency_step(model: nn.Module, params: dict[str, Tensor], batch: TensorDictBase, *,
                     cfg: ConsistencyStepConfig, generator: torch.Generator,
                     teacher: nn.Module, target: nn.Module) -> tuple[Tensor, TensorDict]:
    """Consistency-distillation loss of the student ``model``, in units of ``cfg.sigma_data**2``; batch mean.

    Metrics: ``clean_mse`` (student's one-shot residual error at sigma_hi, x-space) and ``sigma_mean``.
    """
    z_op, dt, task_id = batch["z_op"], batch["dt"], batch["task_id"]
    residual = batch["z_next"] - z_op
    keys = sample_keys(step_seed(generator), batch)
    grid_N = karras_sigmas(cfg.num_scales, cfg.sigma_min, cfg.sigma_max, cfg.rho)
    grid_N = grid_N.to(residual.device, non_blocking=True)  # a blocking copy would sync the GPU
    n_B = sample_index(keys, STREAM_LEVEL, cfg.num_scales - 1)
    sigma_hi, sigma_lo = grid_N[n_B], grid_N[n_B + 1]
    eps = sample_normal(keys, STREAM_EPS, tuple(residual.shape[1:]), dtype=residual.dtype)
    x_hi = residual + bcast(sigma_hi, residual) * eps

    with torch.no_grad():
        d_teacher = teacher(x_hi, z_op, sigma_hi, dt, task_id)
        x_lo = d_teacher + bcast(sigma_lo / sigma_hi, x_hi) * (x_hi - d_teacher)
        f_target = target(x_lo, z_op, sigma_lo - cfg.sigma_min, dt, task_id)

    f_student = functional_call(model, params, (x_hi, z_op, sigma_hi - cfg.sigma_min, dt, task_id))
    # In units of sigma_data: the residual is ~1e-2 of the latents, and an x-space loss of
    # ~1e-5 would put the gradients near Adam's absolute eps, as the diffusion stage's EDM
    # weight avoids for the teacher.
    loss_B = per_sample_mse(f_student, f_target.detach()) / cfg.sigma_data**2
    metrics = make_metrics(clean_mse=per_sample_mse(f_student, residual).mean(), sigma_mean=sigma_hi.float().mean())
    return loss_B.mean(), metrics


@torch.no_grad()
def ema_update_(target_params: Iterable[Tensor], student_params: Iterable[Tensor], decay: float) -> None:
    """``target <- decay * target + (1 - decay) * student``, in place, no grad.

    The one in-place helper of core/steps: the training loop calls it after each optimizer
    step with ``target.parameters()`` and ``model.parameters()`` (same order; under FSDP2
    both are sharded alike, so the shards update locally without communication).
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must lie in [0, 1], got {decay}")
    for t, s in zip(target_params, student_params, strict=True):
        t.lerp_(s.detach().to(t.dtype), 1.0 - decay)


@torch.no_grad()
def consistency_sample(student: nn.Module, z_op: Tensor, dt: Tensor, task_id: Tensor, *, steps: int,
                       generator: NoiseSource, sigma_min: float = 2e-3, sigma_max: float = 1.0,
                       sigma_mid: float | None = None) -> Tensor:
    """``z_op + r`` with r from 1 or 2 consistency steps. -> [B, L, D].

    One step: ``r = f(sigma_max eps, sigma_max)``. Two steps (Song et al., alg. 1): re-noise
    to ``sigma_mid`` (default the geometric mean of the ends) and apply f again. Draws from
    (and advances) ``generator``; use the training config's values.
    """
    if steps not in (1, 2):
        raise ValueError(f"steps must be 1 or 2, got {steps}")
    b = z_op.shape[0]

    def f(x: Tensor, sigma: float) -> Tensor:
        shifted_B = torch.full((b,), sigma - sigma_min, device=z_op.device, dtype=torch.float32)
        return student(x, z_op, shifted_B, dt, task_id)

    def noise() -> Tensor:
        return draw_normal(generator, tuple(z_op.shape), dtype=z_op.dtype, device=z_op.device)

    r = f(sigma_max * noise(), sigma_max)
    if steps == 2:
        mid = math.sqrt(sigma_min * sigma_max) if sigma_mid is None else sigma_mid
        if not sigma_min < mid < sigma_max:
            raise ValueError(f"sigma_mid must lie in (sigma_min, sigma_max), got {mid}")
        r = f(r + math.sqrt(mid**2 - sigma_min**2) * noise(), mid)
    return z_op + r
