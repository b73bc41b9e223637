"""Numerical checks of pipelines.solvers.ns2d: exact decay, incompressibility, conservation, resolution.

Legend: B samples, T output times, X (= Y) solve grid points, S stored points, K Fourier modes.

Tolerances are set by float64 round-off (~1e-16 per operation, a few hundred operations
per mode), by float32 storage (2^-24 ~ 6e-8 relative), or by the scheme's stated orders;
none depends on the exact floats of one BLAS or CPU.
"""

import math

import numpy as np
import pytest
import torch

from pipelines.solvers.ns2d import (
    FIELDS,
    KOLMOGOROV_WAVENUMBER,
    draw_ns2d_initial,
    gaussian_random_field,
    solve_ns2d,
    velocity_from_vorticity,
)


def nodes(n: int, length: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(n) * length / n
    return np.meshgrid(x, x, indexing="ij")


def spectral_div_curl(ux_BXY: np.ndarray, uy_BXY: np.ndarray, length: float = 1.0):
    """Divergence and curl by numpy FFTs (odd derivatives drop the Nyquist mode)."""
    n = ux_BXY.shape[-1]
    k = np.fft.fftfreq(n, 1.0 / n)
    k[n // 2] = 0.0
    ikx, iky = (2j * np.pi / length) * k[:, None], (2j * np.pi / length) * k[None, :]
    ux_hat, uy_hat = np.fft.fft2(ux_BXY), np.fft.fft2(uy_BXY)
    div = np.fft.ifft2(ikx * ux_hat + iky * uy_hat).real
    curl = np.fft.ifft2(ikx * uy_hat - iky * ux_hat).real
    return div, curl


def smooth_grf(n_samples: int, n: int, *, seed: int, kmax: int = 7) -> np.ndarray:
    """FNO GRF low-passed to |k_x|, |k_y| <= kmax: exactly representable on any grid with n > 2 kmax."""
    w = gaussian_random_field(n_samples, n, rng=np.random.default_rng(seed))
    k = np.abs(np.fft.fftfreq(n, 1.0 / n))
    keep = (k[:, None] <= kmax) & (k[None, :] <= kmax)
    return np.fft.ifft2(np.fft.fft2(w) * keep).real


# --------------------------------------------------------------------------- exact solutions


@pytest.mark.parametrize("k1, k2", [(1, 2), (3, -1), (0, 4)])
def test_single_mode_decays_exactly(k1, k2):
    # w0 = cos(2 pi (k1 x + k2 y)) has psi parallel to w, so u . grad(w) = 0 and, unforced,
    # w = exp(-nu |k|^2 t) w0 with |k|^2 = 4 pi^2 (k1^2 + k2^2). The integrating factor
    # integrates the viscous term exactly (no CN error of O((nu |k|^2 dt)^3) per step), so
    # the float64 result is exact up to round-off (~1e-14 after the steps taken); 1e-10
    # leaves margin. The float32 result is checked to 1e-6 (float32 rounding is 6e-8).
    # nu keeps the decay above 1e-3, so the ~1e-16 round-off of the sampled cosine (in
    # modes that decay slower) stays below 1e-13 of the amplitude.
    nu, n = 0.005, 32
    x, y = nodes(n)
    w0 = np.cos(2 * np.pi * (k1 * x + k2 * y))
    t_T = np.array([0.0, 0.25, 1.0, 2.0])
    out = solve_ns2d(torch.from_numpy(w0)[None], t_T, nu=nu, forcing="none", stored_resolution=n,
                     out_dtype=torch.float64)[0].numpy()
    out32 = solve_ns2d(torch.from_numpy(w0)[None], t_T, nu=nu, forcing="none", stored_resolution=n)[0]
    k_sq = 4 * np.pi**2 * (k1**2 + k2**2)
    decay_T = np.exp(-nu * k_sq * t_T)
    # psi = w / |k|^2, u_x = psi_y, u_y = -psi_x (FNO's signs).
    sin = np.sin(2 * np.pi * (k1 * x + k2 * y))
    exact_TXYF = decay_T[:, None, None, None] * np.stack(
        [w0, -2 * np.pi * k2 * sin / k_sq, 2 * np.pi * k1 * sin / k_sq], axis=-1)
    scale_T = decay_T[:, None, None]  # per-time relative error, vorticity amplitude
    assert (np.abs(out[..., 0] - exact_TXYF[..., 0]) / scale_T).max() < 1e-10
    assert (np.abs(out[..., 1:] - exact_TXYF[..., 1:]).max(axis=-1) / scale_T).max() < 1e-10
    assert out32.dtype == torch.float32
    assert (np.abs(out32.numpy()[..., 0] - exact_TXYF[..., 0]) / scale_T).max() < 1e-6


def test_velocity_is_divergence_free_and_has_the_right_curl():
    for length in (1.0, 2 * np.pi):
        w = gaussian_random_field(3, 64, rng=np.random.default_rng(0))
        ux, uy = (u.numpy() for u in velocity_from_vorticity(torch.from_numpy(w), length=length))
        div, curl = spectral_div_curl(ux, uy, length)
        # Spectral derivatives: max|grad u| <= (pi n / length) max|u|. Both checks are a few
        # FFTs of 4096 points away from exact, i.e. round-off ~1e-15 of that scale.
        scale = np.pi * 64 / length * max(np.abs(ux).max(), np.abs(uy).max())
        assert np.abs(div).max() < 1e-12 * scale
        # curl u = -lap(psi) = w for a zero-mean w without Nyquist content (on the Nyquist
        # lines first derivatives are 0, so there the curl is only part of -lap(psi)).
        w = smooth_grf(3, 64, seed=0, kmax=31)
        ux, uy = (u.numpy() for u in velocity_from_vorticity(torch.from_numpy(w), length=length))
        _, curl = spectral_div_curl(ux, uy, length)
        assert np.abs(curl - w).max() < 1e-12 * np.abs(w).max()


def test_stored_velocity_is_divergence_free_and_matches_vorticity():
    w0 = gaussian_random_field(2, 32, rng=np.random.default_rng(1))
    out = solve_ns2d(torch.from_numpy(w0), [0.0, 1.0, 2.0], nu=1e-3, stored_resolution=32,
                     out_dtype=torch.float64).numpy()
    div, _ = spectral_div_curl(out[..., 1], out[..., 2])
    assert np.abs(div).max() < 1e-12 * np.pi * 32 * np.abs(out[..., 1:]).max()  # round-off, as above
    # The stored velocity is the helper's velocity of the stored vorticity.
    ux, uy = velocity_from_vorticity(torch.from_numpy(out[:, -1, ..., 0]))
    assert np.abs(ux.numpy() - out[:, -1, ..., 1]).max() < 1e-13 * np.abs(out[..., 1]).max()
    assert np.abs(uy.numpy() - out[:, -1, ..., 2]).max() < 1e-13 * np.abs(out[..., 2]).max()


# --------------------------------------------------------------------------- conservation


def test_mean_vorticity_stays_zero_with_fno_forcing():
    # The forcing has zero mean and, with the Nyquist wavenumber zeroed in first derivatives,
    # sum(u . grad w) cancels mode by mode, so the mean moves only by round-off: ~1e-16 of
    # max|w| per step, a few hundred steps here; 1e-12 leaves margin.
    w0 = gaussian_random_field(2, 32, rng=np.random.default_rng(2))
    out = solve_ns2d(torch.from_numpy(w0), np.arange(4.0), nu=1e-3, forcing="fno", stored_resolution=32,
                     out_dtype=torch.float64).numpy()
    assert np.abs(w0.mean(axis=(1, 2))).max() < 1e-15  # the GRF has no mean mode
    assert np.abs(out[..., 0].mean(axis=(2, 3))).max() < 1e-12 * np.abs(out[..., 0]).max()
    # The forcing does act: vorticity changes by O(0.1) per time unit.
    assert np.abs(out[:, -1, ..., 0] - out[:, 0, ..., 0]).max() > 0.05


# --------------------------------------------------------------------------- resolution


def test_finer_solve_agrees_at_stored_resolution():
    # Smooth initial state (GRF with |k| <= 7), nu = 1e-3, t = 1, stored at 16 points.
    # Spatial error: the 32-point solve keeps the nonlinear term for |k| <= 10 (2/3 rule),
    # so it misses the transfer into 11 <= |k| <= 14 that the 64-point solve keeps: about
    # 1e-5 relative here (measured 8e-6). Time error: 4th order at CFL 0.5, ~1e-7 at 32
    # points. Bound: 1e-4. A 16-point solve (|k| <= 5 kept, below the initial band) must be
    # much worse, which shows that the bound is not vacuous.
    w0 = smooth_grf(2, 64, seed=3)
    solves = {n: solve_ns2d(torch.from_numpy(w0[:, :: 64 // n, :: 64 // n]), [0.0, 1.0], nu=1e-3,
                            stored_resolution=16, out_dtype=torch.float64)[:, 1].numpy()
              for n in (16, 32, 64)}
    scale_F = np.abs(solves[64]).max(axis=(0, 1, 2))  # per field: vorticity, u_x, u_y
    err32 = (np.abs(solves[32] - solves[64]).max(axis=(0, 1, 2)) / scale_F).max()
    err16 = (np.abs(solves[16] - solves[64]).max(axis=(0, 1, 2)) / scale_F).max()
    assert err32 < 1e-4, err32
    assert err16 > 10 * err32, (err16, err32)


# --------------------------------------------------------------------------- Kolmogorov


def test_kolmogorov_stays_finite_and_statistically_steady():
    # 32 points on [0, 2 pi]^2 (coarse, but dealiased and damped): spin up 20 time units from
    # the GRF start (max speed 7), then 10 stored units. With drag a = 0.1 and the velocity
    # forcing sin(4 y) (rms 1 / sqrt(2)), the energy E = <|u|^2> / 2 obeys
    # dE/dt <= sqrt(2 E) / sqrt(2) - 2 a E, so E <= 1 / (4 a^2) = 25 once below it.
    # Measured after spin-up: E ~ 0.6-1.3, fluctuating (chaotic) but not drifting.
    rng = np.random.default_rng(4)
    w0 = np.stack([draw_ns2d_initial(rng, 32, forcing="kolmogorov") for _ in range(2)])
    out = solve_ns2d(torch.from_numpy(w0), np.arange(11.0), nu=1e-3, forcing="kolmogorov",
                     stored_resolution=32, spinup=20.0, out_dtype=torch.float64).numpy()
    assert np.isfinite(out).all()
    energy_BT = 0.5 * (out[..., 1] ** 2 + out[..., 2] ** 2).mean(axis=(2, 3))
    assert (energy_BT < 25.0).all() and (energy_BT > 0.1).all(), energy_BT
    assert (energy_BT.max(axis=1) < 3.0 * energy_BT.min(axis=1)).all(), energy_BT
    assert np.abs(out[..., 0].mean(axis=(2, 3))).max() < 1e-12 * np.abs(out[..., 0]).max()


def test_decaying_flow_loses_energy_at_least_at_the_drag_rate():
    # Unforced with drag a = 0.1: dE/dt = -2 nu Z - 2 a E for E = <|u|^2> / 2, Z = <w^2> / 2, as the
    # nonlinear term moves energy between modes without making any. A start band-limited to
    # |k_x|, |k_y| <= 7 on 32 points lies inside the 2/3 mask (|k_x|, |k_y| <= 10), which the flow
    # never leaves (modes outside it only decay from zero), and there the masked product is the
    # exact Galerkin term, so the bounds hold up to the time step's error:
    #   E(0) exp(-2 a t - 2 nu 200 t) <= E(t) <= E(0) exp(-2 a t)   (Z / E <= |k|^2 <= 10^2 + 10^2).
    a, nu = 0.1, 1e-3
    w0 = smooth_grf(2, 32, seed=8)
    w0 *= 3.0 / np.abs(w0).max()
    times = np.arange(0.0, 5.5, 0.5)
    out = solve_ns2d(torch.from_numpy(w0), times, nu=nu, forcing="decaying", stored_resolution=32,
                     out_dtype=torch.float64).numpy()
    energy_BT = 0.5 * (out[..., 1] ** 2 + out[..., 2] ** 2).mean(axis=(2, 3))
    ratio_BT = energy_BT / energy_BT[:, :1]
    assert (ratio_BT <= np.exp(-2 * a * times) * (1 + 1e-9)).all(), ratio_BT
    assert (ratio_BT >= np.exp(-2 * (a + 200 * nu) * times) * (1 - 1e-9)).all(), ratio_BT
    assert (np.diff(energy_BT, axis=1) < 0).all()
    assert np.abs(out[..., 0].mean(axis=(2, 3))).max() < 1e-12 * np.abs(out[..., 0]).max()


@pytest.mark.parametrize("forcing", sorted(KOLMOGOROV_WAVENUMBER))
def test_kolmogorov_shear_from_rest_is_exact(forcing):
    # From rest, the forcing -k cos(k y) makes a shear flow along x varying in y alone; it does not
    # advect its own vorticity (u_x d/dx w = 0, u_y = 0), so the equation is linear and
    # w(t) = -k cos(k y) (1 - exp(-lam t)) / lam, u_x = sin(k y) (1 - exp(-lam t)) / lam,
    # lam = nu k^2 + drag (0.1). The nonlinear term is zero up to the FFT's round-off along x (only
    # k_x = 0 modes); the linear part is integrated exactly; the forcing's 4th-order error at the
    # CFL step (~0.01) is far below the bound.
    k, nu, drag = KOLMOGOROV_WAVENUMBER[forcing], 1e-3, 0.1
    lam = nu * k**2 + drag
    times = np.arange(0.0, 12.0, 2.0)
    out = solve_ns2d(torch.zeros(1, 32, 32, dtype=torch.float64), times, nu=nu, forcing=forcing,
                     stored_resolution=32, out_dtype=torch.float64).numpy()[0]
    _, y = nodes(32, 2 * np.pi)
    grow_T = (1.0 - np.exp(-lam * times)) / lam
    w_exact = -k * np.cos(k * y)[None] * grow_T[:, None, None]
    ux_exact = np.sin(k * y)[None] * grow_T[:, None, None]
    np.testing.assert_allclose(out[..., 0], w_exact, rtol=0, atol=1e-8 * k / lam)
    np.testing.assert_allclose(out[..., 1], ux_exact, rtol=0, atol=1e-8 / lam)
    assert np.abs(out[..., 2]).max() < 1e-12 / lam


@pytest.mark.parametrize("forcing", [*sorted(KOLMOGOROV_WAVENUMBER), "decaying"])
def test_kolmogorov_initial_state(forcing):
    w = draw_ns2d_initial(np.random.default_rng(5), 32, forcing=forcing)
    ux, uy = velocity_from_vorticity(torch.from_numpy(w)[None], length=2 * np.pi)
    assert w.shape == (32, 32) and abs(float(torch.sqrt(ux**2 + uy**2).max()) - 7.0) < 1e-12
    np.testing.assert_array_equal(draw_ns2d_initial(np.random.default_rng(5), 32, forcing="fno"),
                                  gaussian_random_field(1, 32, rng=np.random.default_rng(5))[0])


# --------------------------------------------------------------------------- GRF, API, edges


def test_gaussian_random_field_matches_fno_spectrum():
    # E|FFT(w)_k|^2 = sqrt_eig_k^2 / 2 (the real part keeps half of the complex variance).
    # 4000 samples: relative standard error <= sqrt(2 / 4000) = 2.2% per mode; bound 10%.
    n, alpha, tau = 8, 2.5, 7.0
    w = gaussian_random_field(4000, n, rng=np.random.default_rng(6))
    assert w.shape == (4000, n, n) and w.dtype == np.float64
    assert np.abs(w.mean(axis=(1, 2))).max() < 1e-15
    k = np.fft.fftfreq(n, 1.0 / n)
    sqrt_eig = n**2 * math.sqrt(2) * tau ** (alpha - 1) * (
        4 * np.pi**2 * (k[:, None] ** 2 + k[None, :] ** 2) + tau**2) ** (-alpha / 2)
    power = (np.abs(np.fft.fft2(w)) ** 2).mean(axis=0)
    ratio = power.ravel()[1:] / (sqrt_eig.ravel()[1:] ** 2 / 2)
    assert np.abs(ratio - 1).max() < 0.1, ratio
    assert gaussian_random_field(0, 16, rng=np.random.default_rng(0)).shape == (0, 16, 16)
    a = gaussian_random_field(2, 16, rng=np.random.default_rng(7))
    np.testing.assert_array_equal(a, gaussian_random_field(2, 16, rng=np.random.default_rng(7)))


def test_shapes_initial_step_edges_and_errors():
    w0 = torch.from_numpy(gaussian_random_field(3, 16, rng=np.random.default_rng(8))).float()
    calls = []
    out = solve_ns2d(w0, [0.0, 0.5, 0.5, 1.0], nu=1e-3, stored_resolution=8, progress=calls.append)
    assert FIELDS == ("vorticity", "velocity_x", "velocity_y")
    assert out.shape == (3, 4, 8, 8, 3) and out.dtype == torch.float32 and calls == [1] * 4
    # Step 0 is the initial state, subsampled every 2nd node (FNO's [::2, ::2]).
    torch.testing.assert_close(out[:, 0, ..., 0], w0[:, ::2, ::2], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[:, 1], out[:, 2], rtol=0, atol=0)  # repeated time
    assert solve_ns2d(w0[:1], [0.0], nu=1e-3, stored_resolution=16).shape == (1, 1, 16, 16, 3)
    assert solve_ns2d(w0[:0], [0.0, 1.0], nu=1e-3, stored_resolution=4).shape == (0, 2, 4, 4, 3)
    for bad in ([0.5, 1.0], [0.0, 1.0, 0.5], []):
        with pytest.raises(ValueError, match="times"):
            solve_ns2d(w0, bad, nu=1e-3, stored_resolution=8)
    with pytest.raises(ValueError, match="stored_resolution"):
        solve_ns2d(w0, [0.0], nu=1e-3, stored_resolution=6)
    with pytest.raises(ValueError, match="forcing"):
        solve_ns2d(w0, [0.0], nu=1e-3, forcing="kolmogrov", stored_resolution=8)
    with pytest.raises(ValueError, match="shape"):
        solve_ns2d(w0[:, :, :8], [0.0], nu=1e-3, stored_resolution=8)
    with pytest.raises(ValueError, match="max_dt"):
        solve_ns2d(w0, [0.0], nu=1e-3, stored_resolution=8, max_dt=0.0)
