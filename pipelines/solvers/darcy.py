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

Two solvers of this one system: `solve_darcy` (scipy sparse LU per sample, CPU) and
`solve_darcy_cg` (batched preconditioned conjugate gradients in torch, any device).
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


# --------------------------------------------------------------------------- batched PCG (torch)


def solve_darcy_cg(
    a_NXY,
    beta: float,
    *,
    forcing=None,
    tol: float = 1e-10,
    max_iter: int = 1000,
    out_dtype=np.float32,
):
    """Solve the system of `solve_darcy` for all samples at once by preconditioned CG.

    Matrix-free: ``A u`` is applied from the face transmissibilities of `darcy_operator`
    (same harmonic means, same wall terms). The preconditioner is the exact inverse of
    the constant-coefficient operator (``a = 1``), applied with its sine eigenbasis as
    dense matrix products (a GEMM, fast on GPUs). Because every face weight of ``A``
    lies between ``min(a)`` and ``max(a)`` times that of the constant operator, the
    preconditioned condition number is at most ``max(a) / min(a)`` (10 for PDEBench's
    coefficient) whatever the grid size: a few tens of iterations reach 1e-10.

    Args:
        a_NXY: positive cell coefficients [N, X, Y]; a numpy array (solved on CPU), or a
            torch tensor (solved on its device).
        beta: forcing amplitude, as in `solve_darcy`.
        forcing: optional forcing shape broadcastable to [N, X, Y] (numpy or tensor).
        tol: stop a sample once ``||b - A u||_2 <= tol * ||b||_2`` (recursive residual).
        max_iter: iteration bound; `RuntimeError` if some sample has not converged by then.
        out_dtype: numpy dtype of the result (the solve is float64).

    Returns:
        u at the cell centres [N, X, Y] of ``out_dtype``; a tensor on the input's device
        if the input was a tensor.
    """
    import torch

    is_tensor = isinstance(a_NXY, torch.Tensor)
    a_NXY = (a_NXY if is_tensor else torch.from_numpy(np.asarray(a_NXY))).to(torch.float64)
    if a_NXY.ndim != 3:
        raise ValueError(f"a_NXY must have shape [N, X, Y], got {tuple(a_NXY.shape)}")
    if not (tol > 0.0 and max_iter >= 1):
        raise ValueError(f"need tol > 0 and max_iter >= 1, got tol={tol}, max_iter={max_iter}")
    if a_NXY.numel() and not bool((a_NXY > 0.0).all() & torch.isfinite(a_NXY).all()):
        raise ValueError("a_NXY must hold finite positive coefficients")
    n, nx, ny = a_NXY.shape
    shape = tuple(a_NXY.shape)
    f = torch.ones((), dtype=torch.float64) if forcing is None else torch.as_tensor(forcing, dtype=torch.float64)
    b_NXY = (beta * f.to(a_NXY.device)).expand(shape).contiguous()
    with torch.no_grad():
        u_NXY = _pcg(_FaceOperator(a_NXY), _LaplaceInverse(nx, ny, a_NXY.device), b_NXY, tol, max_iter)
    u_NXY = u_NXY.to(torch.from_numpy(np.empty(0, dtype=out_dtype)).dtype)
    return u_NXY if is_tensor else u_NXY.cpu().numpy()


class _FaceOperator:
    """``u -> A(a) u`` for a batch, from the transmissibilities of `darcy_operator`."""

    def __init__(self, a_NXY):
        nx, ny = a_NXY.shape[1:]
        hx2, hy2 = (1.0 / nx) ** 2, (1.0 / ny) ** 2
        self.tx = 2.0 * a_NXY[:, :-1] * a_NXY[:, 1:] / (a_NXY[:, :-1] + a_NXY[:, 1:]) / hx2  # [N, X-1, Y]
        self.ty = 2.0 * a_NXY[:, :, :-1] * a_NXY[:, :, 1:] / (a_NXY[:, :, :-1] + a_NXY[:, :, 1:]) / hy2
        diag = a_NXY.new_zeros(a_NXY.shape)
        diag[:, :-1] += self.tx
        diag[:, 1:] += self.tx
        diag[:, :, :-1] += self.ty
        diag[:, :, 1:] += self.ty
        diag[:, 0] += 2.0 * a_NXY[:, 0] / hx2  # wall faces: distance h/2 to u = 0
        diag[:, -1] += 2.0 * a_NXY[:, -1] / hx2
        diag[:, :, 0] += 2.0 * a_NXY[:, :, 0] / hy2
        diag[:, :, -1] += 2.0 * a_NXY[:, :, -1] / hy2
        self.diag = diag

    def __call__(self, u_NXY):
        out = self.diag * u_NXY
        out[:, :-1] -= self.tx * u_NXY[:, 1:]
        out[:, 1:] -= self.tx * u_NXY[:, :-1]
        out[:, :, :-1] -= self.ty * u_NXY[:, :, 1:]
        out[:, :, 1:] -= self.ty * u_NXY[:, :, :-1]
        return out


