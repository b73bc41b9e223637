"""Numerical checks of pipelines.solvers.dr2d: eigenmode decay, the pointwise ODE, spatial order, storage.

Legend: B samples, T output times, X, Y cells, C = 2 fields (u, v), R cells a side.
"""

import math

import numpy as np
import pytest
import torch
from scipy.integrate import solve_ivp

from pipelines.solvers.dr2d import FIELDS, cell_centres, draw_dr_initial, solve_dr2d

PDEBENCH_TIMES = np.linspace(0.0, 5.0, 101)
DU, DV, K = 1e-3, 5e-3, 5e-3


def _cosine_mode(resolution: int) -> np.ndarray:
    """u = v = cos(pi x) cos(pi y) at the cell centres, [1, R, R, 2]: a Neumann eigenmode of [-1, 1]^2."""
    x = cell_centres(resolution)
    mode_XY = np.cos(np.pi * x)[:, None] * np.cos(np.pi * x)[None, :]
    return np.stack([mode_XY, mode_XY], axis=-1)[None]


def _amplitudes(out_BTXYC: torch.Tensor, mode_XY: np.ndarray) -> np.ndarray:
    """Projection of each field on the mode at every time, [T, C]."""
    return np.einsum("txyc,xy->tc", out_BTXYC[0].numpy(), mode_XY) / (mode_XY**2).sum()


def test_cell_centres_and_pdebench_initial_draw():
    # PDEBench's grid: linspace(x0 + dx/2, x1 - dx/2, N) on [-1, 1].
    np.testing.assert_allclose(cell_centres(128), np.linspace(-1 + 1 / 128, 1 - 1 / 128, 128), atol=1e-15)
    # PDEBench's sample i: np.random.seed(i); u = randn(X*Y); v = randn(X*Y); flat index runs over x
    # fastest, so reshape gives [y, x]. Ours is [x, y].
    legacy = np.random.RandomState(3)
    u_YX, v_YX = legacy.randn(8 * 8).reshape(8, 8), legacy.randn(8 * 8).reshape(8, 8)
    uv = draw_dr_initial(np.random.RandomState(3), 8)
    assert uv.shape == (8, 8, 2) and uv.dtype == np.float64
    np.testing.assert_array_equal(uv[..., 0], u_YX.T)
    np.testing.assert_array_equal(uv[..., 1], v_YX.T)
    draw = draw_dr_initial(np.random.default_rng(0), 64)
    assert abs(draw.mean()) < 0.05 and abs(draw.std() - 1.0) < 0.05  # 8192 standard normals: 4-5 sigma
    assert FIELDS == ("activator", "inhibitor")


def test_cosine_mode_decays_at_discrete_then_continuous_rate():
    # Reactions off: cos(pi x) cos(pi y) has zero normal derivative at x, y = +-1 and the mirrored ghost
    # cell equals its even extension, so it is an exact eigenvector of the discrete Laplacian, with
    # eigenvalue -(8 / dx^2) sin^2(pi dx / 2) (the 1D factor -(4 / dx^2) sin^2(kappa dx / 2), kappa = pi,
    # along each axis); the PDE's is -2 pi^2 = its limit.
    errors = []
    for resolution in (16, 32, 64):
        dx = 2.0 / resolution
        uv0 = _cosine_mode(resolution)
        out = solve_dr2d(torch.from_numpy(uv0), PDEBENCH_TIMES, reaction=False, out_dtype=torch.float64)
        assert out.shape == (1, 101, resolution, resolution, 2)
        rate_C = np.array([DU, DV]) * (8.0 / dx**2) * math.sin(math.pi * dx / 2) ** 2
        discrete_TC = uv0[0] * np.exp(-np.outer(PDEBENCH_TIMES, rate_C))[:, None, None, :]
        # (a) RK4 with dt <= 0.05 on a mode of rate ~0.1: global error ~ t rate^5 dt^4 / 120 ~ 1e-13;
        # 1e-8 leaves room for rounding over ~100-200 steps, and is far below the O(dx^2) error of (b).
        assert np.abs(out[0].numpy() - discrete_TC).max() < 1e-8
        # (b) Against exp(-2 pi^2 D t): the discrete rate is 2 pi^2 D (1 - pi^2 dx^2 / 12 + O(dx^4)).
        exact_TC = np.exp(-2 * math.pi**2 * np.outer(PDEBENCH_TIMES, [DU, DV]))
        error_C = np.abs(_amplitudes(out, uv0[0, ..., 0])[-1] - exact_TC[-1])
        leading_C = exact_TC[-1] * 2 * math.pi**2 * np.array([DU, DV]) * 5.0 * math.pi**2 * dx**2 / 12
        # The O(dx^4) terms are (pi dx)^2 / 30 relative to the leading one: < 2% at R = 16.
        np.testing.assert_allclose(error_C, leading_C, rtol=0.03)
        errors.append(error_C)
    ratios = np.array(errors[:-1]) / np.array(errors[1:])
    assert ((ratios > 3.9) & (ratios < 4.1)).all(), ratios  # dx^2: 4x per halving, within the O(dx^4) terms


