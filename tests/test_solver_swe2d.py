"""Numerical checks of pipelines.solvers.swe2d: well-balancing, conservation, exact Riemann solutions, symmetry.

Legend: B samples, T output times, X, Y cells, K sub-points per cell.

Every run is float64 on the CPU with small grids (the whole file takes a few seconds). The
scheme uses only elementwise ops and max-reductions (no BLAS), so results do not depend on
the BLAS build; tolerances are still stated against round-off, not against one machine's bits.
"""

import math

import numpy as np
import pytest
import scipy.optimize
import torch

from pipelines.solvers.swe2d import (
    FIELDS,
    PDEBENCH_TIMES,
    cell_centres,
    dam_break_height,
    draw_dam_break,
    solve_swe1d,
    solve_swe2d,
)

F64 = torch.float64


def _bump(n: int) -> np.ndarray:
    """Smooth off-centre bathymetry [n, n], peak 0.8, on PDEBench's square."""
    x = cell_centres(n)
    return 0.8 * np.exp(-((x[:, None] - 0.3) ** 2 + (x[None, :] + 0.2) ** 2) / 0.5)


def _cell_means(f, n: int, k: int = 32) -> np.ndarray:
    """Means [n] of f over the n cells of [-2.5, 2.5] by a k-point midpoint rule.

    At a discontinuity the rule errs by at most jump * dx / k, 32x below the scheme's own
    O(dx) error there, so it does not blur the convergence order.
    """
    dx = 5.0 / n
    sub_XK = cell_centres(n)[:, None] + dx * ((np.arange(k) + 0.5) / k - 0.5)
    return f(sub_XK).mean(axis=1)


def _stoker(xi, h_left: float, h_right: float, g: float = 1.0):
    """Exact wet-wet dam break (rarefaction + shock) from rest at self-similar x/t: (h, u)."""
    c_left = math.sqrt(g * h_left)

    def mismatch(h_m):  # u_m behind the rarefaction minus u_m behind the shock
        shock_u = (h_m - h_right) * math.sqrt(0.5 * g * (h_m + h_right) / (h_m * h_right))
        return 2 * (c_left - math.sqrt(g * h_m)) - shock_u

    h_m = scipy.optimize.brentq(mismatch, h_right, h_left, xtol=1e-14)
    u_m = 2 * (c_left - math.sqrt(g * h_m))
    shock = h_m * u_m / (h_m - h_right)  # mass jump condition
    tail = u_m - math.sqrt(g * h_m)
    fan = xi < tail
    behind_shock = xi < shock
    h = np.where(fan, (2 * c_left - xi) ** 2 / (9 * g), np.where(behind_shock, h_m, h_right))
    u = np.where(fan, 2 * (c_left + xi) / 3, np.where(behind_shock, u_m, 0.0))
    still = xi < -c_left  # not yet reached by the rarefaction
    return np.where(still, h_left, h), np.where(still, 0.0, u)


def test_stoker_reference_is_consistent():
    # Independent check of the reference: the intermediate state of the 2:1 dam break with
    # g = 1 satisfies the shock's momentum jump too, and the fan joins it continuously.
    h, u = _stoker(np.array([0.5, -1.0e9, 1.0e9]), 2.0, 1.0)
    h_m, u_m = h[0], u[0]
    shock = h_m * u_m / (h_m - 1.0)
    momentum_jump = (h_m * u_m**2 + 0.5 * h_m**2) - 0.5 * 1.0**2
    assert abs(momentum_jump - shock * h_m * u_m) < 1e-12
    assert (h[1], u[1], h[2], u[2]) == (2.0, 0.0, 1.0, 0.0)
    fan_end = u_m - math.sqrt(h_m)
    h_fan, u_fan = _stoker(np.array([fan_end - 1e-12]), 2.0, 1.0)
    assert abs(h_fan[0] - h_m) < 1e-10 and abs(u_fan[0] - u_m) < 1e-10


# --------------------------------------------------------------------------- PDEBench conventions