class _LaplaceInverse:
    """Exact inverse of `darcy_operator` at ``a = 1``, applied in its sine eigenbasis.

    In 1D the cell-centred operator with the wall half a cell away is the odd reflection
    ``u_{-1} = -u_0``, whose eigenvectors are ``sin(pi k (i + 1/2) / X)``, k = 1..X (the
    DST-II basis), with eigenvalues ``4 sin^2(pi k / (2 X)) / h^2``. The basis is built in
    numpy (identical on every device) and orthonormalised by its column norms.
    """

    def __init__(self, nx: int, ny: int, device):
        import torch

        sx, lx = self._basis(nx)
        sy, ly = self._basis(ny)
        self.sx = torch.from_numpy(sx).to(device)
        self.sy = torch.from_numpy(sy).to(device)
        self.inv_eig_XY = torch.from_numpy(1.0 / (lx[:, None] * nx**2 + ly[None, :] * ny**2)).to(device)

    @staticmethod
    def _basis(n: int) -> tuple[np.ndarray, np.ndarray]:
        k_K = np.arange(1, n + 1)
        s_XK = np.sin(np.pi * np.outer(np.arange(n) + 0.5, k_K) / n)
        return s_XK / np.linalg.norm(s_XK, axis=0), 4.0 * np.sin(np.pi * k_K / (2 * n)) ** 2

    def __call__(self, r_NXY):
        coef_NXY = self.sx.T @ r_NXY @ self.sy
        return self.sx @ (coef_NXY * self.inv_eig_XY) @ self.sy.T


_CHECK_EVERY = 8  # iterations between convergence checks: each check is a device-to-host sync


def _pcg(apply_a, apply_m_inv, b_NXY, tol: float, max_iter: int):
    """Batched preconditioned CG; each sample has its own step sizes and stops on its own.

    A sample that meets the tolerance at a check is frozen (its step sizes become 0), so
    its result does not depend on the other samples; a zero denominator (an exactly
    solved sample) also gives step size 0 instead of a NaN.
    """
    import torch

    def dot(x, y):  # per-sample inner product, [N, 1, 1] for broadcasting
        return (x * y).sum(dim=(1, 2), keepdim=True)

    x = torch.zeros_like(b_NXY)
    r = b_NXY.clone()
    z = apply_m_inv(r)
    p = z
    rz = dot(r, z)
    target = tol**2 * dot(b_NXY, b_NXY)
    active = (dot(r, r) > target)
    if not bool(active.any()):
        return x
    for it in range(1, max_iter + 1):
        ap = apply_a(p)
        pap = dot(p, ap)
        alpha = torch.where(active & (pap > 0.0), rz / pap, 0.0)
        x = x + alpha * p
        r = r - alpha * ap
        z = apply_m_inv(r)
        rz_new = dot(r, z)
        p = z + torch.where(active & (rz > 0.0), rz_new / rz, 0.0) * p
        rz = rz_new
        if it % _CHECK_EVERY == 0 or it == max_iter:
            active = active & (dot(r, r) > target)
            if not bool(active.any()):
                return x
    worst = float((dot(r, r) / dot(b_NXY, b_NXY).clamp_min(1e-300)).max().sqrt())
    raise RuntimeError(
        f"solve_darcy_cg did not converge in max_iter={max_iter} iterations: "
        f"{int(active.sum())} of {b_NXY.shape[0]} samples above tol={tol:g} "
        f"(worst relative residual {worst:.3g}); raise max_iter or tol"
    )
