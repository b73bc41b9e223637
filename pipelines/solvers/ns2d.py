# long file: one solver: two cited conventions, spectral operators and the IF-RK4 loop belong together
"""Incompressible Navier-Stokes in 2D, vorticity form, periodic; batched pseudo-spectral in torch.

Legend: B samples, T output times, X = Y solve grid points per side, S stored points per side,
K = Y // 2 + 1 real-FFT modes along y, R resolution of a drawn field.

Equation: ``w_t + u . grad(w) = nu lap(w) - drag w + f`` with ``lap(psi) = -w``,
``u_x = psi_y``, ``u_y = -psi_x``. Axis 0 is x, axis 1 is y; grid nodes ``x_i = i L / X``.

FNO benchmark (Li et al. 2021; read in neuraloperator/neuraloperator
``data_generation/navier_stokes/ns_2d.py`` and ``random_fields.py``, same script as
zongyi-li/fourier_neural_operator; none of its code is reused):

* unit square, nodes ``linspace(0, 1, s + 1)[:-1]`` meshed with ``indexing='ij'``; s = 256;
  forcing ``0.1 (sin(2 pi (x + y)) + cos(2 pi (x + y)))``; visc 1e-3; T = 50.
* ``w0 = GaussianRF(2, s, alpha=2.5, tau=7)``: Fourier coefficients
  ``s^2 sqrt(2) sigma (4 pi^2 |k|^2 + tau^2)^(-alpha/2)`` times a complex standard normal,
  ``sigma = tau^(alpha - 1)``, mode 0 zeroed, real part of the inverse FFT.
* scheme: Poisson solve in Fourier space, ``u . grad(w)`` formed in physical space, 2/3
  mask ``|k_x|, |k_y| <= 2/3 k_max`` on that term only, Crank-Nicolson viscosity with the
  nonlinear term and forcing explicit (forward Euler: 1st order), fixed ``delta_t = 1e-4``.
* storage: the script records every ``steps / record_steps`` steps starting at
  ``t = T / record_steps`` and never ``t = 0``; ``w0`` is saved separately as ``a``. The
  training scripts use ``u`` alone (``fourier_3d.py``: ``u[..., :10]``, i.e. t = 1..10, in;
  ``u[..., 10:50]`` out) at 64 points; the paper solves at 256 and downsamples to 64, and
  the scripts downsample by ``[::sub, ::sub]``.

What we do the same: grid, GRF spectrum, forcing, Poisson solve, advective form, the mask.
What differs: time stepping is integrating-factor RK4 (Lawson): viscosity and drag are
exact, nonlinear term and forcing 4th order, with an adaptive CFL step. First derivatives
use 0 for the Nyquist wavenumber (FNO keeps ``-k_max``; the derivative of the Nyquist
cosine is a sine that vanishes on every node, so 0 is its value on the grid); then
``sum(u . grad w)`` cancels mode by mode, so the mean vorticity is conserved to round-off.
Storage: step 0 is the initial state (after any spin-up), the other steps the requested
times: ``times = 0, 1, ..., 50`` gives FNO's ``a`` as step 0 and FNO's ``u`` as steps
1..50 (T = 51 stored steps including t = 0). Downsampling takes every k-th node, as
FNO does: the node grids are nested, so the stored values are the fine solution's point
values at the coarse nodes (modes above the coarse Nyquist alias, as in FNO's data).

Kolmogorov flow (google/jax-cfd ``spectral/equations.py::ForcedNavierStokes2D``: wave
number 4, ``drag=0.1``, linear term ``viscosity * laplace - drag``;
``spectral/forcings.py::kolmogorov_forcing_fn``: vorticity forcing ``-4 cos(4 y)``, the curl
of ``sin(4 y)`` in the x-momentum; the ``kolmogorov_forcing.gin`` of Sun et al.'s TSM-PDE,
whose data PDE-Refiner uses: scale 1, wavenumber 4, linear_coefficient -0.1, viscosity
1e-3, domain [0, 2 pi]^2, ``filtered_velocity_field(max_velocity=7)`` start, 40 time units
of warm-up discarded). We solve it with the same pseudo-spectral scheme, start from the
FNO GRF scaled to a maximum speed of 7, and discard a caller-chosen ``spinup``.

Decaying flow (``forcing="decaying"``): the Kolmogorov flow's square, drag, viscosity and start
with the forcing off, so its energy only decays (``dE/dt = -2 nu Z - 2 drag E``). It is the
mixture's Navier-Stokes at the Kolmogorov flow's scales and speeds but another forcing
(issue 50's held-out Kolmogorov flow: "fields the mixture knows, other forcing").

Kolmogorov flows at wavenumbers 1, 2 and 3 (``forcing="kolmogorov_k<k>"``): the Kolmogorov setting
forced by ``sin(k y)`` (vorticity ``-k cos(k y)``), forced flows of other forcing for the same mixture.
From rest, any Kolmogorov forcing grows the shear ``w = f (1 - exp(-lam t)) / lam``,
``lam = nu k^2 + drag``, exactly: a flow along x that varies only in y does not advect its vorticity.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

import pipelines.solvers.libm as libm

FIELDS = ("vorticity", "velocity_x", "velocity_y")
# Kolmogorov forcings: the wavenumber k of sin(k y) in the x-momentum. Each, and "decaying" (unforced),
# is the Kolmogorov setting: [0, 2 pi]^2, drag 0.1, TSM's start.
KOLMOGOROV_WAVENUMBER = {"kolmogorov": 4, "kolmogorov_k1": 1, "kolmogorov_k2": 2, "kolmogorov_k3": 3}
_KOLMOGOROV_SETTING = (*KOLMOGOROV_WAVENUMBER, "decaying")
FORCINGS = ("fno", *_KOLMOGOROV_SETTING, "none")  # "none": unforced unit square

_LENGTH = {"fno": 1.0, "none": 1.0, **dict.fromkeys(_KOLMOGOROV_SETTING, 2.0 * math.pi)}
_DRAG = {"fno": 0.0, "none": 0.0, **dict.fromkeys(_KOLMOGOROV_SETTING, 0.1)}
# The maximum speed a start is scaled to (TSM-PDE's --max_velocity for jax-cfd's filtered_velocity_field);
# a forcing not listed starts from the GRF as drawn.
_START_SPEED = dict.fromkeys(_KOLMOGOROV_SETTING, 7.0)
# IF-RK4 is stable for imaginary eigenvalues up to 2 sqrt(2) ~ 2.83 in modulus. Advection's
# largest is <= (pi / dx) (max|u_x| + max|u_y|), so this puts it at pi / 2 ~ 1.57: the speed
# may grow 1.8x within one interval before the step size (fixed per interval) goes unstable.
_CFL = 0.5
_MAX_INTERVAL = 1.0  # the step size is recomputed (one host sync) at least this often


class _Ops(NamedTuple):
    """Spectral operators on the rfft2 layout [X, K] of one n x n grid (float64 / complex128)."""

    ikx: torch.Tensor  # i kappa_x for first derivatives, [X, 1], Nyquist zeroed
    iky: torch.Tensor  # i kappa_y, [1, K], Nyquist zeroed
    inv_lap: torch.Tensor  # 1 / |kappa|^2, 0 at the mean mode (psi has no mean)
    mask: torch.Tensor  # FNO's 2/3 rule on the nonlinear term
    linear: torch.Tensor  # -(nu |kappa|^2 + drag): the exactly integrated part
    forcing: torch.Tensor  # rfft2 of f on the grid
    n: int
    dx: float
    growth: float  # max|u_x| + max|u_y| of the velocity the forcing alone adds per unit time


def _derivatives(n: int, length: float, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(i kappa_x [X, 1], i kappa_y [1, K], |kappa|^2 [X, K])`` for ``[0, length)^2``.

    Integer wavenumbers in FFT order (``-n/2`` at the Nyquist index, as FNO). First
    derivatives use 0 there: on the nodes the Nyquist mode is ``cos(pi x / dx)`` and its
    derivative, a sine, vanishes at every node. It also keeps each derivative odd in k,
    hence real and skew-adjoint. The Laplacian (an even derivative) keeps ``(n/2)^2``.
    """
    scale = 2.0 * math.pi / length
    kx = ((torch.arange(n, device=device) + n // 2) % n - n // 2).to(torch.float64)[:, None]
    ky = torch.arange(n // 2 + 1, device=device).to(torch.float64)[None, :]
    lap = scale**2 * (kx**2 + ky**2)
    if n % 2 == 0:
        kx, ky = torch.where(kx.abs() == n // 2, 0.0, kx), torch.where(ky == n // 2, 0.0, ky)
    return 1j * scale * kx, 1j * scale * ky, lap


def _inverse(lap: torch.Tensor) -> torch.Tensor:
    """``1 / lap`` with 0 at the mean mode (where ``lap == 0``)."""
    return torch.where(lap > 0, 1.0 / torch.where(lap > 0, lap, 1.0), 0.0)


def _operators(n: int, forcing: str, nu: float, device) -> _Ops:
    """Build the operators for an ``n x n`` grid of the given setting."""
    ikx, iky, lap = _derivatives(n, _LENGTH[forcing], device)
    kmax = n // 2
    # FNO's mask compares integer wavenumbers with 2/3 k_max on each axis.
    ix = ((torch.arange(n, device=device) + kmax) % n - kmax).abs()[:, None]
    iy = torch.arange(n // 2 + 1, device=device)[None, :]
    mask = ((ix <= 2.0 / 3.0 * kmax) & (iy <= 2.0 / 3.0 * kmax)).to(torch.float64)
    f_hat = torch.fft.rfft2(_forcing_grid(forcing, n, device))
    f_hat[0, 0] = 0.0  # every forcing has zero mean; the FFT of the samples leaves ~1e-17
    fx_hat, fy_hat = _velocity_hat(f_hat, ikx, iky, _inverse(lap))
    growth = sum(float(torch.fft.irfft2(h, s=(n, n)).abs().max()) for h in (fx_hat, fy_hat))
    return _Ops(ikx, iky, _inverse(lap), mask, -(nu * lap + _DRAG[forcing]), f_hat, n,
                _LENGTH[forcing] / n, growth)


def _forcing_grid(forcing: str, n: int, device) -> torch.Tensor:
    """The vorticity forcing on the nodes, shape [X, Y]."""
    x = torch.arange(n, dtype=torch.float64, device=device) * (_LENGTH[forcing] / n)
    x_XY, y_XY = torch.meshgrid(x, x, indexing="ij")
    if forcing == "fno":
        phase = 2.0 * math.pi * (x_XY + y_XY)
        return 0.1 * (torch.sin(phase) + torch.cos(phase))
    if forcing in KOLMOGOROV_WAVENUMBER:
        k = float(KOLMOGOROV_WAVENUMBER[forcing])
        return -k * torch.cos(k * y_XY)  # curl of (sin(k y), 0)
    return torch.zeros_like(x_XY)


def _velocity_hat(w_hat: torch.Tensor, ikx, iky, inv_lap) -> tuple[torch.Tensor, torch.Tensor]:
    """Fourier coefficients of ``(u_x, u_y) = (psi_y, -psi_x)`` with ``psi_hat = w_hat / |kappa|^2``."""
    psi_hat = w_hat * inv_lap
    return iky * psi_hat, -ikx * psi_hat


def velocity_from_vorticity(w_BXY: torch.Tensor, *, length: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Velocity of a periodic vorticity field on ``[0, length)^2`` (spectral, divergence-free).

    Args:
        w_BXY: vorticity on the nodes, shape [B, X, X] (any float dtype; computed in float64).
        length: side of the periodic square (1 for FNO, 2 pi for Kolmogorov).

    Returns:
        ``(u_x, u_y)``, each float64 [B, X, X] on the input's device. The mean of ``w``
        does not enter (no periodic velocity has a vorticity with nonzero mean).
    """
    n = w_BXY.shape[-1]
    ikx, iky, lap = _derivatives(n, length, w_BXY.device)
    ux_hat, uy_hat = _velocity_hat(torch.fft.rfft2(w_BXY.to(torch.float64)), ikx, iky, _inverse(lap))
    return torch.fft.irfft2(ux_hat, s=(n, n)), torch.fft.irfft2(uy_hat, s=(n, n))


def _rhs(w_hat: torch.Tensor, ops: _Ops) -> torch.Tensor:
    """Explicit part ``-mask * FFT(u . grad w) + f_hat``, [B, X, K]."""
    ux_hat, uy_hat = _velocity_hat(w_hat, ops.ikx, ops.iky, ops.inv_lap)
    # One batched inverse FFT for the four fields: fewer, larger kernels.
    spectra = torch.stack((ux_hat, uy_hat, ops.ikx * w_hat, ops.iky * w_hat))
    ux, uy, wx, wy = torch.fft.irfft2(spectra, s=(ops.n, ops.n))
    return ops.forcing - ops.mask * torch.fft.rfft2(ux * wx + uy * wy)


def _if_rk4(w_hat: torch.Tensor, dt: float, e_half: torch.Tensor, ops: _Ops) -> torch.Tensor:
    """One integrating-factor RK4 (Lawson) step; ``e_half = exp(linear dt / 2)``.

    The linear part is integrated exactly (a single Fourier mode with no nonlinear
    interaction decays by exactly ``exp(linear t)``); the rest is classical RK4.
    """
    e_full = e_half * e_half
    k1 = _rhs(w_hat, ops)
    k2 = _rhs(e_half * (w_hat + 0.5 * dt * k1), ops)
    k3 = _rhs(e_half * w_hat + 0.5 * dt * k2, ops)
    k4 = _rhs(e_full * w_hat + dt * e_half * k3, ops)
    return e_full * w_hat + (dt / 6.0) * (e_full * k1 + 2.0 * e_half * (k2 + k3) + k4)


def _advance(w_hat: torch.Tensor, duration: float, ops: _Ops, max_dt: float) -> torch.Tensor:
    """Advance by ``duration`` in sub-intervals of at most `_MAX_INTERVAL`, one step size each.

    The step size comes from the speed at the start of a sub-interval plus what the forcing
    alone could add over it: one device-to-host sync per sub-interval, none per step.
    """
    n_sub = max(1, math.ceil(duration / _MAX_INTERVAL - 1e-12))
    span = duration / n_sub
    for _ in range(n_sub):
        ux_hat, uy_hat = _velocity_hat(w_hat, ops.ikx, ops.iky, ops.inv_lap)
        speeds = [torch.fft.irfft2(h, s=(ops.n, ops.n)).abs().amax() for h in (ux_hat, uy_hat)]
        speed = float(speeds[0] + speeds[1])  # the sync
        if not math.isfinite(speed):
            raise FloatingPointError("ns2d: the solution became non-finite; lower max_dt or refine the grid")
        dt = min(_CFL * ops.dx / (speed + ops.growth * span + 1e-300), max_dt, span)
        steps = max(1, math.ceil(span / dt - 1e-9))
        dt = span / steps
        e_half = torch.exp(ops.linear * (0.5 * dt))
        for _ in range(steps):
            w_hat = _if_rk4(w_hat, dt, e_half, ops)
    return w_hat


def solve_ns2d(
    w0_BXY: torch.Tensor,
    times,
    *,
    nu: float,
    forcing: str = "fno",
    stored_resolution: int,
    max_dt: float | None = None,
    spinup: float = 0.0,
    progress: Callable[[int], object] | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Solve 2D incompressible Navier-Stokes (vorticity form) on a periodic square.

    Args:
        w0_BXY: initial vorticity on the nodes, [B, X, X]; the computation runs in float64
            on its device (CPU or CUDA). X = 256 for FNO's data.
        times: output times, shape [T], ``times[0] == 0``, non-decreasing. FNO: ``0, 1, ..., 50``.
        nu: viscosity (FNO: 1e-3, harder 1e-4; Kolmogorov: 1e-3).
        forcing: "fno" (unit square), "kolmogorov" ([0, 2 pi]^2, drag 0.1), "kolmogorov_k2" (the
            same forced at wavenumber 2), "decaying" (the Kolmogorov setting unforced) or "none" (the
            unit square unforced).
        stored_resolution: S, a divisor of X; every (X / S)-th node is stored.
        max_dt: optional cap on the time step (the CFL step is used if smaller).
        spinup: time integrated before ``t = 0`` and discarded (Kolmogorov: TSM used 40).
        progress: called with 1 after each stored time (e.g. ``tqdm(total=T).update``).
        out_dtype: dtype of the result (the state is always float64).

    Returns:
        [B, T, S, S, 3] of ``out_dtype`` on the input's device: `FIELDS` (vorticity, u_x, u_y).
        Samples share one step size (the fastest sample's CFL step).
    """
    t_T = _checked_inputs(w0_BXY, times, nu, forcing, stored_resolution, max_dt, spinup)
    n = w0_BXY.shape[1]
    every = n // stored_resolution
    out = torch.empty((w0_BXY.shape[0], t_T.size, stored_resolution, stored_resolution, 3),
                      dtype=out_dtype, device=w0_BXY.device)
    if w0_BXY.shape[0] == 0:
        return out
    ops = _operators(n, forcing, nu, w0_BXY.device)
    cap = math.inf if max_dt is None else max_dt
    with torch.no_grad():
        w_hat = torch.fft.rfft2(w0_BXY.to(torch.float64))
        if spinup > 0.0:
            w_hat = _advance(w_hat, spinup, ops, cap)
        t_now = 0.0
        for i, t_next in enumerate(t_T):
            if t_next > t_now:
                w_hat = _advance(w_hat, float(t_next - t_now), ops, cap)
                t_now = float(t_next)
            ux_hat, uy_hat = _velocity_hat(w_hat, ops.ikx, ops.iky, ops.inv_lap)
            fields = torch.fft.irfft2(torch.stack((w_hat, ux_hat, uy_hat), dim=-1), s=(n, n), dim=(1, 2))
            out[:, i] = fields[:, ::every, ::every].to(out_dtype)
            if progress is not None:
                progress(1)
    return out


def _checked_inputs(w0_BXY, times, nu, forcing, stored_resolution, max_dt, spinup) -> np.ndarray:
    """Float64 output times [T]; `ValueError` naming the first bad argument."""
    t_T = np.asarray(times, dtype=np.float64).reshape(-1)
    if w0_BXY.ndim != 3 or w0_BXY.shape[1] != w0_BXY.shape[2] or w0_BXY.shape[1] < 2:
        raise ValueError(f"w0_BXY must have shape [B, X, X] with X >= 2, got {tuple(w0_BXY.shape)}")
    n = w0_BXY.shape[1]
    if forcing not in FORCINGS:
        raise ValueError(f"forcing must be one of {FORCINGS}, got {forcing!r}")
    if not (isinstance(stored_resolution, int) and 1 <= stored_resolution <= n and n % stored_resolution == 0):
        raise ValueError(f"stored_resolution must divide the solve resolution {n}, got {stored_resolution}")
    if t_T.size == 0 or t_T[0] != 0.0 or np.any(np.diff(t_T) < 0.0) or not np.isfinite(t_T).all():
        raise ValueError("times must be finite, non-decreasing and start at 0")
    if not (nu >= 0.0 and spinup >= 0.0 and (max_dt is None or max_dt > 0.0)):
        raise ValueError(f"need nu >= 0, spinup >= 0, max_dt > 0 or None; got {nu}, {spinup}, {max_dt}")
    if not bool(torch.isfinite(w0_BXY).all()):
        raise ValueError("w0_BXY contains non-finite values")
    return t_T


def gaussian_random_field(n: int, resolution: int, *, rng: np.random.Generator, alpha: float = 2.5,
                          tau: float = 7.0) -> np.ndarray:
    """Draw FNO's periodic Gaussian random field ``GaussianRF(2, R, alpha, tau)`` (zero mean).

    Coefficient of integer mode k: ``R^2 sqrt(2) sigma (4 pi^2 |k|^2 + tau^2)^(-alpha/2)`` times
    ``(a + i b) / sqrt(2)``, ``a, b ~ N(0, 1)``, with ``sigma = tau^(alpha - 1)`` and mode 0
    zeroed; the field is the real part of the inverse FFT (wavenumbers in FFT order, the
    Nyquist mode at ``-R/2``, as in FNO's ``random_fields.py``).

    Args:
        n: number of samples (may be 0).
        resolution: R, grid points per side.
        rng: the only source of randomness.
        alpha, tau: smoothness and inverse length scale (FNO's NS: 2.5 and 7).

    Returns:
        float64 [n, R, R].
    """
    if n < 0 or resolution < 1:
        raise ValueError(f"need n >= 0 and resolution >= 1, got {n}, {resolution}")
    sigma = tau ** (alpha - 1.0)  # FNO: tau ** (0.5 * (2 * alpha - dim)) with dim = 2
    k = np.fft.fftfreq(resolution, 1.0 / resolution)
    sqrt_eig = resolution**2 * math.sqrt(2.0) * sigma * libm.power(
        4.0 * math.pi**2 * (k[:, None] ** 2 + k[None, :] ** 2) + tau**2, -alpha / 2.0)
    sqrt_eig[0, 0] = 0.0
    shape = (n, resolution, resolution)
    xi = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) / math.sqrt(2.0)
    return np.fft.ifft2(sqrt_eig * xi).real


def draw_ns2d_initial(rng: np.random.Generator, resolution: int, *, forcing: str) -> np.ndarray:
    """One sample's initial vorticity, float64 [R, R].

    "fno" and "none": FNO's GRF (alpha 2.5, tau 7). The Kolmogorov forcings and "decaying": the same GRF
    read on [0, 2 pi]^2 and scaled to a maximum speed of 7 (TSM's start), to be spun up by
    `solve_ns2d`'s ``spinup``.
    """
    if forcing not in FORCINGS:
        raise ValueError(f"forcing must be one of {FORCINGS}, got {forcing!r}")
    w_RR = gaussian_random_field(1, resolution, rng=rng)[0]
    if forcing not in _START_SPEED:
        return w_RR
    ux, uy = velocity_from_vorticity(torch.from_numpy(w_RR)[None], length=_LENGTH[forcing])
    return w_RR * (_START_SPEED[forcing] / float(torch.sqrt(ux**2 + uy**2).max()))