def test_pdebench_initial_condition_and_grid():
    x = cell_centres(128)
    dx = 5.0 / 128
    np.testing.assert_allclose(x[[0, -1]], [-2.5 + dx / 2, 2.5 - dx / 2], rtol=0, atol=1e-15)
    assert PDEBENCH_TIMES.shape == (101,) and PDEBENCH_TIMES[0] == 0.0 and PDEBENCH_TIMES[-1] == 1.0
    assert FIELDS == ("height", "velocity_x", "velocity_y")
    radii = []
    for seed in range(20):
        h = draw_dam_break(np.random.default_rng(seed), 128)
        assert h.shape == (128, 128) and h.dtype == np.float64
        assert set(np.unique(h)) == {1.0, 2.0}
        np.testing.assert_array_equal(h, h.T)
        radii.append(math.sqrt((h == 2.0).sum() * dx * dx / math.pi))  # disc area -> radius
    # R ~ U(0.3, 0.7); the staircase disc's area radius is within a cell of R.
    assert 0.3 - dx < min(radii) and max(radii) < 0.7 + dx and np.std(radii) > 0.05
    again = [draw_dam_break(np.random.default_rng(3), 32) for _ in range(2)]
    np.testing.assert_array_equal(again[0], again[1])
    # PDEBench's sample i: np.random.seed(i); np.random.uniform(0.3, 0.7).
    h7 = dam_break_height(np.random.RandomState(7).uniform(0.3, 0.7), 128)
    assert h7[64, 64] == 2.0 and h7[0, 0] == 1.0


def test_outflow_is_inert_in_pdebench_setting():
    # With R <= 0.7 and t <= 1 the front stays inside [-2.5, 2.5]^2, so PDEBench's outflow
    # boundary and walls give the same result. Only the numerical tail of the front, ~1e-15
    # at 64^2 (measured 1.7e-15; 0 at 128^2), can reach the edge: 1e-10 bounds it.
    h0 = torch.from_numpy(dam_break_height(0.7, 64))[None]
    outflow = solve_swe2d(h0, PDEBENCH_TIMES, out_dtype=F64)
    wall = solve_swe2d(h0, PDEBENCH_TIMES, boundary="wall", out_dtype=F64)
    assert outflow.shape == (1, 101, 64, 64, 3)
    assert (outflow - wall).abs().max().item() < 1e-10


# --------------------------------------------------------------------------- balance and conservation


@pytest.mark.parametrize("surface, boundary", [(1.0, "wall"), (1.0, "outflow"), (0.5, "wall")])
def test_lake_at_rest_over_bump_stays_at_rest(surface, boundary):
    # surface 1.0: the bump is submerged (h >= 0.2); 0.5: it emerges as a dry island.
    # t = 10 is 200-290 steps at 32^2. Hydrostatic reconstruction balances flux and source
    # exactly in exact arithmetic; what remains is rounding of O(1) terms, a few 1e-16 per
    # step that do not grow (measured 9e-16), so 1e-12 leaves ample room yet catches any
    # truncation-level imbalance (~dx^2 ~ 1e-2 for an unbalanced scheme).
    b = _bump(32)
    h0 = np.maximum(surface - b, 0.0)
    out = solve_swe2d(torch.from_numpy(h0)[None], [0.0, 2.5, 10.0], bathymetry=b, boundary=boundary, out_dtype=F64)
    h_TXY = out[0, ..., 0].numpy()
    wet = h0 > 0
    assert out[..., 1:].abs().max().item() < 1e-12
    assert np.abs(h_TXY[:, wet] + b[wet] - surface).max() < 1e-12
    assert (h_TXY[:, ~wet] == 0.0).all()  # dry cells get no mass at all
    assert wet.all() == (surface == 1.0)  # the two cases are what they claim


@pytest.mark.parametrize("with_bump", [False, True])
def test_mass_conserved_with_walls_through_dam_break(with_bump):
    # t = 3: the front has hit and reflected off the walls (it reaches them near t = 1.4).
    # Flux differences telescope and the wall mass flux is exactly 0, so the total changes
    # only by rounding of the sum, ~1e-16 relative per step (177 steps): 1e-12 is safe.
    h0 = dam_break_height(0.5, 48)
    b = _bump(48) if with_bump else None
    out = solve_swe2d(torch.from_numpy(h0)[None], np.linspace(0.0, 3.0, 7), bathymetry=b, boundary="wall",
                      out_dtype=F64)
    mass_T = out[0, ..., 0].sum(dim=(1, 2)).numpy()
    assert np.abs(mass_T / mass_T[0] - 1.0).max() < 1e-12
    assert out[..., 0].min().item() > 0.0
    # The wave moved mass about: the state is far from the initial one.
    assert np.abs(out[0, -1, ..., 0].numpy() - h0).max() > 0.1