def test_reactions_alone_follow_the_pointwise_ode():
    # Diffusion off: every cell is the ODE u' = u - u^3 - k - v, v' = u - v. Values from the tails of
    # PDEBench's draw (|u|, |v| up to 4.5: the stiffest cubic transient) and ordinary ones.
    rng = np.random.default_rng(0)
    uv0 = 1.6 * rng.standard_normal((1, 3, 3, 2))
    uv0[0, 0, 0], uv0[0, 2, 1] = (4.5, -4.5), (-4.3, 3.9)
    out = solve_dr2d(torch.from_numpy(uv0), PDEBENCH_TIMES, diffusion=False, out_dtype=torch.float64)

    def fhn(_, y):
        return [y[0] - y[0] ** 3 - K - y[1], y[0] - y[1]]

    for i, j in np.ndindex(3, 3):
        ref = solve_ivp(fhn, (0.0, 5.0), uv0[0, i, j], t_eval=PDEBENCH_TIMES, method="DOP853", rtol=1e-10, atol=1e-12)
        # RK4 at rho dt <= 0.1 for the reaction: local error ~ 0.1^5 / 120 ~ 1e-7 relative per step in
        # the cubic transient, then decaying; measured 3e-8 (it falls ~16x when the step halves).
        assert np.abs(out[0, :, i, j].numpy() - ref.y.T).max() < 1e-6, (i, j)


def _smooth_cell_averages(resolution: int) -> np.ndarray:
    """Exact cell averages of u = 0.3 + 1.2 sin(pi x / 2) cos(pi y), v = 0.5 cos(pi x) cos(2 pi y).

    Both have zero normal derivative on the walls; a cell average of cos or sin(a x) is its centre
    value times sinc(a dx / 2) (numpy's sinc has a factor pi), so the initial data carry no error.
    """
    x, dx = cell_centres(resolution), 2.0 / resolution
    avg = {a: np.sinc(a * dx / (2 * np.pi)) for a in (np.pi / 2, np.pi, 2 * np.pi)}
    X, Y = x[:, None], x[None, :]
    u = 0.3 + 1.2 * np.sin(np.pi * X / 2) * avg[np.pi / 2] * np.cos(np.pi * Y) * avg[np.pi]
    v = 0.5 * np.cos(np.pi * X) * avg[np.pi] * np.cos(2 * np.pi * Y) * avg[2 * np.pi]
    return np.stack(np.broadcast_arrays(u, v), axis=-1)[None]


@pytest.mark.parametrize("du, dv, t_end", [(DU, DV, 2.0), (0.05, 0.1, 1.0)])  # PDEBench's, and diffusion-led
def test_reactions_on_converge_at_second_order_in_space(du, dv, t_end):
    # Each grid against a 4x finer one, both stored as cell averages on 16 x 16. With an error C dx^2
    # the two differences are C (dx^2 - dx^2 / 16) at dx and dx / 2: a ratio of exactly 4.
    stored = {}
    for resolution in (16, 32, 64, 128):
        uv0 = torch.from_numpy(_smooth_cell_averages(resolution))
        out = solve_dr2d(uv0, [0.0, t_end], du=du, dv=dv, k=K, stored_resolution=16, out_dtype=torch.float64)
        stored[resolution] = out[0, -1].numpy()
    errors = [np.abs(stored[16] - stored[64]).max(), np.abs(stored[32] - stored[128]).max()]
    order = math.log2(errors[0] / errors[1])
    assert order > 1.8, (errors, order)  # measured 2.0-2.1; time error (RK4, resolved) is far below
    assert errors[0] < 0.1  # a scale check: the solution is O(1)


