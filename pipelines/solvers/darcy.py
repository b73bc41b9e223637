"""Steady Darcy flow ``-div(a grad u) = f`` on the unit square, ``u = 0`` on the boundary.

Legend: N samples, X, Y cells per side (PDEBench: 128 x 128), M = X * Y unknowns.

Grid: cell-centred, ``x_i = (i + 0.5) / X``, as in PDEBench's generator
(``data_gen_NLE/ReactionDiffusionEq/reaction_diffusion_2D_multi_solution_Hydra.py``,
which reaches the steady state by time-stepping ``u_t = div(a grad u) + beta`` to t = 2).
We solve the steady problem directly with a 5-point finite-volume scheme:

* interior faces carry the harmonic mean ``2 a_i a_j / (a_i + a_j)`` of the two cells
  (exact flux continuity for a piecewise-constant ``a``; PDEBench uses the arithmetic
  mean),
* a boundary face lies half a cell from the first centre: flux ``a_i (u_i - 0) / (h/2)``
  (PDEBench puts the zero value in a ghost cell one full cell away),
* the forcing is ``f = beta`` (PDEBench's source term; files exist for beta = 0.01, 0.1,
  1, 10, 100).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla


def darcy_operator(a_XY: np.ndarray) -> sp.csr_matrix:
    """Assemble the discrete ``-div(a grad .)`` with zero Dirichlet data.

    Args:
        a_XY: positive cell coefficients, shape [X, Y]; the cell sizes are 1/X and 1/Y.

    Returns:
        sparse [M, M] matrix (row-major flattening of [X, Y]), symmetric positive
        definite, scaled so that ``A @ u`` approximates ``-div(a grad u)`` pointwise.
    """
    a_XY = np.asarray(a_XY, dtype=np.float64)
    if a_XY.ndim != 2 or np.any(~(a_XY > 0.0)):
        raise ValueError("a_XY must be a 2D array of positive coefficients")
    nx, ny = a_XY.shape
    hx2, hy2 = (1.0 / nx) ** 2, (1.0 / ny) ** 2
    index_XY = np.arange(nx * ny).reshape(nx, ny)

    # Face transmissibilities divided by h^2: interior faces use the harmonic mean.
    tx = 2.0 * a_XY[:-1] * a_XY[1:] / (a_XY[:-1] + a_XY[1:]) / hx2  # [X-1, Y]
    ty = 2.0 * a_XY[:, :-1] * a_XY[:, 1:] / (a_XY[:, :-1] + a_XY[:, 1:]) / hy2  # [X, Y-1]
    diag_XY = np.zeros((nx, ny))
    diag_XY[:-1] += tx
    diag_XY[1:] += tx
    diag_XY[:, :-1] += ty
    diag_XY[:, 1:] += ty
    # Boundary faces: distance h/2 to the wall value 0, hence the factor 2.
    diag_XY[0] += 2.0 * a_XY[0] / hx2
    diag_XY[-1] += 2.0 * a_XY[-1] / hx2
    diag_XY[:, 0] += 2.0 * a_XY[:, 0] / hy2
    diag_XY[:, -1] += 2.0 * a_XY[:, -1] / hy2

    rows = [index_XY.ravel(), index_XY[:-1].ravel(), index_XY[1:].ravel(),
            index_XY[:, :-1].ravel(), index_XY[:, 1:].ravel()]
    cols = [index_XY.ravel(), index_XY[1:].ravel(), index_XY[:-1].ravel(),
            index_XY[:, 1:].ravel(), index_XY[:, :-1].ravel()]
    vals = [diag_XY.ravel(), -tx.ravel(), -tx.ravel(), -ty.ravel(), -ty.ravel()]
    m = nx * ny
    return sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(m, m))


def _rhs(beta: float, forcing, shape) -> np.ndarray:
    f = np.ones(shape) if forcing is None else np.broadcast_to(np.asarray(forcing, np.float64), shape)
    return beta * f


def solve_darcy(
    a_NXY: np.ndarray,
    beta: float,
    *,
    forcing=None,
    out_dtype=np.float32,
) -> np.ndarray:
    """Solve ``-div(a grad u) = beta * forcing`` with ``u = 0`` on the boundary, per sample.

    Args:
        a_NXY: positive cell coefficients, shape [N, X, Y].
        beta: forcing amplitude (PDEBench's ``beta``; the forcing is constant by default).
        forcing: optional cell values of the forcing shape, broadcastable to [N, X, Y]
            (for manufactured solutions); default 1 everywhere.
        out_dtype: dtype of the result (the solve is float64, sparse direct LU).

    Returns:
        u at the cell centres, shape [N, X, Y], ``out_dtype``.
    """
    a_NXY = np.asarray(a_NXY, dtype=np.float64)
    if a_NXY.ndim != 3:
        raise ValueError(f"a_NXY must have shape [N, X, Y], got {a_NXY.shape}")
    f_NXY = _rhs(beta, forcing, a_NXY.shape)
    u_NXY = np.empty(a_NXY.shape, dtype=out_dtype)
    for i in range(a_NXY.shape[0]):  # a new matrix per sample: nothing to batch
        u = spla.spsolve(darcy_operator(a_NXY[i]).tocsc(), f_NXY[i].ravel())
        u_NXY[i] = u.reshape(a_NXY.shape[1:])
    return u_NXY


def darcy_residual(a, u, beta: float, *, forcing=None) -> np.ndarray:
    """Discrete residual ``A(a) u - beta * forcing``.

    Args:
        a: coefficients [X, Y] or [N, X, Y].
        u: cell values, same shape as ``a``.
        beta, forcing: as in :func:`solve_darcy`.

    Returns:
        float64 residual with the shape of ``u``.
    """
    a = np.asarray(a, dtype=np.float64)
    u = np.asarray(u, dtype=np.float64)
    if a.shape != u.shape or a.ndim not in (2, 3):
        raise ValueError(f"a and u must share shape [X, Y] or [N, X, Y], got {a.shape}, {u.shape}")
    a_NXY, u_NXY = a.reshape((-1,) + a.shape[-2:]), u.reshape((-1,) + u.shape[-2:])
    f_NXY = _rhs(beta, forcing, a_NXY.shape)
    r_NXY = -f_NXY
    for i in range(a_NXY.shape[0]):
        r_NXY[i] += (darcy_operator(a_NXY[i]) @ u_NXY[i].ravel()).reshape(a.shape[-2:])
    return r_NXY.reshape(u.shape)
