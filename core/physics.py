"""Physics guards: cheap, pure corrections applied to decoded fields during a rollout.

Layout: fields are ``[..., *S]`` with the spatial axes last (usually ``[B, C, T, *S]``
or ``[B, C, *S]``); each function says how many trailing axes it treats as space.
None of them changes its input in place, so they are safe inside autograd and on views
of cached tensors.

Which task needs which guard (a pipeline picks them per task; core stays task-agnostic):

- ``clamp_bounds``: quantities with physical bounds. Diffusion-reaction / reaction-
  diffusion concentrations in [0, 1], CFD density and pressure > 0, Darcy's solution >= 0.
- ``project_mean``: periodic conservation laws whose spatial mean is an invariant,
  1D Burgers and 1D advection (and CFD density/momentum on periodic domains).
- ``enforce_dirichlet_zero``: 2D Darcy flow, whose solution is zero on the boundary.
"""

from __future__ import annotations

import torch
from torch import Tensor


def clamp_bounds(u: Tensor, lo: float | Tensor | None, hi: float | Tensor | None) -> Tensor:
    """Clip ``u`` to ``[lo, hi]``; either bound may be None (unbounded on that side).

    Args:
        u: any shape.
        lo, hi: scalars or tensors broadcastable to ``u`` (e.g. per channel ``[C, 1, 1]``).

    Returns:
        Tensor shaped like ``u``. The gradient is zero where a bound is active, which is
        why this is a guard for evaluation/rollouts, not a training loss.
    """
    if lo is None and hi is None:
        return u
    if lo is not None and hi is not None and bool(torch.any(torch.as_tensor(lo) > torch.as_tensor(hi))):
        raise ValueError(f"clamp_bounds needs lo <= hi, got lo={lo}, hi={hi}")
    lo_t = None if lo is None else torch.as_tensor(lo, dtype=u.dtype, device=u.device)
    hi_t = None if hi is None else torch.as_tensor(hi, dtype=u.dtype, device=u.device)
    return torch.clamp(u, min=lo_t, max=hi_t)


def spatial_mean(u: Tensor, *, spatial_ndim: int) -> Tensor:
    """Mean over the last ``spatial_ndim`` axes. ``[..., *S] -> [...]``."""
    _check_spatial(u, spatial_ndim)
    return u.mean(dim=tuple(range(-spatial_ndim, 0)))


def project_mean(u: Tensor, mean: Tensor | float, *, spatial_ndim: int) -> Tensor:
    """Shift ``u`` so its spatial mean equals ``mean`` (restores a conserved quantity).

    On a periodic grid the mean of Burgers' or advection's ``u`` never changes, so the
    rollout can subtract its drift. A uniform shift is the L2-smallest correction that
    does this, and it leaves every gradient in space untouched.

    Args:
        u: ``[..., *S]`` with ``spatial_ndim`` spatial axes last.
        mean: the conserved mean, broadcastable to ``u.shape[:-spatial_ndim]``
            (typically ``spatial_mean(u0, spatial_ndim=...)`` of the initial condition).

    Returns:
        Tensor shaped like ``u``.
    """
    current = spatial_mean(u, spatial_ndim=spatial_ndim)
    target = torch.as_tensor(mean, dtype=u.dtype, device=u.device)
    # The shift must not broadcast beyond u's non-spatial shape: that would be a caller bug.
    shift = torch.broadcast_to(target - current, current.shape)
    return u + shift.reshape(*current.shape, *([1] * spatial_ndim))


def boundary_mask(h: int, w: int, *, device: torch.device | None = None) -> Tensor:
    """Bool ``[H, W]``, True on the outermost rows and columns."""
    if h < 1 or w < 1:
        raise ValueError(f"boundary_mask needs h, w >= 1, got {h}, {w}")
    mask = torch.zeros(h, w, dtype=torch.bool, device=device)
    mask[0, :] = mask[-1, :] = True
    mask[:, 0] = mask[:, -1] = True
    return mask


def enforce_dirichlet_zero(u: Tensor) -> Tensor:
    """Set the boundary of a 2D field to zero (Darcy: ``u = 0`` on the boundary).

    Args:
        u: ``[..., H, W]``.

    Returns:
        Tensor shaped like ``u``, interior unchanged. ``torch.where`` instead of index
        assignment keeps it out of place and differentiable in the interior, and a
        non-finite boundary value still becomes 0 (a mask product would give nan).
    """
    if u.ndim < 2:
        raise ValueError(f"enforce_dirichlet_zero needs [..., H, W], got {tuple(u.shape)}")
    interior = ~boundary_mask(u.shape[-2], u.shape[-1], device=u.device)
    return torch.where(interior, u, torch.zeros((), dtype=u.dtype, device=u.device))


def _check_spatial(u: Tensor, spatial_ndim: int) -> None:
    if not 1 <= spatial_ndim <= u.ndim:
        raise ValueError(f"spatial_ndim={spatial_ndim} invalid for a field of shape {tuple(u.shape)}")