def test_stored_resolution_is_the_block_mean():
    uv0 = torch.from_numpy(draw_dr_initial(np.random.default_rng(1), 16))[None]
    times = [0.0, 0.05, 0.5]
    full = solve_dr2d(uv0, times, out_dtype=torch.float64)
    coarse = solve_dr2d(uv0, times, stored_resolution=4, out_dtype=torch.float64)
    assert coarse.shape == (1, 3, 4, 4, 2)
    block_mean = full.reshape(1, 3, 4, 4, 4, 4, 2).mean(dim=(3, 5))
    # The same state averaged in a different order: equal to rounding.
    assert (coarse - block_mean).abs().max().item() < 1e-13
    # Reactions off: the no-flux Laplacian conserves the mean (fluxes telescope), and so does storage.
    plain = solve_dr2d(uv0, times, reaction=False, stored_resolution=2, out_dtype=torch.float64)
    mean_TC = plain[0].mean(dim=(1, 2))
    assert (mean_TC - uv0[0].mean(dim=(0, 1))).abs().max().item() < 1e-13
    # A constant field stays constant (here it follows the ODE, the same in every cell).
    flat = solve_dr2d(torch.full((1, 8, 8, 2), 0.7, dtype=torch.float64), times, stored_resolution=4)
    assert flat.dtype == torch.float32
    assert (flat - flat[:, :, :1, :1]).abs().max().item() == 0.0
    assert (flat[0, 1:] != 0.7).all()  # it did evolve


def test_random_initial_condition_stays_in_the_invariant_box_and_batches_do_not_matter():
    # PDEBench's initial draw at 32 x 32 to t = 5: |u|, |v| <= max(initial max, 1.5 + k) throughout.
    uv0 = np.stack([draw_dr_initial(np.random.default_rng(s), 32) for s in (2, 3)])
    uv0[1] *= 0.3  # a smaller sample takes fewer steps than its batch companion
    ticks = []
    out = solve_dr2d(torch.from_numpy(uv0), PDEBENCH_TIMES, progress=ticks.append)
    assert out.shape == (2, 101, 32, 32, 2) and out.dtype == torch.float32 and ticks == [1] * 101
    box_B = np.maximum(np.abs(uv0).max(axis=(1, 2, 3)), 1.5 + K)
    assert (out.abs().amax(dim=(1, 2, 3, 4)).numpy() <= box_B + 1e-6).all()
    # Each sample's step counts depend on its own values: alone or in a batch, the same elementwise
    # arithmetic (float32 output: equal up to its rounding, in practice bit for bit).
    alone = solve_dr2d(torch.from_numpy(uv0[1:]), PDEBENCH_TIMES[:11])
    assert (alone[0] - out[1, :11]).abs().max().item() < 1e-6


def test_edges_and_user_errors():
    assert solve_dr2d(torch.zeros(0, 8, 8, 2), [0.0, 1.0]).shape == (0, 2, 8, 8, 2)
    uv0 = torch.zeros(1, 8, 8, 2)
    assert solve_dr2d(uv0, [0.0]).shape == (1, 1, 8, 8, 2)
    repeated = solve_dr2d(uv0 + 0.5, [0.0, 0.1, 0.1], out_dtype=torch.float64)
    assert (repeated[:, 1] == repeated[:, 2]).all()  # a repeated time takes no step
    with pytest.raises(ValueError, match="start at 0"):
        solve_dr2d(uv0, [0.1, 0.2])
    with pytest.raises(ValueError, match="non-decreasing"):
        solve_dr2d(uv0, [0.0, 0.2, 0.1])
    with pytest.raises(ValueError, match="must divide"):
        solve_dr2d(uv0, [0.0], stored_resolution=3)
    with pytest.raises(ValueError, match=r"\[B, X, Y, 2\]"):
        solve_dr2d(torch.zeros(8, 8, 2), [0.0])