def test_outflow_loses_mass_once_waves_leave():
    # The counterpart: with outflow edges the reflected mass of the wall run leaves instead.
    h0 = torch.from_numpy(dam_break_height(0.5, 32))[None]
    out = solve_swe2d(h0, [0.0, 3.0], boundary="outflow", out_dtype=F64)
    mass = out[0, :, :, :, 0].sum(dim=(1, 2))
    assert (mass[1] / mass[0]).item() < 0.99  # measured 0.934


# --------------------------------------------------------------------------- exact Riemann solutions


def test_1d_dam_break_converges_to_stoker_solution():
    # h = 2 | 1 at x = 0, g = 1, t = 1, walls (the waves stay inside [-2.5, 2.5]).
    # A second-order limited scheme on a solution with a shock has L1 error O(dx): the
    # shock is smeared over a fixed number of cells. Successive orders scatter around 1 as
    # the shock moves within its cell (measured 0.83, 1.18 for 200 -> 400 -> 800), hence the
    # bound 0.6, below which the scheme would have lost its shock capturing.
    errors_h, errors_u = [], []
    for n in (200, 400, 800):
        x = cell_centres(n)
        out = solve_swe1d(torch.from_numpy(np.where(x < 0.0, 2.0, 1.0))[None], [0.0, 1.0], boundary="wall",
                          out_dtype=F64)
        assert out.shape == (1, 2, n, 2)
        dx = 5.0 / n
        errors_h.append(np.abs(out[0, 1, :, 0].numpy() - _cell_means(lambda s: _stoker(s, 2.0, 1.0)[0], n)).sum() * dx)
        errors_u.append(np.abs(out[0, 1, :, 1].numpy() - _cell_means(lambda s: _stoker(s, 2.0, 1.0)[1], n)).sum() * dx)
    orders = np.log2(np.array(errors_h[:-1]) / np.array(errors_h[1:]))
    assert (orders > 0.6).all(), (errors_h, orders)
    # Finest level: measured L1 errors 3.2e-3 (h) and 2.6e-3 (u) over a domain of length 5,
    # i.e. a mean error of ~6e-4 for h in [1, 2].
    assert errors_h[-1] < 5e-3 and errors_u[-1] < 5e-3, (errors_h, errors_u)


def test_1d_dam_break_onto_dry_bed_stays_nonnegative():
    # Ritter's solution: h = 1 | 0, front at x = 2 sqrt(g) t. The dry bed tests positivity:
    # no negative depth anywhere, mass to round-off (walls), and O(dx) convergence
    # (measured L1 3.9e-3 at 400 cells).
    n = 400
    x = cell_centres(n)
    out = solve_swe1d(torch.from_numpy(np.where(x < 0.0, 1.0, 0.0))[None], np.linspace(0.0, 1.0, 5),
                      boundary="wall", out_dtype=F64)
    h_TX = out[0, ..., 0].numpy()
    assert h_TX.min() >= 0.0
    assert np.abs(h_TX.sum(axis=1) / h_TX[0].sum() - 1.0).max() < 1e-12
    ritter = _cell_means(lambda s: np.where(s < -1.0, 1.0, np.where(s < 2.0, (2.0 - s) ** 2 / 9.0, 0.0)), n)
    assert np.abs(h_TX[-1] - ritter).sum() * 5.0 / n < 8e-3


# --------------------------------------------------------------------------- symmetry, storage, inputs


def test_radial_dam_break_symmetric_under_xy_swap():
    # The x sweep is the y sweep's code on transposed views and x, y cells are equal, so
    # the swap is exact in exact arithmetic and the rounding is identical too (measured: 0).
    # 1e-13 still allows a few ulps per step, should a kernel round strided views differently.
    h0 = torch.from_numpy(draw_dam_break(np.random.default_rng(1), 40))[None]
    out = solve_swe2d(h0, np.linspace(0.0, 1.0, 6), out_dtype=F64)[0]
    h, u, v = out[..., 0], out[..., 1], out[..., 2]
    assert (h - h.mT).abs().max().item() < 1e-13
    assert (u - v.mT).abs().max().item() < 1e-13
    assert h.min().item() > 0.0 and u.abs().max().item() > 0.1  # something happened
    # An asymmetric field: solving the swapped field swaps the solution.
    rng = np.random.default_rng(2)
    h_BXY = torch.from_numpy(1.0 + rng.random((2, 24, 24)))
    a = solve_swe2d(h_BXY, [0.0, 0.5], boundary="wall", out_dtype=F64)
    b = solve_swe2d(h_BXY.mT, [0.0, 0.5], boundary="wall", out_dtype=F64)
    assert (a[..., 0] - b[..., 0].mT).abs().max().item() < 1e-13
    assert (a[..., 1] - b[..., 2].mT).abs().max().item() < 1e-13


def test_stored_resolution_is_block_mean_of_conserved_variables():
    h0 = torch.from_numpy(dam_break_height(0.6, 32))[None].repeat(2, 1, 1)
    h0[1] *= 1.5  # a batch of two different samples
    fine = solve_swe2d(h0, [0.0, 0.3, 0.6], out_dtype=F64)
    coarse = solve_swe2d(h0, [0.0, 0.3, 0.6], stored_resolution=8, out_dtype=F64)
    assert coarse.shape == (2, 3, 8, 8, 3)
    h_fine = fine[..., 0].reshape(2, 3, 8, 4, 8, 4)
    m_fine = (fine[..., 0] * fine[..., 1]).reshape(2, 3, 8, 4, 8, 4)
    # Block means of the same float64 numbers in another summation order: ~1e-16.
    torch.testing.assert_close(coarse[..., 0], h_fine.mean(dim=(3, 5)), rtol=0, atol=1e-14)
    torch.testing.assert_close(coarse[..., 1], m_fine.mean(dim=(3, 5)) / h_fine.mean(dim=(3, 5)), rtol=0, atol=1e-14)
    f32 = solve_swe2d(h0, [0.0, 0.3, 0.6], stored_resolution=8)
    assert f32.dtype == torch.float32
    torch.testing.assert_close(f32, coarse.float(), rtol=0, atol=1e-6)  # float32 rounding of O(1) values


def test_edge_shapes_and_bad_inputs():
    assert solve_swe2d(torch.zeros(0, 8, 8), [0.0, 1.0]).shape == (0, 2, 8, 8, 3)
    single = solve_swe2d(torch.full((1, 1, 1), 1.5), [0.0, 0.5], out_dtype=F64)  # one cell: nothing moves
    assert single.shape == (1, 2, 1, 1, 3) and single[0, 1, 0, 0].tolist() == [1.5, 0.0, 0.0]
    calls = []
    solve_swe2d(torch.ones(1, 8, 8), [0.0, 0.1, 0.1], progress=calls.append)  # a repeated time is fine
    assert calls == [1, 1, 1]
    good = torch.ones(1, 8, 8)
    for kwargs, match in [
        (dict(h0_BXY=torch.ones(8, 8)), "shape"),
        (dict(h0_BXY=-good), ">= 0"),
        (dict(times=[0.1, 0.2]), "start at 0"),
        (dict(times=[0.0, 0.2, 0.1]), "non-decreasing"),
        (dict(boundary="periodic"), "boundary"),
        (dict(cfl=0.6), "cfl"),
        (dict(bathymetry=np.zeros((4, 4))), "bathymetry"),
        (dict(stored_resolution=3), "stored_resolution"),
    ]:
        args = dict(h0_BXY=good, times=[0.0, 0.1]) | kwargs
        with pytest.raises(ValueError, match=match):
            solve_swe2d(args.pop("h0_BXY"), args.pop("times"), **args)
    with pytest.raises(ValueError, match="shape"):
        solve_swe1d(torch.ones(1, 8, 8), [0.0, 0.1])
