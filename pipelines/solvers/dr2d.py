"""2D diffusion-reaction in PDEBench's convention, batched finite volumes in torch: FitzHugh-Nagumo
(PDEBench's) and Allen-Cahn (the activator's bistable reaction alone, one field; issue 50's mixture).

Legend: B samples, T output times, C fields (FitzHugh-Nagumo: 2, u and v; Allen-Cahn: 1, u), X, Y
cells, Xs, Ys stored cells, R cells a side.

Facts taken from PDEBench (github.com/pdebench/PDEBench, ``pdebench/data_gen/src/sim_diff_react.py``,
``configs/diff-react.yaml``, ``gen_diff_react.py``; read for this module, none of its code reused):

* ``u_t = Du lap(u) + u - u^3 - k - v``, ``v_t = Dv lap(v) + u - v`` with ``Du = 1e-3``,
  ``Dv = 5e-3``, ``k = 5e-3`` on ``[-1, 1]^2``, 128 x 128 cells (values at the cell centres),
  stored at ``t = linspace(0, 5, 101)``, channels (u, v).
* Space: a sparse 5-point Laplacian whose boundary rows drop the missing neighbour, i.e. ghost
  cells mirroring the boundary value: zero flux through the walls (homogeneous Neumann).
  We use the same semi-discrete system, written as face fluxes.
* Time: scipy ``solve_ivp`` with its defaults (RK45, rtol 1e-3, atol 1e-6); ours is more accurate.
* Initial condition of sample ``i``: ``np.random.seed(i)``, then ``randn(X * Y)`` for u and another
  for v, unnormalised (its normalisation line is commented out). Its flat vector runs over x fastest,
  so its arrays are [t, y, x, c]; ours are [x, y]. `draw_dr_initial` with ``np.random.RandomState(i)``
  gives PDEBench's sample ``i`` exactly (transposed to [x, y]).

Scheme: explicit classical RK4, a fixed step per output interval. Why not IMEX: at 128 x 128 the
diffusive limit (``8 Dv / dx^2 = 164``) allows ~5 steps per output interval of 0.05, about what the
reaction needs for accuracy anyway (below), so an implicit diffusion solve would save little and cost
a Neumann (DCT) solve per stage. RK4, not SSP-RK3: nothing here needs TVD, and RK4 has the longer
stable interval on the negative real axis (2.78 vs 2.51) and 4th-order accuracy.

Step size, per sample and output interval (one device sync per interval, none per step):
``n = ceil(dt_out * max(rho_stab / _C_STAB, rho_acc / _C_ACC))``, where
* ``rho_stab = 4 D_max (1/dx^2 + 1/dy^2) + 3 M^2 + 2`` bounds (Gershgorin) the spectral radius of the
  full Jacobian on the box ``|u|, |v| <= M``, ``M = max(max|u|, max|v|, 1.5 + |k|)``. That box is invariant
  as ``M^3 >= 2 M + |k|`` (the reaction points inwards on its edges, the discrete Laplacian obeys a
  maximum principle), so M cannot grow inside the interval and the fixed step stays stable.
* ``rho_acc = 3 U^2 + 2``, ``U = max|u|``: the reaction sets the dynamics, so it is *resolved* (RK4
  local error ~ (rho dt)^5 / 120 ~ 1e-7 per step at ``_C_ACC``), not merely kept stable. The stiff
  grid-scale diffusive modes are only kept stable: they decay by e^-8 within the first interval, and
  the 5-point stencil already gets their rate wrong by up to 2.5x, so resolving them buys nothing
  (measured on PDEBench's draw at 128: the stored frames move < 2e-5 when both constants shrink 5-8x).
Each sample's step count depends on its own values only, so its result does not depend on its batch.

Allen-Cahn, ``u_t = D lap(u) + u - u^3`` (`solve_allen_cahn`; ``D = 1e-3``, the activator's ``Du``), shares
the grid, walls, scheme and step rule: its Jacobian ``1 - 3 u^2`` is bounded by the same
``3 M^2 + 2``, and its invariant box ``|u| <= M`` needs only ``M >= 1``, which the rule's ``1.5 + |k|``
floor (``k = 0``) exceeds. Its start is a standard normal per cell, drawn as the activator's.

Storage: ``stored_resolution`` keeps the mean over blocks of cells (cell averages, which the finite
volume state is), so constants stay constant and the mean is preserved.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

FIELDS = ("activator", "inhibitor")
"""The stored channels of FitzHugh-Nagumo in order: u, v."""
ALLEN_CAHN_FIELDS = ("phase",)
"""The stored channel of Allen-Cahn: u."""

_C_STAB = 2.0  # of RK4's 2.78 on the negative real axis; margin for the complex reaction eigenvalues
_C_ACC = 0.1  # rho dt per step for the reaction: ODE error ~3e-8 at t = 5 (measured; ~C^4)
_M_FLOOR = 1.5  # the invariant box's half-width is at least 1.5 + |k|: then M^3 >= 2 M + |k|
_DOMAIN = (-1.0, 1.0)


def cell_centres(resolution: int) -> np.ndarray:
    """Cell centres of ``resolution`` equal cells of [-1, 1], float64 [R] (PDEBench's grid/x, grid/y)."""
    lo, hi = _DOMAIN
    return lo + (np.arange(resolution) + 0.5) * ((hi - lo) / resolution)


def draw_dr_initial(rng: np.random.Generator | np.random.RandomState, resolution: int) -> np.ndarray:
    """One sample's initial (u, v): independent standard normals per cell, float64 [R, R, 2] as [x, y, c].

    Drawn as PDEBench does: all of u first (flat, x fastest), then all of v. With
    ``np.random.RandomState(i)`` this is PDEBench's sample ``i`` exactly.
    """
    u_XY = _normal_field(rng, resolution)
    v_XY = _normal_field(rng, resolution)
    return np.stack([u_XY, v_XY], axis=-1)


def draw_allen_cahn_initial(rng: np.random.Generator | np.random.RandomState, resolution: int) -> np.ndarray:
    """One sample's initial u for Allen-Cahn: a standard normal per cell, float64 [R, R, 1] as [x, y, c],
    drawn as `draw_dr_initial` draws the activator."""
    return _normal_field(rng, resolution)[..., None]


def _normal_field(rng, resolution: int) -> np.ndarray:
    """A standard normal per cell, drawn flat with x running fastest (PDEBench's order), as [x, y]."""
    # reshape gives [y, x] (x runs fastest in the flat draw); .T makes it [x, y].
    return rng.standard_normal(resolution * resolution).reshape(resolution, resolution).T


def _laplacian(f_BCXY: torch.Tensor, inv_dx2: float, inv_dy2: float) -> torch.Tensor:
    """5-point Laplacian with zero flux through the walls, [B, C, X, Y].

    Written as differences of interior face fluxes: the wall faces carry none, which is the mirrored
    ghost cell, and the fluxes telescope, so the mean changes only by rounding.
    """
    out = torch.zeros_like(f_BCXY)
    flux_x = (f_BCXY[:, :, 1:] - f_BCXY[:, :, :-1]) * inv_dx2
    out[:, :, :-1] += flux_x
    out[:, :, 1:] -= flux_x
    flux_y = (f_BCXY[..., 1:] - f_BCXY[..., :-1]) * inv_dy2
    out[..., :-1] += flux_y
    out[..., 1:] -= flux_y
    return out


def fitzhugh_nagumo_reaction(s_BCXY: torch.Tensor, k: float) -> torch.Tensor:
    """FitzHugh-Nagumo's reaction terms ``(u - u^3 - k - v, u - v)``, [B, 2, X, Y] from (u, v) on channel 1."""
    u, v = s_BCXY[:, 0], s_BCXY[:, 1]
    # u * u * u, not u ** 3: elementwise products round the same on every backend and batch size.
    return torch.stack((u - u * u * u - k - v, u - v), dim=1)


def allen_cahn_reaction(s_BCXY: torch.Tensor) -> torch.Tensor:
    """Allen-Cahn's reaction term ``u - u^3``, [B, 1, X, Y]."""
    return s_BCXY - s_BCXY * s_BCXY * s_BCXY


def reaction_diffusion_rhs(s_BCXY: torch.Tensor, diff_C11: torch.Tensor, reaction_term, inv_dx2: float,
                           inv_dy2: float, *, reaction: bool = True, diffusion: bool = True) -> torch.Tensor:
    """Semi-discrete right-hand side ``D lap(s) + reaction_term(s)``, [B, C, X, Y]; ``diff_C11`` holds the
    diffusion coefficients shaped [C, 1, 1]; `reaction`, `diffusion` switch either part off (for tests)."""
    out = diff_C11 * _laplacian(s_BCXY, inv_dx2, inv_dy2) if diffusion else torch.zeros_like(s_BCXY)
    if reaction:
        out = out + reaction_term(s_BCXY)
    return out


def _rk4(s, dt_B111, rhs):
    """One classical RK4 step; ``dt_B111`` is a per-sample step [B, 1, 1, 1]."""
    k1 = rhs(s)
    k2 = rhs(s + (0.5 * dt_B111) * k1)
    k3 = rhs(s + (0.5 * dt_B111) * k2)
    k4 = rhs(s + dt_B111 * k3)
    return s + (dt_B111 / 6.0) * (k1 + 2.0 * (k2 + k3) + k4)


def _step_counts(s_BCXY, dt_out: float, rho_diff: float, reaction_rates, reaction: bool) -> list[int]:
    """Steps each sample takes over an output interval of ``dt_out`` (see the module docstring);
    ``reaction_rates(amax_C)`` gives (the reaction Jacobian's bound for stability, the rate to resolve)
    from the sample's largest |value| per channel."""
    b = s_BCXY.shape[0]
    if not reaction:  # pure diffusion: the bound does not depend on the state, no sync needed
        return [max(1, math.ceil(dt_out * rho_diff / _C_STAB))] * b
    amax_BC = s_BCXY.abs().amax(dim=(2, 3)).tolist()  # the one device sync per output interval
    counts = []
    for amax_C in amax_BC:
        rho_react, rho_acc = reaction_rates(amax_C)
        counts.append(max(1, math.ceil(dt_out * max((rho_diff + rho_react) / _C_STAB, rho_acc / _C_ACC))))
    return counts


def cubic_rates(k: float):
    """The step rule's rates for FitzHugh-Nagumo and Allen-Cahn (``k = 0``): ``3 M^2 + 2`` on the invariant
    box ``M = max(max|values|, 1.5 + |k|)`` for stability, ``3 U^2 + 2`` (``U = max|u|``) to resolve."""
    def rates(amax_C: list[float]) -> tuple[float, float]:
        box = max(*amax_C, _M_FLOOR + abs(k))
        return 3.0 * box * box + 2.0, 3.0 * amax_C[0] * amax_C[0] + 2.0
    return rates


def _advance(s_BCXY, dt_out: float, rho_diff: float, reaction_rates, reaction: bool, rhs):
    """Advance every sample by ``dt_out`` in its own number of equal RK4 steps."""
    counts = _step_counts(s_BCXY, dt_out, rho_diff, reaction_rates, reaction)
    n_max, n_min = max(counts), min(counts)
    n_B = torch.tensor(counts, device=s_BCXY.device)
    dt_B111 = (dt_out / n_B.to(s_BCXY.dtype)).view(-1, 1, 1, 1)
    for step in range(n_max):
        stepped = _rk4(s_BCXY, dt_B111, rhs)
        # Samples that have taken all their steps keep their state (the mask is built on the device).
        s_BCXY = stepped if step < n_min else torch.where((n_B > step).view(-1, 1, 1, 1), stepped, s_BCXY)
    return s_BCXY


def _block_mean(s_BCXY: torch.Tensor, xs: int, ys: int) -> torch.Tensor:
    """Cell averages over blocks of cells, [B, C, X, Y] -> [B, Xs, Ys, C]."""
    b, c, x, y = s_BCXY.shape
    return s_BCXY.reshape(b, c, xs, x // xs, ys, y // ys).mean(dim=(3, 5)).permute(0, 2, 3, 1)


def _checked(uv0_BXYC, times, stored_resolution, diffusivities: tuple[float, ...]) -> tuple[np.ndarray, int, int]:
    """(times float64 [T], Xs, Ys) for a state of one channel per diffusivity; `ValueError` naming what
    is wrong."""
    c = len(diffusivities)
    if not isinstance(uv0_BXYC, torch.Tensor) or uv0_BXYC.ndim != 4 or uv0_BXYC.shape[-1] != c:
        raise ValueError(f"the initial state must be a tensor [B, X, Y, {c}], got "
                         f"{getattr(uv0_BXYC, 'shape', uv0_BXYC)}")
    t_T = np.asarray(times, dtype=np.float64).reshape(-1)
    if t_T.size == 0 or t_T[0] != 0.0 or np.any(np.diff(t_T) < 0.0) or not np.isfinite(t_T).all():
        raise ValueError("times must be finite, non-decreasing and start at 0")
    if min(diffusivities) < 0.0:
        raise ValueError(f"diffusion coefficients must be >= 0, got {', '.join(map(str, diffusivities))}")
    _, x, y, _ = uv0_BXYC.shape
    xs = ys = stored_resolution
    if stored_resolution is None:
        xs, ys = x, y
    elif stored_resolution < 1 or x % stored_resolution or y % stored_resolution:
        raise ValueError(f"stored_resolution={stored_resolution} must divide the grid {x} x {y}")
    if not bool(torch.isfinite(uv0_BXYC).all()):
        raise ValueError("the initial state contains non-finite values")
    return t_T, xs, ys


def solve_dr2d(uv0_BXYC: torch.Tensor, times, *, du: float = 1e-3, dv: float = 5e-3, k: float = 5e-3,
               reaction: bool = True, diffusion: bool = True, stored_resolution: int | None = None,
               progress: Callable[[int], None] | None = None, out_dtype: torch.dtype = torch.float32,
               ) -> torch.Tensor:
    """Solve PDEBench's 2D FitzHugh-Nagumo diffusion-reaction system on [-1, 1]^2 with no-flux walls.

    Args:
        uv0_BXYC: initial (u, v) at the cell centres (`cell_centres`), tensor [B, X, Y, 2]; the
            computation runs in float64 on its device (CPU or CUDA).
        times: output times, 1D, non-decreasing, starting at 0 ([T]; PDEBench: linspace(0, 5, 101)).
        du, dv: diffusion coefficients of u and v.
        k: the reaction constant in ``R_u = u - u^3 - k - v``.
        reaction, diffusion: switch the reaction terms or the Laplacians off (for tests).
        stored_resolution: cells a side kept in the output, the mean over blocks of cells (cell
            averages); must divide X and Y. None keeps the solver's grid.
        progress: called with 1 after each output time is stored (e.g. a tqdm bar's ``update``).
        out_dtype: dtype of the result (float64 for tests that look below float32 rounding).

    Returns:
        tensor [B, T, Xs, Ys, 2] of ``out_dtype`` on the input's device; channels as `FIELDS`.
    """
    return solve_reaction_diffusion(uv0_BXYC, times, (du, dv), lambda s: fitzhugh_nagumo_reaction(s, k), cubic_rates(k),
                                    reaction=reaction, diffusion=diffusion, stored_resolution=stored_resolution,
                                    progress=progress, out_dtype=out_dtype)


def solve_allen_cahn(u0_BXYC: torch.Tensor, times, *, d: float = 1e-3, reaction: bool = True, diffusion: bool = True,
                     stored_resolution: int | None = None, progress: Callable[[int], None] | None = None,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Solve Allen-Cahn, ``u_t = D lap(u) + u - u^3``, on [-1, 1]^2 with no-flux walls.

    Args:
        u0_BXYC: initial u at the cell centres (`cell_centres`), tensor [B, X, Y, 1]; the computation
            runs in float64 on its device (CPU or CUDA).
        times: output times, 1D, non-decreasing, starting at 0 ([T]).
        d: the diffusion coefficient D (the square of the interface width).
        reaction, diffusion, stored_resolution, progress, out_dtype: as `solve_dr2d`'s.

    Returns:
        tensor [B, T, Xs, Ys, 1] of ``out_dtype`` on the input's device; its channel `ALLEN_CAHN_FIELDS`.
    """
    return solve_reaction_diffusion(u0_BXYC, times, (d,), allen_cahn_reaction, cubic_rates(0.0), reaction=reaction,
                                    diffusion=diffusion, stored_resolution=stored_resolution, progress=progress,
                                    out_dtype=out_dtype)


def solve_reaction_diffusion(x0_BXYC, times, diffusivities: tuple[float, ...], reaction_term, reaction_rates, *,
                             reaction: bool = True, diffusion: bool = True, stored_resolution: int | None = None,
                             progress: Callable[[int], None] | None = None,
                             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The system ``s_t = D lap(s) + reaction_term(s)`` on [-1, 1]^2 with no-flux walls, one channel per
    diffusivity, solved from ``x0_BXYC`` [B, X, Y, C] to [B, T, Xs, Ys, C] by this module's scheme.

    ``reaction_term`` maps the state [B, C, X, Y] (float64) to its reaction rates, the same shape;
    ``reaction_rates(amax_C)`` bounds its Jacobian for the step rule (`cubic_rates` says how); the other
    arguments are `solve_dr2d`'s."""
    t_T, xs, ys = _checked(x0_BXYC, times, stored_resolution, diffusivities)
    b, x, y, c = x0_BXYC.shape
    out = torch.empty((b, t_T.size, xs, ys, c), dtype=out_dtype, device=x0_BXYC.device)
    if b == 0:
        return out
    lo, hi = _DOMAIN
    inv_dx2, inv_dy2 = (x / (hi - lo)) ** 2, (y / (hi - lo)) ** 2
    diff_C11 = torch.tensor(diffusivities, dtype=torch.float64, device=x0_BXYC.device).view(c, 1, 1)
    # Gershgorin bound of the discrete Laplacian's spectrum (0 along an axis of one cell).
    rho_diff = 4.0 * max(diffusivities) * (inv_dx2 * (x > 1) + inv_dy2 * (y > 1)) if diffusion else 0.0

    def rhs(s):
        return reaction_diffusion_rhs(s, diff_C11, reaction_term, inv_dx2, inv_dy2, reaction=reaction,
                                      diffusion=diffusion)

    with torch.no_grad():
        s_BCXY = x0_BXYC.to(torch.float64).permute(0, 3, 1, 2).contiguous()
        for i in range(t_T.size):
            if i > 0 and t_T[i] > t_T[i - 1]:
                s_BCXY = _advance(s_BCXY, float(t_T[i] - t_T[i - 1]), rho_diff, reaction_rates, reaction, rhs)
            out[:, i] = _block_mean(s_BCXY, xs, ys).to(out_dtype)
            if progress is not None:
                progress(1)
    return out
