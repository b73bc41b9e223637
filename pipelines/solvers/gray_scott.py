"""2D Gray-Scott reaction-diffusion, batched finite volumes in torch on diffusion-reaction's square, walls and
scheme (`pipelines.solvers.dr2d`): two coupled species of other names and kinetics than FitzHugh-Nagumo's, a
member of issue 50's reaction mixture.

Legend: B samples, T output times, C = 2 fields (A, B), X, Y cells, R cells a side.

Facts taken from The Well (PolymathicAI/the_well, ``datasets/gray_scott_reaction_diffusion/README.md``; read
for this module, none of its code reused):

* ``A_t = dA lap(A) - A B^2 + f (1 - A)``, ``B_t = dB lap(B) + A B^2 - (f + k) B`` (its README's second line
  prints ``- A B^2``, a typo: the autocatalysis feeds B) with ``dA = 2e-5``, ``dB = 1e-5`` on ``[-1, 1]^2``,
  128 x 128, periodic, stored every 10 time units to t = 10000, six (f, k): gliders (0.014, 0.054), bubbles
  (0.098, 0.057), maze (0.029, 0.057), worms (0.058, 0.065), spirals (0.018, 0.051), spots (0.03, 0.062).
* Its starts: random Fourier series and random clusters of Gaussians.

What differs here: the walls are dr2d's (no flux), not a periodic box, so that the scheme is the one already
verified; the start is a cluster of Gaussian bumps of B in A = 1, B = 0 (`draw_gray_scott_initial`); the
diffusion coefficients are the flow's parameters (`pipelines.flows` sets them for its grid).

Step rule (dr2d's, with this reaction's bound): on ``0 <= A, B <= M`` the reaction's Jacobian
``[[-B^2 - f, -2 A B], [B^2, 2 A B - f - k]]`` has Gershgorin radius at most ``3 M^2 + f + k``, with
``M = max(max A, max B, 1)``. ``0 <= A <= 1`` and ``B >= 0`` are invariant (the reaction points inwards on
those edges, the discrete Laplacian obeys a maximum principle); B has no such cap, but the rule resolves the
reaction (``rho dt <= 0.1``) besides keeping ``(rho_diff + rho) dt <= 2``, so a bound grown to ``rho'`` within
the interval keeps ``(rho_diff + rho') dt < 2 + 0.1 rho' / rho`` inside RK4's 2.78 while ``rho' <= 7.8 rho``:
B would have to pass about 2.8 M within one output interval before the fixed step went unstable.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import pipelines.solvers.libm as libm
from pipelines.solvers.dr2d import cell_centres, solve_reaction_diffusion

FIELDS = ("concentration_a", "concentration_b")
"""The stored channels in order: A (fed, consumed), B (autocatalytic, removed)."""

_BUMPS = (2, 6)  # Gaussian bumps of B per start, both ends included
_WIDTH = (0.05, 0.15)  # their standard deviation, in units of the square [-1, 1]
_CENTRE = 0.8  # their centres within [-0.8, 0.8]^2, clear of the walls


def draw_gray_scott_initial(rng: np.random.Generator | np.random.RandomState, resolution: int) -> np.ndarray:
    """One start: a cluster of 2 to 6 Gaussian bumps ``b`` (their sum capped at 1) seeding ``B = b / 4``
    in ``A = 1 - b / 2`` (Pearson's square seed, A = 1/2 and B = 1/4, made smooth), float64 [R, R, 2]
    as [x, y, c] at the cell centres (`pipelines.solvers.dr2d.cell_centres`)."""
    x = cell_centres(resolution)
    b_XY = np.zeros((resolution, resolution))
    for _ in range(int(rng.integers(_BUMPS[0], _BUMPS[1] + 1))):
        cx, cy = rng.uniform(-_CENTRE, _CENTRE, 2)
        width = rng.uniform(*_WIDTH)
        # libm's exp, not numpy's: the same bytes on every x86-64 CPU (pipelines.solvers.libm says why)
        b_XY += libm.exp(-((x[:, None] - cx) ** 2 + (x[None, :] - cy) ** 2) / (2.0 * width * width))
    b_XY = np.minimum(b_XY, 1.0)
    return np.stack([1.0 - 0.5 * b_XY, 0.25 * b_XY], axis=-1)


def gray_scott_reaction(s_BCXY: torch.Tensor, f: float, k: float) -> torch.Tensor:
    """Gray-Scott's reaction terms ``(-A B^2 + f (1 - A), A B^2 - (f + k) B)``, [B, 2, X, Y] from (A, B)."""
    a, b = s_BCXY[:, 0], s_BCXY[:, 1]
    abb = a * b * b  # products, not powers: the same rounding on every backend and batch size
    return torch.stack((f * (1.0 - a) - abb, abb - (f + k) * b), dim=1)


def gray_scott_rates(f: float, k: float):
    """The step rule's rates (the module docstring): ``3 M^2 + f + k`` for both stability and accuracy."""
    def rates(amax_C: list[float]) -> tuple[float, float]:
        box = max(*amax_C, 1.0)
        rho = 3.0 * box * box + f + k
        return rho, rho
    return rates


def solve_gray_scott(ab0_BXYC: torch.Tensor, times, *, da: float = 2e-5, db: float = 1e-5, f: float = 0.029,
                     k: float = 0.057, reaction: bool = True, diffusion: bool = True,
                     stored_resolution: int | None = None, progress: Callable[[int], None] | None = None,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Solve 2D Gray-Scott on [-1, 1]^2 with no-flux walls.

    Args:
        ab0_BXYC: initial (A, B) at the cell centres, tensor [B, X, Y, 2]; computed in float64 on its device.
        times: output times, 1D, non-decreasing, starting at 0 ([T]).
        da, db: diffusion coefficients of A and B (The Well's at 128 x 128 by default).
        f, k: feed and kill rates (The Well's "maze" by default).
        reaction, diffusion, stored_resolution, progress, out_dtype: as `pipelines.solvers.dr2d.solve_dr2d`'s.

    Returns:
        tensor [B, T, Xs, Ys, 2] of ``out_dtype`` on the input's device; channels as `FIELDS`.
    """
    if f < 0.0 or k < 0.0:
        raise ValueError(f"feed and kill rates must be >= 0, got f={f}, k={k}")
    return solve_reaction_diffusion(ab0_BXYC, times, (da, db), lambda s: gray_scott_reaction(s, f, k),
                                    gray_scott_rates(f, k), reaction=reaction, diffusion=diffusion,
                                    stored_resolution=stored_resolution, progress=progress, out_dtype=out_dtype)
