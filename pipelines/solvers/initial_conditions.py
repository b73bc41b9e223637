"""Random initial conditions and coefficients in PDEBench's conventions.

Legend: N samples, X (and Y) grid points, K candidate wavenumbers, B Gaussian bumps.

Facts taken from PDEBench (github.com/pdebench/PDEBench, read for this module, none
of its code is reused):

* ``pdebench/data_gen/data_gen_NLE/utils.py::init_multi`` builds the 1D family used by
  the advection and Burgers generators (both call it with ``k_tot=4``; the function's
  own default is 8; ``num_choise_k=2``).
* ``pdebench/data_gen/data_gen_NLE/ReactionDiffusionEq/reaction_diffusion_2D_multi_solution_Hydra.py``
  builds the Darcy coefficient (run by ``run_DarcyFlow2D.sh``): five Gaussian bumps,
  thresholded at the mean to the two values 1 and 0.1. It is *not* a Gaussian random
  field with a Matern/FNO covariance (that is the FNO paper's 12/3 coefficient).
"""

from __future__ import annotations

import numpy as np

import pipelines.solvers.libm as libm

# PDEBench's init_multi: abs() with probability 0.1, a tanh window with probability 0.1.
_P_ABS = 0.1
_P_WINDOW = 0.1
_WINDOW_LEFT = (0.1, 0.45)
_WINDOW_RIGHT = (0.55, 0.9)
_WINDOW_WIDTH = 0.01

# PDEBench's Darcy coefficient: 5 bumps, values 1 above the mean and 0.1 below.
DARCY_VALUES = (0.1, 1.0)
_DARCY_BUMPS = 5


def sine_superposition(
    n: int,
    x_X: np.ndarray,
    *,
    rng: np.random.Generator,
    k_tot: int = 4,
    num_choose_k: int = 2,
    period: float | None = None,
) -> np.ndarray:
    """Sample PDEBench's 1D initial-condition family (``init_multi``).

    ``u(x) = sum_{j=1..k_tot} A_j sin(2 pi j c_j x / P + phi_j)`` where ``c_j`` counts how
    often wavenumber ``j`` was drawn in ``num_choose_k`` draws with replacement (so a
    repeated draw doubles the wavenumber and an undrawn one contributes the constant
    ``A_j sin(phi_j)``, exactly as in PDEBench), ``A_j ~ U[0, 1)``, ``phi_j ~ U[0, 2 pi)``.
    Then, per sample: ``|u|`` with probability 0.1, a random sign flip (probability
    0.5), and with probability 0.1 a multiplication by the window
    ``0.5 (tanh((x - xL)/0.01) - tanh((x - xR)/0.01))`` with ``xL ~ U[0.1, 0.45]``,
    ``xR ~ U[0.55, 0.9]``. Hence ``|u| <= k_tot`` always.

    Args:
        n: number of samples (may be 0).
        x_X: grid points, shape [X] (PDEBench: cell centres of [0, 1]).
        rng: the only source of randomness.
        k_tot: number of candidate wavenumbers (PDEBench uses 4 for advection/Burgers).
        num_choose_k: draws of wavenumbers per sample.
        period: base period ``P``. ``None`` means PDEBench's ``x[-1] - x[0]`` (one cell
            short of the domain, so the sines are not exactly periodic on the grid);
            pass the domain length for exactly periodic samples.

    Returns:
        float32 array [n, X].
    """
    x_X = np.asarray(x_X, dtype=np.float64)
    if x_X.ndim != 1 or x_X.size < 2:
        raise ValueError(f"x_X must be 1D with at least 2 points, got shape {x_X.shape}")
    if n < 0 or k_tot < 1 or num_choose_k < 1:
        raise ValueError(f"need n >= 0, k_tot >= 1, num_choose_k >= 1; got {n}, {k_tot}, {num_choose_k}")
    length = float(x_X[-1] - x_X[0]) if period is None else float(period)

    picks_NC = rng.integers(0, k_tot, size=(n, num_choose_k))
    count_NK = np.zeros((n, k_tot))
    np.add.at(count_NK, (np.arange(n)[:, None], picks_NC), 1.0)
    k_NK = 2.0 * np.pi * np.arange(1, k_tot + 1) * count_NK / length
    amp_NK = rng.uniform(0.0, 1.0, size=(n, k_tot))
    phase_NK = rng.uniform(0.0, 2.0 * np.pi, size=(n, k_tot))
    u_NX = np.einsum(
        "nk,nkx->nx", amp_NK, np.sin(k_NK[:, :, None] * x_X[None, None, :] + phase_NK[:, :, None])
    )

    take_abs_N = rng.random(n) < _P_ABS
    u_NX = np.where(take_abs_N[:, None], np.abs(u_NX), u_NX)
    u_NX *= rng.choice([1.0, -1.0], size=(n, 1))

    window_N = rng.random(n) < _P_WINDOW
    x_left = rng.uniform(*_WINDOW_LEFT, size=(n, 1))
    x_right = rng.uniform(*_WINDOW_RIGHT, size=(n, 1))
    mask_NX = 0.5 * (np.tanh((x_X - x_left) / _WINDOW_WIDTH) - np.tanh((x_X - x_right) / _WINDOW_WIDTH))
    u_NX = np.where(window_N[:, None], u_NX * mask_NX, u_NX)
    return u_NX.astype(np.float32)


def darcy_coefficient(n: int, nx: int, *, rng: np.random.Generator) -> np.ndarray:
    """Sample PDEBench's piecewise-constant Darcy coefficient on the unit square.

    ``g(x) = sum_{b=1..5} exp(-|x - m_b|^2 / s_b)`` with centres ``m_b ~ U([0, 1]^2)``
    and ``s_b = 0.5 * U[0, 1)`` (PDEBench divides by ``s_b`` directly, it is a variance
    scale, not a standard deviation); ``a = 1`` where ``g > mean(g)`` and ``0.1``
    elsewhere. PDEBench thresholds at the mean over the whole batch; we threshold at
    each sample's own mean so a sample does not depend on the batch it was drawn in.

    Args:
        n: number of samples (may be 0).
        nx: cells per side; the field is evaluated at cell centres ``(i + 0.5) / nx``.
        rng: the only source of randomness.

    Returns:
        float32 array [n, nx, nx] with values in {0.1, 1.0}.
    """
    if n < 0 or nx < 1:
        raise ValueError(f"need n >= 0 and nx >= 1, got n={n}, nx={nx}")
    xc_X = (np.arange(nx) + 0.5) / nx
    centre_NB2 = rng.uniform(0.0, 1.0, size=(n, _DARCY_BUMPS, 2))
    # Floor the width: U[0, 1) can return 0 and PDEBench would divide by it.
    scale_NB = 0.5 * np.maximum(rng.uniform(0.0, 1.0, size=(n, _DARCY_BUMPS)), 1e-6)
    dx2_NBX = (xc_X[None, None, :] - centre_NB2[:, :, 0, None]) ** 2
    dy2_NBY = (xc_X[None, None, :] - centre_NB2[:, :, 1, None]) ** 2
    g_NXY = np.zeros((n, nx, nx))
    for b in range(_DARCY_BUMPS):  # 5 bumps: a loop keeps memory at one [n, X, Y] field
        s = scale_NB[:, b, None, None]
        g_NXY += libm.exp(-(dx2_NBX[:, b, :, None] + dy2_NBY[:, b, None, :]) / s)
    above_NXY = g_NXY > g_NXY.mean(axis=(1, 2), keepdims=True)
    low, high = DARCY_VALUES
    return np.where(above_NXY, high, low).astype(np.float32)
