"""Numerical checks of pipelines.solvers.dr2d's Allen-Cahn, ``u_t = D lap(u) + u - u^3``: the Neumann
eigenmode's decay, the pointwise ODE's closed form, the energy it dissipates, its invariant box.

Legend: B samples, T output times, X, Y cells, C = 1 field, R cells a side.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.solvers.dr2d import ALLEN_CAHN_FIELDS, cell_centres, draw_allen_cahn_initial, solve_allen_cahn

TIMES = np.linspace(0.0, 5.0, 101)
D = 1e-3


def _energy(u_BXY: np.ndarray, d: float) -> np.ndarray:
    """The discrete free energy the semi-discrete system descends, per sample [B]: the sum over
    interior faces of ``d / 2 (du / dx)^2`` plus the sum over cells of ``(u^2 - 1)^2 / 4``, times the
    cell area (the walls' faces carry no flux, hence no term)."""
    dx = 2.0 / u_BXY.shape[1]
    grad = ((np.diff(u_BXY, axis=1) ** 2).sum(axis=(1, 2)) + (np.diff(u_BXY, axis=2) ** 2).sum(axis=(1, 2))) / dx**2
    return (0.5 * d * grad + 0.25 * ((u_BXY**2 - 1.0) ** 2).sum(axis=(1, 2))) * dx**2


def test_the_draw_is_a_standard_normal_per_cell_as_the_activators():
    from pipelines.solvers.dr2d import draw_dr_initial

    u = draw_allen_cahn_initial(np.random.RandomState(3), 8)
    assert u.shape == (8, 8, 1) and u.dtype == np.float64
    np.testing.assert_array_equal(u[..., 0], draw_dr_initial(np.random.RandomState(3), 8)[..., 0])
    assert ALLEN_CAHN_FIELDS == ("phase",)


def test_cosine_mode_decays_at_the_discrete_laplacians_rate():
    # Reaction off: cos(pi x) cos(pi y) is an eigenvector of the no-flux discrete Laplacian with
    # eigenvalue -(8 / dx^2) sin^2(pi dx / 2) (tests/test_solver_dr2d.py says why).
    resolution = 32
    dx = 2.0 / resolution
    x = cell_centres(resolution)
    mode_XY = np.cos(np.pi * x)[:, None] * np.cos(np.pi * x)[None, :]
    out = solve_allen_cahn(torch.from_numpy(mode_XY[None, :, :, None]), TIMES, d=0.05, reaction=False,
                           out_dtype=torch.float64)
    assert out.shape == (1, 101, resolution, resolution, 1)
    rate = 0.05 * (8.0 / dx**2) * math.sin(math.pi * dx / 2) ** 2
    exact_TXY = mode_XY[None] * np.exp(-rate * TIMES)[:, None, None]
    assert np.abs(out[0, ..., 0].numpy() - exact_TXY).max() < 1e-9


@settings(max_examples=20, deadline=None)
@given(st.lists(st.floats(-4.0, 4.0), min_size=4, max_size=4))
def test_the_reaction_alone_follows_the_odes_closed_form(values):
    # Diffusion off: u' = u - u^3 from u0 has u(t) = u0 e^t / sqrt(1 + u0^2 (e^(2t) - 1)).
    u0 = np.array(values, dtype=np.float64).reshape(1, 2, 2, 1)
    out = solve_allen_cahn(torch.from_numpy(u0), TIMES, diffusion=False, out_dtype=torch.float64)[0, ..., 0]
    e_T = np.exp(TIMES)[:, None, None]
    exact_TXY = u0[0, ..., 0] * e_T / np.sqrt(1.0 + u0[0, ..., 0] ** 2 * (e_T**2 - 1.0))
    assert np.abs(out.numpy() - exact_TXY).max() < 1e-7


def test_a_noise_start_dissipates_its_energy_and_stays_in_the_invariant_box():
    # Allen-Cahn is the gradient flow of `_energy` (the semi-discrete system exactly: its right-hand side
    # is minus the energy's gradient per cell area), so the energy never rises; |u| never exceeds
    # max(1, max |u0|) (the maximum principle).
    rng = np.random.default_rng(0)
    u0 = np.stack([draw_allen_cahn_initial(rng, 32) for _ in range(2)])
    out = solve_allen_cahn(torch.from_numpy(u0), TIMES, d=D, out_dtype=torch.float64)[..., 0].numpy()
    energy_BT = np.stack([_energy(out[:, t], D) for t in range(len(TIMES))], axis=1)
    assert (np.diff(energy_BT, axis=1) <= 1e-12 * energy_BT[:, :1]).all()
    assert energy_BT[:, -1].max() < 0.5 * energy_BT[:, 0].min()
    assert np.abs(out).max() <= max(1.0, np.abs(u0).max()) + 1e-12


def test_user_errors_name_the_one_channel():
    with pytest.raises(ValueError, match=r"\[B, X, Y, 1\]"):
        solve_allen_cahn(torch.zeros(1, 8, 8, 2), [0.0])
    with pytest.raises(ValueError, match=">= 0"):
        solve_allen_cahn(torch.zeros(1, 8, 8, 1), [0.0], d=-1.0)
