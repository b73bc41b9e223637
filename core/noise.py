"""Noise schedules for the diffusion residual stage and its consistency distillation.

Legend: B = batch, K = number of refinement levels, N = number of Karras grid points.

Every random draw takes an explicit ``torch.Generator`` (keyword ``generator``) and never
touches the global RNG, so a step is reproducible from its generator's seed alone. The
generator must live on the device of the tensors drawn (a CUDA generator for CUDA
tensors); offsetting its seed per rank is the caller's job (entry/).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def refiner_sigmas(num_levels: int, sigma_min: float, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """PDE-Refiner's geometric noise levels ``sigma_k = sigma_min ** (k / K)``. -> [num_levels].

    ``K = num_levels - 1`` and ``k = 0 .. K``, so the schedule starts at 1 (level 0: the
    model sees only noise and predicts the signal, the plain one-step prediction) and ends
    at ``sigma_min`` (the finest refinement, where the small high-frequency residual lives).
    PDE-Refiner uses a few levels and a very small sigma_min (far below 1e-3).
    ``num_levels == 1`` gives ``[1.0]``: the prediction step alone.
    """
    if num_levels < 1:
        raise ValueError(f"num_levels must be >= 1, got {num_levels}")
    if not 0.0 < sigma_min < 1.0:
        raise ValueError(f"sigma_min must lie in (0, 1), got {sigma_min}")
    if num_levels == 1:
        return torch.ones(1, dtype=dtype)
    k = torch.arange(num_levels, dtype=torch.float64)
    # float64 in log space, then one rounding: the ends are 1 and sigma_min to the output
    # dtype's precision instead of carrying float32 pow error into the finest level.
    sigmas = torch.exp(k / (num_levels - 1) * math.log(sigma_min))
    return sigmas.to(dtype)


def karras_sigmas(
    n: int, sigma_min: float, sigma_max: float, rho: float = 7.0, *, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Karras et al. (EDM) grid, descending from sigma_max to sigma_min. -> [n].

    ``sigma_i = (sigma_max^(1/rho) + i/(n-1) * (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho``;
    rho = 7 spends more points at small sigma, where consistency distillation's
    boundary condition ``f(x, sigma_min) = x`` makes the steps matter most.
    """
    if n < 2:
        raise ValueError(f"karras_sigmas needs n >= 2 points, got {n}")
    if not 0.0 < sigma_min < sigma_max:
        raise ValueError(f"need 0 < sigma_min < sigma_max, got {sigma_min}, {sigma_max}")
    if rho <= 0:
        raise ValueError(f"rho must be > 0, got {rho}")
    ramp = torch.linspace(0.0, 1.0, n, dtype=torch.float64)
    hi, lo = sigma_max ** (1.0 / rho), sigma_min ** (1.0 / rho)
    sigmas = (hi + ramp * (lo - hi)) ** rho
    # Pin the ends exactly: the consistency boundary condition compares against sigma_min.
    sigmas[0], sigmas[-1] = sigma_max, sigma_min
    return sigmas.to(dtype)


def sample_level_indices(batch: int, num_levels: int, *, generator: torch.Generator) -> Tensor:
    """Uniform level index per sample, on the generator's device. -> int64 [B]."""
    if batch < 0 or num_levels < 1:
        raise ValueError(f"need batch >= 0 and num_levels >= 1, got {batch}, {num_levels}")
    return torch.randint(0, num_levels, (batch,), generator=generator, device=generator.device)


def add_noise(x: Tensor, sigma_B: Tensor, *, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Add Gaussian noise with a per-sample scale: ``x + sigma_b * eps``.

    Additive (variance-exploding) form, as in PDE-Refiner's ``u~_k = u + sigma_k eps``;
    the denoiser is trained to predict ``eps``.

    Args:
        x: [B, ...] clean input (e.g. the latent residual).
        sigma_B: [B] noise scale per sample (or a 0-d tensor for all samples).
        generator: draws ``eps``; must be on ``x.device``.

    Returns:
        ``(x_noisy, eps)``, both shaped like ``x``.
    """
    sigma_B = torch.as_tensor(sigma_B, dtype=x.dtype, device=x.device)
    if sigma_B.ndim == 1:
        if sigma_B.shape[0] != x.shape[0]:
            raise ValueError(f"sigma_B has {sigma_B.shape[0]} entries for a batch of {x.shape[0]}")
        sigma_B = sigma_B.reshape(-1, *([1] * (x.ndim - 1)))
    elif sigma_B.ndim != 0:
        raise ValueError(f"sigma_B must be [B] or a scalar, got {tuple(sigma_B.shape)}")
    eps = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    return x + sigma_B * eps, eps


def level_sigmas(levels_B: Tensor, sigmas_K: Tensor) -> Tensor:
    """Gather each sample's sigma from a schedule: ``sigmas_K[levels_B]``. -> [B]."""
    return sigmas_K.to(levels_B.device)[levels_B]
