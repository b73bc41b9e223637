# long file: one solver (its scheme, its time stepping, the checks of its inputs), which change together
"""2D shallow-water equations (PDEBench's radial dam break), batched finite volumes in torch.

Legend: B samples, T output times, X, Y cells, Xs, Ys stored cells, C = 3 channels (h, hu, hv),
N cells and N + 1 faces along one sweep, M = N + 4 cells with 2 ghosts a side, R = resolution.

Equations: ``h_t + (hu)_x + (hv)_y = 0``, ``(hu)_t + (hu^2 + g h^2/2)_x + (huv)_y = -g h b_x``,
``(hv)_t + (huv)_x + (hv^2 + g h^2/2)_y = -g h b_y``, bathymetry ``b`` (default flat).

PDEBench (``pdebench/data_gen/gen_radial_dam_break.py``, ``src/sim_radial_dam_break.py``,
``configs/radial_dam_break.yaml``; read, not copied): [-2.5, 2.5]^2 on 128 x 128 cells, g = 1,
h = 2 at cell centres with ``r <= R``, else 1, ``R ~ U(0.3, 0.7)`` (sample i: ``np.random.seed(i);
np.random.uniform(0.3, 0.7)``; the inner height is fixed), u = v = 0, frames t = 0, 0.01, ..., 1,
``pyclaw.BC.extrap`` (ghosts copy the edge cell) on all sides, PyClaw's Roe solver with the MC
limiter; they store h only, we store (h, u, v).

Scheme (ours): MUSCL, van Leer limiter on h, u, v and the surface h + b; hydrostatic
reconstruction (Audusse et al. 2004, SIAM J. Sci. Comput. 25:2050), so the lake at rest
(h + b = const, u = v = 0, dry cells allowed) is kept to round-off and h stays >= 0; HLL flux
(Davis speeds); SSP-RK2; x and y unsplit. ``boundary="wall"`` mirrors the ghosts and negates the
normal momentum: the wall mass flux is exactly 0 and flux differences telescope, so ``sum(h)``
is conserved to round-off. ``"outflow"`` (PDEBench's) lets mass leave once waves reach the edge;
in PDEBench's setting (R <= 0.7, t <= 1) they do not (front at r ~ 2.05 at t = 1): same result.

Time step: one per batch, planned at Courant number ``cfl`` for windows of <= `_WINDOW` equal
steps from the speeds seen in the previous window. The largest HLL speed of all faces and stages
stays on the device, read once per window (the only sync); a window that ran above Courant 1/2
(``dt (ax/dx + ay/dy)``, the scheme's positivity bound) is redone slower from its start.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

FIELDS = ("height", "velocity_x", "velocity_y")
BOUNDARIES = ("outflow", "wall")
LENGTH = 5.0  # side of PDEBench's square [-2.5, 2.5]^2
PDEBENCH_TIMES = np.linspace(0.0, 1.0, 101)
_CFL = 0.45  # planned Courant number; the gap to _CFL_MAX absorbs speed growth within a window
_CFL_MAX = 0.5  # positivity bound of MUSCL + HLL + hydrostatic reconstruction, x and y rates summed
_WINDOW = 16  # steps between two reads of the observed wave speed
_DRY = 1e-12  # depth below which a cell's velocity is 0 (no division by ~0)
_MAX_REDOS = 8  # speeds that outgrow 8 replans in a row mean a broken state, not a fast wave


class _Grid(NamedTuple):
    ix: torch.Tensor  # [X + 4] source cell of each padded x position
    sx: torch.Tensor | None  # [X + 4] sign of hu there (walls), None for outflow
    iy: torch.Tensor
    sy: torch.Tensor | None
    bx: torch.Tensor | None  # bathymetry padded along x, transposed: [1 or B, Y, X + 4]
    by: torch.Tensor | None  # [1 or B, X, Y + 4]
    dx: float
    dy: float
    g: float


def cell_centres(resolution: int, length: float = LENGTH) -> np.ndarray:
    """Centres [R] of ``resolution`` equal cells on ``[-length/2, length/2]`` (PyClaw's grid)."""
    return -0.5 * length + (np.arange(resolution) + 0.5) * (length / resolution)


def dam_break_height(radius: float, resolution: int) -> np.ndarray:
    """PDEBench's initial height [R, R] (x, y): 2 at cell centres with ``r <= radius``, else 1."""
    x = cell_centres(resolution)
    return np.where(np.sqrt(x[:, None] ** 2 + x[None, :] ** 2) <= radius, 2.0, 1.0)


def draw_dam_break(rng: np.random.Generator, resolution: int) -> np.ndarray:
    """One sample's initial height [R, R] (float64) with PDEBench's radius ``R ~ U(0.3, 0.7)``.

    PDEBench's sample i is ``dam_break_height(np.random.RandomState(i).uniform(0.3, 0.7), 128)``.
    """
    return dam_break_height(rng.uniform(0.3, 0.7), resolution)


def _ghosts(n: int, boundary: str, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Source index [n + 4] of each cell padded by 2 ghosts a side; for walls the normal-momentum sign."""
    i = np.arange(-2, n + 2)
    if boundary == "wall":  # mirror about the edge face
        src = np.where(i < 0, -1 - i, np.where(i >= n, 2 * n - 1 - i, i))
        sign = torch.from_numpy(np.where((i < 0) | (i >= n), -1.0, 1.0)).to(device)
    else:
        src, sign = i, None
    return torch.from_numpy(np.clip(src, 0, n - 1)).to(device), sign  # clip: n = 1 mirrors itself


def _velocity(h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    wet = h > _DRY
    return torch.where(wet, m / torch.where(wet, h, 1.0), 0.0)


def _faces(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Van Leer-limited values at the left and right faces of cells 1..M-2 of [..., M]: two [..., M-2]."""
    dw = w[..., 1:] - w[..., :-1]
    back, fwd = dw[..., :-1], dw[..., 1:]
    denom = back + fwd
    half = (back * fwd).clamp_min(0.0) / torch.where(denom == 0.0, 1.0, denom)  # 0 at extrema
    return w[..., 1:-1] - half, w[..., 1:-1] + half


def _hll(hL, uL, vL, hR, uR, vR, g: float):
    """HLL fluxes [..., N + 1] of (h, h u, h v) with u normal to the faces, and max |wave speed| (0-dim)."""
    cL, cR = torch.sqrt(g * hL), torch.sqrt(g * hR)
    sL = torch.minimum(uL - cL, uR - cR).clamp_max(0.0)
    sR = torch.maximum(uL + cL, uR + cR).clamp_min(0.0)
    denom = torch.where(sR > sL, sR - sL, 1.0)  # sR == sL only where both sides are dry: flux 0
    wL, wR, wLR = sR / denom, sL / denom, sL * sR / denom
    mL, mR = hL * uL, hR * uR
    fh = wL * mL - wR * mR + wLR * (hR - hL)
    fn = wL * (mL * uL + 0.5 * g * hL * hL) - wR * (mR * uR + 0.5 * g * hR * hR) + wLR * (mR - mL)
    ft = wL * (mL * vL) - wR * (mR * vR) + wLR * (hR * vR - hL * vL)
    return fh, fn, ft, torch.maximum(sR.amax(), -sL.amin())


def _sweep(h, mn, mt, b, d: float, g: float):
    """Rates of change from the faces along the last dim of padded cells [..., M].

    ``mn`` is the momentum normal to the faces, ``mt`` the tangential one, ``b`` the padded
    bathymetry (broadcastable) or None. Returns (dh, dmn, dmt) [..., N] and max |speed| (0-dim).
    """
    hm, hp = (w.clamp_min(0.0) for w in _faces(h))  # limited values stay >= 0 up to rounding
    unm, unp = _faces(_velocity(h, mn))
    utm, utp = _faces(_velocity(h, mt))
    hL, hR = hp[..., :-1], hm[..., 1:]  # the two sides of the N + 1 faces
    if b is None:
        hLs, hRs = hL, hR
    else:  # hydrostatic reconstruction: lower both sides to the higher bottom b*
        em, ep = _faces(h + b)
        b_star = torch.maximum(ep[..., :-1] - hL, em[..., 1:] - hR)
        hLs = (ep[..., :-1] - b_star).clamp_min(0.0)
        hRs = (em[..., 1:] - b_star).clamp_min(0.0)
    fh, fn, ft, speed = _hll(hLs, unp[..., :-1], utp[..., :-1], hRs, unm[..., 1:], utm[..., 1:], g)
    dh = (fh[..., :-1] - fh[..., 1:]) / d  # interior cell j: left face j, right face j + 1
    dmt = (ft[..., :-1] - ft[..., 1:]) / d
    if b is None:
        return dh, (fn[..., :-1] - fn[..., 1:]) / d, dmt, speed
    half_g = 0.5 * g
    # Each side adds back the pressure of its own depth (Audusse's correction); each cell gets the
    # centred source -g h b_x from its own face values (2nd order). At rest these cancel to round-off.
    fn_seen_from_left = fn + half_g * (hL * hL - hLs * hLs)
    fn_seen_from_right = fn + half_g * (hR * hR - hRs * hRs)
    hm_j, hp_j = hm[..., 1:-1], hp[..., 1:-1]
    db_j = (ep[..., 1:-1] - hp_j) - (em[..., 1:-1] - hm_j)
    dmn = (fn_seen_from_right[..., :-1] - fn_seen_from_left[..., 1:] - half_g * (hm_j + hp_j) * db_j) / d
    return dh, dmn, dmt, speed


def _rhs(q_BCXY: torch.Tensor, grid: _Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """Semi-discrete rate [B, C, X, Y] and ``max|s_x|/dx + max|s_y|/dy`` (0-dim).

    A dimension of one cell is skipped: both its faces see the same ghost states, so its flux
    differences are 0 (a [B, X, 1] strip is the 1D scheme). The x sweep is the y sweep's code on
    transposed views: with dx = dy, x <-> y mirrored data give mirrored results bit for bit.
    """
    h, mx, my = q_BCXY.unbind(1)
    dh, dmx, dmy = torch.zeros_like(h), torch.zeros_like(h), torch.zeros_like(h)
    rate = h.new_zeros(())
    if h.shape[-2] > 1:
        hx, mxx, myx = (w.index_select(-2, grid.ix) for w in (h, mx, my))
        if grid.sx is not None:
            mxx = mxx * grid.sx[:, None]
        a, n, t, speed = _sweep(hx.mT, mxx.mT, myx.mT, grid.bx, grid.dx, grid.g)
        dh, dmx, dmy, rate = dh + a.mT, dmx + n.mT, dmy + t.mT, rate + speed / grid.dx
    if h.shape[-1] > 1:
        hy, mxy, myy = (w.index_select(-1, grid.iy) for w in (h, mx, my))
        if grid.sy is not None:
            myy = myy * grid.sy
        a, n, t, speed = _sweep(hy, myy, mxy, grid.by, grid.dy, grid.g)
        dh, dmx, dmy, rate = dh + a, dmx + t, dmy + n, rate + speed / grid.dy
    return torch.stack([dh, dmx, dmy], 1), rate


def _ssp_rk2(q_BCXY: torch.Tensor, dt: float, grid: _Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """One SSP-RK2 (Heun) step; also the larger speed rate of its two stages (0-dim)."""
    k1, rate1 = _rhs(q_BCXY, grid)
    q1 = q_BCXY + dt * k1
    k2, rate2 = _rhs(q1, grid)
    return 0.5 * (q_BCXY + q1 + dt * k2), torch.maximum(rate1, rate2)


def _advance(q_BCXY: torch.Tensor, span: float, rate: float, grid: _Grid, cfl: float):
    """Advance by ``span`` in windows of <= `_WINDOW` equal steps; returns (q, rate seen last)."""
    done, redos = 0.0, 0
    while done < span:
        n = max(1, math.ceil((span - done) * rate / cfl))
        m, dt = min(n, _WINDOW), (span - done) / n
        trial, seen_t = q_BCXY, q_BCXY.new_zeros(())
        for _ in range(m):
            trial, stage_rate = _ssp_rk2(trial, dt, grid)
            seen_t = torch.maximum(seen_t, stage_rate)
        seen = float(seen_t)  # the one device sync per window
        if not math.isfinite(seen):
            raise FloatingPointError("non-finite shallow-water state")
        if dt * seen > _CFL_MAX:  # the speeds grew past the margin: redo this window, slower
            redos += 1
            if redos > _MAX_REDOS:
                raise FloatingPointError(f"time step control failed {redos} times in a row")
            rate = seen
            continue
        q_BCXY, rate, redos = trial, seen, 0
        done = span if m == n else done + m * dt
    return q_BCXY, rate


def _stored(q_BCXY: torch.Tensor, factor: int, dtype: torch.dtype) -> torch.Tensor:
    """(h, u, v) [B, Xs, Ys, 3]; coarse cells are block means of (h, hu, hv), so mass and momentum are kept."""
    if factor > 1:
        q_BCXY = F.avg_pool2d(q_BCXY, factor)
    h, mx, my = q_BCXY.unbind(1)
    return torch.stack([h, _velocity(h, mx), _velocity(h, my)], -1).to(dtype)


def _checked(h0_BXY, times, gravity, bathymetry, boundary, stored_resolution, cfl):
    """Validated (h0 float64 [B, X, Y], times [T], bathymetry [1 or B, X, Y] or None, factor)."""
    h0 = torch.as_tensor(h0_BXY).to(torch.float64)
    t_T = np.asarray(times, dtype=np.float64).reshape(-1)
    if h0.ndim != 3 or min(h0.shape[1:]) < 1:
        raise ValueError(f"h0_BXY must have shape [B, X, Y] with X, Y >= 1, got {tuple(h0.shape)}")
    if t_T.size == 0 or t_T[0] != 0.0 or np.any(np.diff(t_T) < 0.0) or not np.isfinite(t_T).all():
        raise ValueError("times must be non-decreasing, finite and start at 0")
    if boundary not in BOUNDARIES:
        raise ValueError(f"boundary must be one of {BOUNDARIES}, got {boundary!r}")
    if not (0.0 < cfl <= _CFL_MAX and gravity > 0.0):
        raise ValueError(f"need 0 < cfl <= {_CFL_MAX} and gravity > 0, got cfl={cfl}, gravity={gravity}")
    if h0.numel() and not bool(torch.isfinite(h0).all() and (h0 >= 0.0).all()):
        raise ValueError("h0_BXY must be finite and >= 0")
    b, (n_b, nx, ny) = None, h0.shape
    if bathymetry is not None:
        b = torch.as_tensor(bathymetry).to(device=h0.device, dtype=torch.float64)
        if b.shape not in ((nx, ny), (n_b, nx, ny)) or not bool(torch.isfinite(b).all()):
            raise ValueError(f"bathymetry must be finite, shape [X, Y] or [B, X, Y], got {tuple(b.shape)}")
        b = b.reshape(-1, nx, ny)
    sr = nx if stored_resolution is None else stored_resolution
    if not 0 < sr <= nx or nx % sr or ny % (nx // sr):
        raise ValueError(f"stored_resolution={stored_resolution} must divide X={nx} and X // it divide Y={ny}")
    return h0, t_T, b, nx // sr


def solve_swe2d(h0_BXY: torch.Tensor, times, *, gravity: float = 1.0, bathymetry=None, boundary: str = "outflow",
                length: float = LENGTH, stored_resolution: int | None = None, cfl: float = _CFL,
                progress: Callable[[int], None] | None = None, out_dtype: torch.dtype = torch.float32,
                momentum0: torch.Tensor | None = None) -> torch.Tensor:
    """Solve the shallow-water equations on ``[-length/2, length/2]^2``, from rest unless ``momentum0``.

    Args:
        h0_BXY: initial depths >= 0 at cells (x, y), tensor [B, X, Y]; solved in float64 on
            its device (CPU or CUDA). Velocities start at 0.
        times: output times [T], non-decreasing, ``times[0] == 0`` (PDEBench: `PDEBENCH_TIMES`).
        gravity: g (PDEBench: 1).
        bathymetry: bottom b, [X, Y] or [B, X, Y]; None is flat. The surface is h0 + b.
        boundary: "outflow" (zero-order extrapolation, PDEBench's) or "wall" (reflective).
        length: side of the square; cells are length/X by length/Y.
        stored_resolution: Xs; a stored cell is the block mean of (h, hu, hv) over
            factor = X // Xs cells a side (conservative); None stores every cell.
        cfl: planned Courant number of ``dt (max|s_x|/dx + max|s_y|/dy)``, at most 0.5.
        progress: called with 1 after each stored output time.
        out_dtype: dtype of the result.
        momentum0: the initial momenta (hu, hv), [B, 2, X, Y] (a stored frame to continue from,
            `bench.solver_pareto`); None starts at rest.

    Returns:
        tensor [B, T, Xs, Ys, 3] of (h, u, v) (`FIELDS`) on the input's device.
    """
    h0, t_T, b, factor = _checked(h0_BXY, times, gravity, bathymetry, boundary, stored_resolution, cfl)
    n_b, nx, ny = h0.shape
    out = torch.empty((n_b, t_T.size, nx // factor, ny // factor, 3), dtype=out_dtype, device=h0.device)
    if n_b == 0:
        return out
    (ix, sx), (iy, sy) = _ghosts(nx, boundary, h0.device), _ghosts(ny, boundary, h0.device)
    bx, by = (None, None) if b is None else (b.index_select(-2, ix).mT, b.index_select(-1, iy))
    grid = _Grid(ix, sx, iy, sy, bx, by, length / nx, length / ny, float(gravity))
    with torch.no_grad():
        at_rest = torch.zeros((h0.shape[0], 2, *h0.shape[1:]), dtype=h0.dtype, device=h0.device)
        q = torch.cat([h0[:, None], at_rest if momentum0 is None else momentum0.to(h0)], 1)
        rate = float(_rhs(q, grid)[1])
        for i in range(t_T.size):
            if i > 0:
                q, rate = _advance(q, float(t_T[i] - t_T[i - 1]), rate, grid, cfl)
            out[:, i] = _stored(q, factor, out_dtype)
            if progress is not None:
                progress(1)
    return out


def solve_swe1d(h0_BX: torch.Tensor, times, *, gravity: float = 1.0, bathymetry=None, boundary: str = "outflow",
                length: float = LENGTH, cfl: float = _CFL, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 1D equations on ``[-length/2, length/2]``: `solve_swe2d` on a one-cell-wide strip.

    Args as in `solve_swe2d`, with ``h0_BX`` [B, X] and ``bathymetry`` [X] or [B, X].
    Returns a tensor [B, T, X, 2] of (h, u).
    """
    h0 = torch.as_tensor(h0_BX)
    if h0.ndim != 2:
        raise ValueError(f"h0_BX must have shape [B, X], got {tuple(h0.shape)}")
    b = None if bathymetry is None else torch.as_tensor(bathymetry)[..., None]
    out = solve_swe2d(h0[..., None], times, gravity=gravity, bathymetry=b, boundary=boundary, length=length,
                      cfl=cfl, out_dtype=out_dtype)
    return out[..., 0, :2]
