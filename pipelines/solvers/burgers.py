# long file: one solver: flux, time stepping and output schedule follow one convention (PDEBench's) together
"""Viscous Burgers equation in PDEBench's convention, batched finite volumes in torch.

Legend: N samples, B samples in one chunk, T output times, X cells, K = X // 2 + 1 Fourier
modes; in `solve_burgers_blocks`: G blocks, R = G * block rows (N padded).

Equation (PDEBench ``data_gen_NLE/BurgersEq``): ``u_t + (u^2/2)_x = (nu/pi) u_xx`` on
``[0, length)`` periodic; PDEBench stores ``u`` at the cell centres of [0, 1] (1024
cells) at ``t = 0, 0.01, ..., 2``.

Scheme: finite volumes, MUSCL reconstruction with the van Leer limiter, Rusanov
(local Lax-Friedrichs) flux, central viscous flux, SSP-RK2 (Heun) in time. It is
conservative (flux differences telescope), TVD (non-oscillatory at nu = 0.001 and
nx = 1024) and 2nd order on smooth solutions. PDEBench itself uses MUSCL with a
monotonised-central limiter and a midpoint predictor-corrector.

Time step: ``dt = cfl / (max|u| / dx + 2 nu_eff / dx^2)``, taken per chunk of samples and
recomputed at every output time. ``max|u|`` cannot grow (maximum principle of the PDE
and of the TVD scheme), so a step size fixed between two output times stays stable and
no device-to-host sync is needed inside that interval. Samples are sorted by
``max|u0|`` before chunking so slow samples do not take the fastest sample's steps.
`solve_burgers_blocks` keeps one step size per fixed block of samples instead (the
data generator's determinism unit) and advances all blocks in one batch, for GPUs.
Diffusion is explicit while it does not limit the step; where it would (nu >~ 0.005 at
nx = 1024), the viscous term is Strang-split and applied exactly in Fourier space, so
the step is set by advection alone (PDEBench keeps the explicit diffusive limit).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

_CFL = 0.45  # forward-Euler TVD bound for MUSCL + van Leer is 0.5; SSP-RK2 keeps it.
_CPU_CHUNK = 128  # 128 x 1024 float64 = 1 MiB per temporary: a stage stays in L2/L3.
# Compile only when eager would take longer than the ~20-30 s an inductor build costs
# (measured: eager ~70 ns, compiled ~18 ns per cell-step on one AMD EPYC core).
_COMPILE_MIN_CELL_STEPS = 3e8


def burgers_rhs(u_BX: torch.Tensor, nu_eff: float | torch.Tensor, dx: float) -> torch.Tensor:
    """Semi-discrete right-hand side ``-(F_{i+1/2} - F_{i-1/2}) / dx``, shape [B, X].

    ``nu_eff`` is a float, or a [B, 1] tensor (one diffusion coefficient per row).
    """
    du_fwd = torch.roll(u_BX, -1, dims=-1) - u_BX  # u_{i+1} - u_i, lives on face i+1/2
    du_bwd = torch.roll(du_fwd, 1, dims=-1)  # u_i - u_{i-1}
    # van Leer: harmonic mean of the one-sided slopes, 0 at extrema.
    prod = du_fwd * du_bwd
    denom = du_fwd + du_bwd
    half_slope = torch.clamp_min(prod, 0.0) / torch.where(denom == 0.0, 1.0, denom)
    u_left = u_BX + half_slope  # face i+1/2 seen from cell i
    u_right = torch.roll(u_BX - half_slope, -1, dims=-1)  # face i+1/2 seen from cell i+1
    speed = torch.maximum(u_left.abs(), u_right.abs())
    flux = 0.25 * (u_left * u_left + u_right * u_right) - 0.5 * speed * (u_right - u_left)
    if isinstance(nu_eff, torch.Tensor) or nu_eff != 0.0:
        flux = flux - (nu_eff / dx) * du_fwd
    return (torch.roll(flux, 1, dims=-1) - flux) / dx


def _ssp_rk2(u_BX: torch.Tensor, dt: torch.Tensor, nu_eff, dx: float) -> torch.Tensor:
    """One SSP-RK2 (Heun) step; ``dt`` is a 0-dim or [B, 1] tensor, ``nu_eff`` as in `burgers_rhs`."""
    u1 = u_BX + dt * burgers_rhs(u_BX, nu_eff, dx)
    return 0.5 * (u_BX + u1 + dt * burgers_rhs(u1, nu_eff, dx))


_compiled_step = None


def _get_step(use_compile: bool):
    """Return ``step(u, dt_tensor, nu_eff, dx)``; compiled (one fused kernel) if asked.

    ``dt`` travels as a 0-dim tensor so a new step size does not trigger a recompile.
    """
    global _compiled_step  # a cache of a pure function, not state: safe to share
    if not use_compile:
        return _ssp_rk2
    if _compiled_step is None:
        _compiled_step = torch.compile(_ssp_rk2, dynamic=False)
    return _compiled_step


def _evolve_chunk(u_BX, t_T, nu_eff, dx, cfl, out_BTX, step, on_interval) -> None:
    """Advance one chunk through all output times, writing into ``out_BTX``.

    When diffusion would limit the explicit step (``2 nu / dx^2 > max|u| / dx``) the
    interval is Strang-split instead: the advective step runs with its own CFL and the
    viscous term is applied exactly in Fourier space. The symbol used,
    ``(4 / dx^2) sin^2(pi k / X)``, is that of the same 3-point viscous flux, so both paths
    discretise the same semi-discrete system; mode 0 is untouched (the mean is conserved).
    """
    nx = u_BX.shape[-1]
    symbol_K = (4.0 / dx**2) * torch.sin(
        math.pi * torch.arange(nx // 2 + 1, dtype=u_BX.dtype, device=u_BX.device) / nx
    ) ** 2
    t_now = 0.0
    for i, t_next in enumerate(t_T):
        dt_total = t_next - t_now
        if dt_total > 0.0:
            umax = float(u_BX.abs().max())  # one sync per output interval, not per step
            split = 2.0 * nu_eff / dx**2 > umax / dx
            rate = _rate(umax, 0.0 if split else nu_eff, dx)
            n_steps = max(1, math.ceil(dt_total * rate / cfl))
            dt = torch.tensor(dt_total / n_steps, dtype=u_BX.dtype, device=u_BX.device)
            if split:
                heat_half_K = torch.exp(-nu_eff * symbol_K * (0.5 * dt))
                u_BX = _heat(u_BX, heat_half_K)
                for k in range(n_steps):
                    u_BX = step(u_BX, dt, 0.0, dx)
                    # Two consecutive half heat steps merge into one full one.
                    u_BX = _heat(u_BX, heat_half_K if k == n_steps - 1 else heat_half_K**2)
            else:
                for _ in range(n_steps):
                    u_BX = step(u_BX, dt, nu_eff, dx)
            t_now = t_next
        out_BTX[:, i] = u_BX.to(out_BTX.dtype)
        on_interval()


def _heat(u_BX: torch.Tensor, factor_K: torch.Tensor) -> torch.Tensor:
    """Exact periodic discrete-heat propagator applied in Fourier space."""
    return torch.fft.irfft(torch.fft.rfft(u_BX, dim=-1) * factor_K, n=u_BX.shape[-1], dim=-1)


def _rate(umax: float, nu_eff: float, dx: float) -> float:
    """Inverse of the largest stable step at Courant number 1."""
    return umax / dx + 2.0 * nu_eff / dx**2 + 1e-300


def solve_burgers(
    u0_NX,
    nu: float,
    t_T,
    *,
    length: float = 1.0,
    progress: bool = False,
    cfl: float = _CFL,
    chunk: int | None = None,
    compile: bool | None = None,
    out_dtype=np.float32,
):
    """Solve ``u_t + (u^2/2)_x = (nu/pi) u_xx`` on ``[0, length)`` periodic.

    Args:
        u0_NX: cell values at ``x_i = (i + 0.5) length / X``, shape [N, X]; a numpy
            array, or a torch tensor (then the computation runs on its device).
        nu: PDEBench's viscosity parameter; the diffusion coefficient is ``nu / pi``.
        t_T: non-decreasing output times >= 0, shape [T]; ``t = 0`` returns ``u0``.
        length: period of the domain.
        progress: show a tqdm bar over chunks x output times.
        cfl: Courant number of the combined advective/diffusive limit (<= 0.5).
        chunk: samples advanced together; default 128 on CPU (cache-sized), all on GPU.
        compile: fuse a time step with ``torch.compile`` (needs a C++ compiler on CPU,
            about 20-30 s to build, ~4x faster per step). ``None``: only for large jobs;
            falls back to eager with a warning if compilation fails.
        out_dtype: numpy dtype of the result (the state is always float64).

    Returns:
        [N, T, X] array of ``out_dtype``; a torch tensor on the input's device if the
        input was a tensor.
    """
    is_tensor = isinstance(u0_NX, torch.Tensor)
    u_NX, t_T = _checked_inputs(u0_NX, nu, t_T, cfl)
    n, nx = u_NX.shape
    dx = length / nx
    nu_eff = nu / math.pi
    out_NTX = torch.empty((n, t_T.size, nx), dtype=_torch_dtype(out_dtype), device=u_NX.device)
    if chunk is None:
        chunk = _CPU_CHUNK if u_NX.device.type == "cpu" else max(n, 1)
    chunk = max(1, min(chunk, n))
    if compile is None:
        compile = _worth_compiling(u_NX, t_T, nu_eff, dx, cfl)
    step = _get_step(compile)

    # Sort by speed so each chunk's CFL step suits all of its samples.
    order = torch.argsort(u_NX.abs().amax(dim=-1)) if n else torch.arange(0)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=math.ceil(n / chunk) * t_T.size, desc="burgers")
    with torch.no_grad():
        for start in range(0, n, chunk):
            idx = order[start : start + chunk]
            step = _solve_chunk(u_NX, idx, chunk, compile, t_T, nu_eff, dx, cfl, out_NTX, step,
                                bar.update if bar else _noop)
    if bar is not None:
        bar.close()
    return out_NTX if is_tensor else out_NTX.cpu().numpy()


def _solve_chunk(u_NX, idx, chunk: int, compile: bool, t_T, nu_eff: float, dx: float, cfl: float, out_NTX, step,
                 update):
    """Advance the samples ``idx`` together into ``out_NTX[idx]``; returns the step the next chunk uses."""
    u_BX = u_NX[idx]
    if compile and idx.numel() < chunk:
        # Pad the last chunk with zero rows (they stay zero): a new shape would cost a second compilation.
        u_BX = torch.cat([u_BX, u_BX.new_zeros(chunk - idx.numel(), u_NX.shape[1])])
    out_BTX = torch.empty((u_BX.shape[0], t_T.size, u_NX.shape[1]), dtype=out_NTX.dtype, device=u_NX.device)
    step = _evolve_or_fall_back(u_BX, t_T, nu_eff, dx, cfl, out_BTX, step, update)
    out_NTX[idx] = out_BTX[: idx.numel()]
    return step


def _worth_compiling(u_NX: torch.Tensor, t_T: np.ndarray, nu_eff: float, dx: float, cfl: float) -> bool:
    """Compile the time step only for large CPU jobs (the ~20-30 s build must pay for itself)."""
    n = u_NX.shape[0]
    umax = float(u_NX.abs().max()) if n else 0.0
    t_end = float(t_T.max()) if t_T.size else 0.0
    cell_steps = n * u_NX.shape[1] * t_end * _rate(umax, nu_eff, dx) / cfl
    return u_NX.device.type == "cpu" and cell_steps > _COMPILE_MIN_CELL_STEPS


def _evolve_or_fall_back(u_BX, t_T, nu_eff: float, dx: float, cfl: float, out_BTX, step, update):
    """`_evolve_chunk` with ``step``; a compiled step that fails to build falls back to eager (with
    a warning) for this chunk and the next. Returns the step the next chunk uses."""
    try:
        _evolve_chunk(u_BX, t_T, nu_eff, dx, cfl, out_BTX, step, update)
        return step
    except Exception as err:  # noqa: BLE001 - any inductor/compiler failure
        if step is _ssp_rk2:
            raise
        warnings.warn(f"torch.compile failed ({err!r}); Burgers runs eager", stacklevel=4)
        _evolve_chunk(u_BX, t_T, nu_eff, dx, cfl, out_BTX, _ssp_rk2, update)
        return _ssp_rk2


def _checked_inputs(u0_NX, nu: float, t_T, cfl: float) -> tuple[torch.Tensor, np.ndarray]:
    """(float64 tensor [N, X] on the input's device, float64 times [T]); `ValueError` if bad."""
    is_tensor = isinstance(u0_NX, torch.Tensor)
    u_NX = (u0_NX if is_tensor else torch.from_numpy(np.asarray(u0_NX))).to(torch.float64)
    t_T = np.asarray(t_T, dtype=np.float64).reshape(-1)
    if u_NX.ndim != 2:
        raise ValueError(f"u0_NX must have shape [N, X], got {tuple(u_NX.shape)}")
    if t_T.size and (t_T[0] < 0.0 or np.any(np.diff(t_T) < 0.0)):
        raise ValueError("t_T must be non-decreasing and >= 0")
    if not bool(torch.isfinite(u_NX).all()):
        raise ValueError("u0_NX contains non-finite values")
    if nu < 0.0 or not 0.0 < cfl <= 0.5:
        raise ValueError(f"need nu >= 0 and 0 < cfl <= 0.5, got nu={nu}, cfl={cfl}")
    return u_NX, t_T


def solve_burgers_blocks(
    u0_NX: torch.Tensor,
    nu: float,
    t_T,
    *,
    block: int,
    length: float = 1.0,
    cfl: float = _CFL,
    out_dtype=np.float32,
) -> torch.Tensor:
    """`solve_burgers` on each block of ``block`` consecutive rows, all blocks in one batch.

    Sample ``i`` gets the time steps that ``solve_burgers(u0_NX[b:b + block], chunk=block)``
    gives its block (``b = block * (i // block)``; the last block may be shorter): a step
    size and a split/explicit choice per block and output interval. The blocks then
    advance together as rows of one [N, X] batch, so a GPU runs few large kernels instead
    of one small batch per block. A block that needs fewer steps than the slowest one
    stops stepping when its steps are done, so each sample's result does not depend on
    the other blocks. Eager only: no ``torch.compile``.

    Args:
        u0_NX: cell values at ``x_i = (i + 0.5) length / X``, tensor [N, X] on any device.
        nu: PDEBench's viscosity parameter; the diffusion coefficient is ``nu / pi``.
        t_T: non-decreasing output times >= 0, shape [T].
        block: samples sharing one step size (``generate.SOLVE_BLOCK``), >= 1.
        length: period of the domain.
        cfl: Courant number, as in `solve_burgers`.
        out_dtype: numpy dtype of the result (the state is always float64).

    Returns:
        tensor [N, T, X] of ``out_dtype`` on the input's device.
    """
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    u_NX, t_T = _checked_inputs(u0_NX, nu, t_T, cfl)
    n, nx = u_NX.shape
    out_NTX = torch.empty((n, t_T.size, nx), dtype=_torch_dtype(out_dtype), device=u_NX.device)
    if n == 0:
        return out_NTX
    n_blocks = math.ceil(n / block)
    # Zero rows pad the last block: they stay zero and do not raise its max|u|.
    u_RX = torch.cat([u_NX, u_NX.new_zeros(n_blocks * block - n, nx)])
    dx, nu_eff = length / nx, nu / math.pi
    symbol_K = (4.0 / dx**2) * torch.sin(
        math.pi * torch.arange(nx // 2 + 1, dtype=u_RX.dtype, device=u_RX.device) / nx
    ) ** 2
    t_now = 0.0
    with torch.no_grad():
        for i, t_next in enumerate(t_T):
            if t_next - t_now > 0.0:
                u_RX = _advance_blocks(u_RX, t_next - t_now, block, nu_eff, dx, cfl, symbol_K)
                t_now = t_next
            out_NTX[:, i] = u_RX[:n].to(out_NTX.dtype)
    return out_NTX


def _advance_blocks(u_RX, dt_total: float, block: int, nu_eff: float, dx: float, cfl: float, symbol_K):
    """Advance rows [R, X] (R a multiple of ``block``) by ``dt_total``, each block with its own plan.

    The plan of a block repeats `_evolve_chunk`'s arithmetic on the same Python floats,
    so a block's step size is the one a separate `solve_burgers` call would take. Blocks
    are reordered by step count (most first) so that at step k the blocks still stepping
    are a prefix of the rows: only that prefix is computed, the others keep their state.
    """
    device, n_blocks = u_RX.device, u_RX.shape[0] // block
    umax_G = u_RX.abs().view(n_blocks, -1).amax(dim=1).tolist()  # the one sync per interval
    split_G = [2.0 * nu_eff / dx**2 > umax / dx for umax in umax_G]
    steps_G = [max(1, math.ceil(dt_total * _rate(umax, 0.0 if split else nu_eff, dx) / cfl))
               for umax, split in zip(umax_G, split_G)]
    order_G = sorted(range(n_blocks), key=lambda g: -steps_G[g])  # stable: ties keep their order
    row_R = (torch.tensor(order_G)[:, None] * block + torch.arange(block)).reshape(-1).to(device)
    u_RX = u_RX[row_R]  # a copy in plan order, so the prefix updates below are safe

    def rows(values, dtype):  # per-block values in plan order -> a [R, 1] column on the device
        return torch.tensor([values[g] for g in order_G], dtype=dtype).repeat_interleave(block)[:, None].to(device)

    dt_R1 = rows([dt_total / k for k in steps_G], torch.float64)
    if not any(split_G):
        nu_rows = nu_eff  # a float keeps the explicit path bit-identical to `_evolve_chunk`
    elif all(split_G):
        nu_rows = 0.0
    else:
        nu_rows = rows([0.0 if split else nu_eff for split in split_G], torch.float64)
    if any(split_G):
        split_R1, steps_R1 = rows(split_G, torch.bool), rows(steps_G, torch.int64)
        heat_half_RK = torch.exp(-nu_eff * symbol_K * (0.5 * dt_R1))
        heat_full_RK = heat_half_RK**2  # two consecutive half heat steps merge into one
        u_RX = torch.where(split_R1, _heat(u_RX, heat_half_RK), u_RX)
    n_stepping = n_blocks
    for k in range(steps_G[order_G[0]]):
        while steps_G[order_G[n_stepping - 1]] <= k:  # host-side plan: no sync
            n_stepping -= 1
        m = n_stepping * block
        nu_m = nu_rows[:m] if isinstance(nu_rows, torch.Tensor) else nu_rows
        stepped_MX = _ssp_rk2(u_RX[:m], dt_R1[:m], nu_m, dx)
        if any(split_G):
            factor_MK = torch.where(steps_R1[:m] == k + 1, heat_half_RK[:m], heat_full_RK[:m])
            stepped_MX = torch.where(split_R1[:m], _heat(stepped_MX, factor_MK), stepped_MX)
        if m == u_RX.shape[0]:
            u_RX = stepped_MX
        else:
            u_RX[:m] = stepped_MX
    return torch.empty_like(u_RX).index_copy_(0, row_R, u_RX)  # back to sample order


def _noop() -> None:
    pass


def _torch_dtype(np_dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype
