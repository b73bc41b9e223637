"""Numerical checks of pipelines.solvers.gray_scott: its rest state, the Neumann eigenmode's decay per species,
the reaction against scipy's ODE solver per point, the mass that feed and kill alone change, the invariant
half-box, and its start.

Legend: B samples, T output times, X, Y cells, C = 2 fields (A, B), R cells a side.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.integrate import solve_ivp

from pipelines.solvers.dr2d import cell_centres
from pipelines.solvers.gray_scott import FIELDS, draw_gray_scott_initial, solve_gray_scott

TIMES = np.linspace(0.0, 400.0, 41)
F, K = 0.029, 0.057


def test_the_start_seeds_b_in_a_as_pearsons_square_does():
    ab = draw_gray_scott_initial(np.random.default_rng(3), 32)
    assert ab.shape == (32, 32, 2) and ab.dtype == np.float64 and FIELDS == ("concentration_a", "concentration_b")
    # A = 1 - b / 2 and B = b / 4 with 0 <= b <= 1: A + 2 B = 1 everywhere, B in [0, 1/4], some seeded cells.
    np.testing.assert_allclose(ab[..., 0] + 2.0 * ab[..., 1], 1.0, atol=1e-15)
    assert ab[..., 1].min() >= 0.0 and ab[..., 1].max() <= 0.25 and (ab[..., 1] > 0.1).any()
    np.testing.assert_array_equal(ab, draw_gray_scott_initial(np.random.default_rng(3), 32))


def test_the_unreacted_state_stays_exactly():
    rest = torch.zeros(2, 16, 16, 2, dtype=torch.float64)
    rest[..., 0] = 1.0
    out = solve_gray_scott(rest, TIMES[:5], f=F, k=K, out_dtype=torch.float64)
    assert torch.equal(out, rest[:, None].expand(-1, 5, -1, -1, -1))


@pytest.mark.parametrize("channel, d", [(0, 3e-3), (1, 1e-3)])
def test_cosine_mode_decays_at_the_discrete_laplacians_rate_in_each_species(channel, d):
    # Reaction off: cos(pi x) cos(pi y) is an eigenvector of the no-flux 5-point Laplacian with eigenvalue
    # -(8 / dx^2) sin^2(pi dx / 2) (tests/test_solver_dr2d.py says why); each species decays at its own d.
    resolution = 32
    dx = 2.0 / resolution
    x = cell_centres(resolution)
    mode_XY = np.cos(np.pi * x)[:, None] * np.cos(np.pi * x)[None, :]
    start = np.zeros((1, resolution, resolution, 2))
    start[0, ..., channel] = mode_XY
    out = solve_gray_scott(torch.from_numpy(start), TIMES[:11], da=3e-3, db=1e-3, reaction=False,
                           out_dtype=torch.float64)[0]
    rate = d * (8.0 / dx**2) * math.sin(math.pi * dx / 2) ** 2
    exact_TXY = mode_XY[None] * np.exp(-rate * TIMES[:11])[:, None, None]
    assert np.abs(out[..., channel].numpy() - exact_TXY).max() < 1e-9
    assert out[..., 1 - channel].abs().max() == 0.0


@settings(max_examples=15, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=8, max_size=8))
def test_the_reaction_alone_matches_scipy_per_point(values):
    # Diffusion off: every cell is the ODE (A, B)' = (-A B^2 + f (1 - A), A B^2 - (f + k) B), here against
    # scipy's DOP853 at tight tolerances (an independent integrator).
    ab0 = np.array(values, dtype=np.float64).reshape(1, 2, 2, 2)
    times = TIMES[:11]
    out = solve_gray_scott(torch.from_numpy(ab0), times, f=F, k=K, diffusion=False, out_dtype=torch.float64)[0]

    def rhs(_, y):
        a, b = y
        return [-a * b * b + F * (1.0 - a), a * b * b - (F + K) * b]

    for i in range(2):
        for j in range(2):
            ref = solve_ivp(rhs, (0.0, times[-1]), ab0[0, i, j], method="DOP853", t_eval=times, rtol=1e-11, atol=1e-13)
            assert np.abs(out[:, i, j].numpy() - ref.y.T).max() < 1e-7


def test_without_feed_and_kill_the_mass_of_a_and_b_is_kept():
    # f = k = 0: the reaction moves A into B cell by cell ((A + B)' = 0) and the walls let nothing through,
    # so the total of A + B stays at its start to round-off while B grows.
    starts = np.stack([draw_gray_scott_initial(np.random.default_rng(s), 32) for s in range(2)])
    out = solve_gray_scott(torch.from_numpy(starts), TIMES[:6], f=0.0, k=0.0, da=2e-4, db=1e-4,
                           out_dtype=torch.float64).numpy()
    mass_BT = out.sum(axis=(2, 3, 4))
    np.testing.assert_allclose(mass_BT, np.broadcast_to(mass_BT[:, :1], mass_BT.shape), rtol=1e-12)
    assert (out[:, -1, ..., 1].sum(axis=(1, 2)) > 1.5 * out[:, 0, ..., 1].sum(axis=(1, 2))).all()


def test_a_start_grows_a_pattern_inside_the_invariant_half_box():
    # 0 <= A <= 1 and B >= 0 hold for the semi-discrete system (see the module docstring); the maze's B
    # spreads beyond its seeds.
    starts = np.stack([draw_gray_scott_initial(np.random.default_rng(s), 32) for s in range(2)])
    out = solve_gray_scott(torch.from_numpy(starts), TIMES[:11], da=2e-4, db=1e-4, f=F, k=K, stored_resolution=16,
                           out_dtype=torch.float64).numpy()
    assert out.shape == (2, 11, 16, 16, 2) and np.isfinite(out).all()
    a, b = out[..., 0], out[..., 1]
    assert a.min() >= -1e-12 and a.max() <= 1.0 + 1e-12 and b.min() >= -1e-12
    seeded_B = (b[:, 0] > 1e-3).mean(axis=(1, 2))
    assert ((b[:, -1] > 1e-3).mean(axis=(1, 2)) > seeded_B).all()


def test_user_errors_are_one_line_each():
    with pytest.raises(ValueError, match=r"\[B, X, Y, 2\]"):
        solve_gray_scott(torch.zeros(1, 8, 8, 1), [0.0])
    with pytest.raises(ValueError, match="feed and kill"):
        solve_gray_scott(torch.zeros(1, 8, 8, 2), [0.0], k=-0.1)
