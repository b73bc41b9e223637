"""Autoregressive latent rollout, optional per-step refinement, and decoding.

Legend: B batch, T time (steps + 1, the initial latent included), L tokens, D latent dim,
C channels, S spatial axes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from core.steps.common import NoiseSource
from core.steps.consistency import consistency_sample
from core.steps.diffusion import ode_sample, refine as diffusion_refine

Refiner = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``refine(z_op_BLD, dt_B, task_id_B) -> z_BLD``: corrects one operator prediction."""


@torch.no_grad()
def rollout(operator: nn.Module, z0_BLD: Tensor, dt_B: Tensor, task_id_B: Tensor, steps: int, *,
            refine: Refiner | None = None) -> Tensor:
    """``steps`` autoregressive operator steps from ``z0``. -> z_BTLD with T = steps + 1.

    Index 0 is ``z0`` itself, so index t is the state t steps later and lines up with a
    stored trajectory whose first frame is ``z0`` (score predictions on ``[:, 1:]``).
    ``refine``, when given, is applied to every operator output before it is fed back.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    frames = [z0_BLD]
    z = z0_BLD
    for _ in range(steps):
        z = operator(z, dt_B, task_id_B)
        if refine is not None:
            z = refine(z, dt_B, task_id_B)
        frames.append(z)
    return torch.stack(frames, dim=1)


@torch.no_grad()
def decode_trajectory(decoder: nn.Module, z_BTLD: Tensor, grid_shape: tuple[int, ...], *,
                      chunk: int | None = None) -> Tensor:
    """Decode every frame. -> u_BTCS on ``grid_shape``.

    Frames are decoded as one flat batch of B * T, or ``chunk`` frames at a time to bound
    memory on long rollouts.
    """
    b, t = z_BTLD.shape[:2]
    flat = z_BTLD.reshape(b * t, *z_BTLD.shape[2:])
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    size = flat.shape[0] if chunk is None else chunk
    u = torch.cat([decoder(part, tuple(grid_shape)) for part in flat.split(max(size, 1))])
    return u.reshape(b, t, *u.shape[1:])


def diffusion_refiner(denoiser: nn.Module, *, num_levels: int, sigma_min: float,
                      generator: NoiseSource, sampler: str = "levels", sample_steps: int = 0) -> Refiner:
    """A ``Refiner`` sampling the residual with ``denoiser`` (advances ``generator``): PDE-Refiner's
    ``num_levels`` levels (``sampler="levels"``), or EDM's ODE over ``sample_steps`` levels
    (``sampler="ode"``, `core.steps.diffusion.ode_sample`)."""
    if sampler not in ("levels", "ode"):
        raise ValueError(f"sampler must be 'levels' or 'ode', got {sampler!r}")

    def refine(z_op: Tensor, dt: Tensor, task_id: Tensor) -> Tensor:
        if sampler == "ode":
            return ode_sample(denoiser, z_op, dt, task_id, steps=sample_steps, sigma_min=sigma_min,
                              generator=generator)
        return diffusion_refine(denoiser, z_op, dt, task_id, num_levels=num_levels, sigma_min=sigma_min,
                                generator=generator)

    return refine


def consistency_refiner(student: nn.Module, *, steps: int, generator: NoiseSource, sigma_min: float = 2e-3,
                        sigma_max: float = 1.0, sigma_mid: float | None = None) -> Refiner:
    """A ``Refiner`` taking 1 or 2 consistency steps with ``student`` (advances ``generator``); a
    2-step one re-noises to ``sigma_mid`` (None: `consistency_sample`'s geometric mean)."""
    if steps not in (1, 2):
        raise ValueError(f"steps must be 1 or 2, got {steps}")

    def refine(z_op: Tensor, dt: Tensor, task_id: Tensor) -> Tensor:
        return consistency_sample(student, z_op, dt, task_id, steps=steps, generator=generator,
                                  sigma_min=sigma_min, sigma_max=sigma_max, sigma_mid=sigma_mid)

    return refine
