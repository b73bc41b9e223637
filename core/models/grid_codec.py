# long file: one codec: the encoder and decoder share the linear path fitted for both and its cell layout
"""Grid encoder and decoder: fields on uniform grids (any resolution) <-> L latent tokens.

Legend: B batch, C channels, X/Y grid sizes, L tokens, D latent dim, H hidden dim, P grid points,
Q query points, K cosine modes per cell (m ** d), F = C * K coefficients per cell, d spatial
dimension (1, 2 or 3), S cells per axis of the token grid (L = S ** d).

Grids are cell-centred on the unit interval/square/cube: point i of X sits at (i + 0.5) / X
(PDEBench's x-coordinate convention). Token layout, shared by encoder and decoder:
  1D: token l is the cell [l / L, (l + 1) / L), left to right;
  2D: the unit square is an S x S cell grid (L must be a power of 4) whose cells are
      listed in Morton (Z) order, so runs of 4^m tokens are square patches;
  3D: likewise an S x S x S cell grid (L a power of 8), runs of 8^m tokens are cubes.

The codec is a linear path plus a learned non-linear correction (the error budget of a latent
surrogate starts at the codec, so the linear path is made exact where the latent is big enough):
  * each token's cell holds a cosine expansion of the field (``cosine_basis``, m modes per
    axis), fitted to the cell's points by least squares. With m points per cell and axis this is
    the DCT of the cell: exact and perfectly conditioned. Any other grid is fitted smoothly, so
    one codec serves every resolution;
  * the F = C * m^d coefficients of a cell map to the token's D numbers by a fixed matrix
    ``W`` [F, D] and back by its transpose (buffers fitted by ``fit_linear_path`` from training
    fields: PCA of the cells' coefficients when D < F; a padded identity when D >= F, which
    makes encode/decode exact up to float rounding);
  * the non-linear correction (convolutional stem, global-attention token mixer, token-grid
    convolution) is added to the latent and to the decoded coefficients. Its output layers start
    at zero, so training can only start from the linear path's accuracy.
Tasks of any dimension map to the same [L, D], so one operator serves all of them; each
spatial dimension has its own stem, basis matrix and positional embedding, the mixer is shared.
Build with ``ndims=(1,)``, ``(2,)`` or ``(3,)`` when only one kind of field is trained: a stem that
never runs leaves parameters without gradients (DDP then needs find_unused_parameters).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.models.layers import MixerBlock, morton_permutation

NDIMS = (1, 2, 3)
"""Spatial dimensions the codec serves."""

RIDGE = 1e-6
"""Relative Tikhonov term of the per-cell least-squares fit: far below float32 rounding of an
exact fit, and it keeps a cell with fewer points than modes (or none) finite."""


def cells_per_axis(tokens: int, d: int) -> int:
    """Cells S per axis of a ``d``-dimensional field coded by ``tokens`` tokens (L = S ** d).

    In 2D and 3D the cells are listed in Morton order, so S must be a power of two: a ValueError
    names the token counts that work otherwise."""
    if d not in NDIMS or tokens < 1:
        raise ValueError(f"need a spatial dimension within {NDIMS} and tokens >= 1, got d={d}, tokens={tokens}")
    if d == 1:
        return tokens
    side = round(tokens ** (1 / d))
    if side ** d != tokens or side & (side - 1):
        raise ValueError(f"{d}D fields need tokens = a power of {2 ** d} (an S^{d} Morton grid of cells), "
                         f"got {tokens}")
    return side


def _check_layout(tokens: int | dict[int, int], ndims: tuple[int, ...]) -> tuple[dict[int, int], dict[int, int]]:
    """Validate the token layout. -> ({d: L_d}, {d: S_d cells per axis}).

    ``tokens`` is one L for every dimension, or ``{d: L_d}`` (fields of different dimensions may
    use different token counts: a model that steps the tokens sees one kind of field only)."""
    if not ndims or any(d not in NDIMS for d in ndims):
        raise ValueError(f"need ndims within {NDIMS}, got {ndims}")
    per_dim = {d: (tokens[d] if isinstance(tokens, dict) else tokens) for d in ndims}
    if any(n < 1 for n in per_dim.values()):
        raise ValueError(f"need tokens >= 1, got {per_dim}")
    return per_dim, {d: cells_per_axis(n, d) for d, n in per_dim.items()}


# Tensor-product fit (encoder) and evaluation (decoder) of a d-dimensional cell grid, one axis at
# a time: p/q/r index cells, k/l/m modes, x/y/z grid points of axes 1/2/3.
_FIT = {2: "bcxy,pkx,qly->bpqckl", 3: "bcxyz,pkx,qly,rmz->bpqrcklm"}
_EVAL = {2: "bpqckl,xpk,yql->bcxy", 3: "bpqrcklm,xpk,yql,zrm->bcxyz"}


def _register_morton(module: nn.Module, cells: dict[int, int]) -> None:
    """Non-persistent buffers ``morton_<d>d`` (token -> row-major cell) and ``unmorton_<d>d``
    (row-major cell -> token) for every dimension of 2 or more."""
    for d, side in cells.items():
        if d >= 2:
            morton = morton_permutation(side, d)
            module.register_buffer(f"morton_{d}d", morton, persistent=False)
            module.register_buffer(f"unmorton_{d}d", torch.argsort(morton), persistent=False)


class _EdgeConv(nn.Module):
    """Width-3 convolution along every axis with edge-replicating padding, same size out.
    ``[B, C, *grid] -> [B, C_out, *grid]``.

    Replicate padding avoids an artificial zero wall at (often non-periodic) boundaries.
    It is done by index clamping rather than ``padding_mode="replicate"``: with torch 2.13
    inductor's ``replication_pad2d_backward`` fails a stride assertion on CPU.
    """

    def __init__(self, d: int, c_in: int, c_out: int) -> None:
        super().__init__()
        self.d = d
        self.conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[d - 1](c_in, c_out, kernel_size=3)

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, C, *grid] -> [B, C_out, *grid]."""
        for axis in range(2, 2 + self.d):
            n = x.shape[axis]
            idx = torch.arange(-1, n + 1, device=x.device).clamp(0, n - 1)
            x = x.index_select(axis, idx)
        return self.conv(x)


def cosine_basis(s_Pd: Tensor, modes: int) -> Tensor:
    """Tensor-product cosine modes of positions inside a cell. s_Pd: [..., d] in [0, 1] -> [..., modes ** d].

    Mode k of an axis is ``w_k cos(pi k s)`` (w_0 = 1, w_k = sqrt 2): on the m cell-centred points
    s_i = (i + 0.5) / m they are the orthogonal DCT-II vectors (Gram matrix m * I), so a cell of m
    points per axis is represented exactly and the fit is perfectly conditioned.
    """
    k = torch.arange(modes, device=s_Pd.device, dtype=torch.float32)
    weight = torch.where(k == 0, 1.0, math.sqrt(2.0))
    per_axis = [weight * torch.cos(math.pi * k * s_Pd[..., a, None].float()) for a in range(s_Pd.shape[-1])]
    out = per_axis[0]
    for p in per_axis[1:]:
        out = (out[..., :, None] * p[..., None, :]).flatten(-2)
    return out


def cell_centres(grid_shape: tuple[int, ...], device: torch.device | None = None) -> Tensor:
    """Cell-centred coordinates of a uniform grid on [0, 1]^d, row-major. -> [prod(grid), d]."""
    axes = [(torch.arange(n, device=device, dtype=torch.float32) + 0.5) / n for n in grid_shape]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(grid_shape))


def locate(coords_Qd: Tensor, cells: int, token_of_cell: Tensor | None) -> tuple[Tensor, Tensor]:
    """Token index and position inside its cell of each point. coords [..., d] in [0, 1]^d ->
    (token [...] int64, s [..., d] in [0, 1]). ``cells`` per axis; ``token_of_cell`` maps the
    row-major cell index to the token (Morton order in 2D and 3D), None in 1D."""
    p = coords_Qd.float() * cells
    cell = p.floor().clamp(0, cells - 1)
    s = (p - cell).clamp(0, 1)
    cell = cell.long()
    if coords_Qd.shape[-1] == 1:
        return cell[..., 0], s
    row_major = cell[..., 0]
    for a in range(1, coords_Qd.shape[-1]):
        row_major = row_major * cells + cell[..., a]
    return token_of_cell[row_major], s


def axis_fit(points: int, cells: int, modes: int, device: torch.device | None = None) -> Tensor:
    """Least-squares fit of ``modes`` cosine modes in each of ``cells`` equal cells to ``points``
    cell-centred samples on [0, 1]. -> [cells, modes, points]: row (l, k) gives coefficient k of cell l
    as a weighted sum of the samples (zero outside the cell).

    With ``points / cells`` = ``modes`` it is the exact DCT-II of each cell. A cell with fewer points
    than modes (or none) gets the minimum-norm fit, kept finite by the ``RIDGE`` term.
    """
    x = (torch.arange(points, device=device, dtype=torch.float32) + 0.5) / points
    cell_X, s_X1 = locate(x[:, None], cells, None)
    # float64: a cell with fewer points than modes has a singular Gram matrix, and its ridge-kept
    # inverse would amplify float32 rounding (compiled and eager graphs would then disagree).
    basis_XK = cosine_basis(s_X1, modes).double()
    onehot_XL = F.one_hot(cell_X, cells).double()
    gram_LKK = torch.einsum("xl,xk,xj->lkj", onehot_XL, basis_XK, basis_XK)
    ridge = RIDGE * max(points / cells, 1.0)
    inverse_LKK = torch.linalg.inv(gram_LKK + ridge * torch.eye(modes, device=device, dtype=torch.float64))
    return torch.einsum("lkj,xj,xl->lkx", inverse_LKK, basis_XK, onehot_XL).float()


def axis_eval(points: int, cells: int, modes: int, device: torch.device | None = None) -> Tensor:
    """Cosine modes of each cell evaluated at ``points`` cell-centred samples, zero outside the
    cell. -> [points, cells, modes] (the decoder's grid evaluation, one axis at a time)."""
    x = (torch.arange(points, device=device, dtype=torch.float32) + 0.5) / points
    cell_X, s_X1 = locate(x[:, None], cells, None)
    return F.one_hot(cell_X, cells).float()[:, :, None] * cosine_basis(s_X1, modes)[:, None, :]


def fit_cells(u: Tensor, cells: int, modes: int, morton: Tensor | None) -> Tensor:
    """Least-squares cosine coefficients of every cell of a field, fp32, one channel at a time.

    u: [B, C, *grid] (d = 1, 2 or 3 axes), ``cells`` per axis (L = cells ** d tokens), ``modes`` per
    axis, ``morton`` the token -> row-major cell permutation (None in 1D). -> [B, L, C, modes ** d].
    """
    d = u.ndim - 2
    if d == 1:
        return torch.einsum("bcx,lkx->blck", u.float(), axis_fit(u.shape[2], cells, modes, u.device))
    # The tensor-product fit of a tensor grid separates into one fit per axis.
    fits = [axis_fit(n, cells, modes, u.device) for n in u.shape[2:]]
    coef = torch.einsum(_FIT[d], u.float(), *fits)
    return coef.flatten(1, d)[:, morton].flatten(-d)  # row-major cells -> Morton tokens


def eval_cells(coef_BLCK: Tensor, grid_shape: tuple[int, ...], cells: int, modes: int,
               unmorton: Tensor | None) -> Tensor:
    """The fields whose cells hold the cosine coefficients ``coef_BLCK`` [B, L, C, modes ** d], on a
    cell-centred grid ``grid_shape`` (d axes); ``unmorton`` maps row-major cells to tokens (None in
    1D). The inverse of ``fit_cells`` where the grid has ``modes`` points per cell and axis. -> [B, C, *grid_shape]."""
    d = len(grid_shape)
    if d == 1:
        return torch.einsum("blck,xlk->bcx", coef_BLCK, axis_eval(grid_shape[0], cells, modes, coef_BLCK.device))
    # Morton tokens -> row-major cells, then the tensor-product evaluation per axis.
    coef = coef_BLCK[:, unmorton].unflatten(1, (cells,) * d).unflatten(-1, (modes,) * d)
    evals = [axis_eval(n, cells, modes, coef_BLCK.device) for n in grid_shape]
    return torch.einsum(_EVAL[d], coef, *evals)


class TokenGridConv(nn.Module):
    """Residual width-3 convolution over the token grid: each token mixes with its neighbours.

    Tokens are laid out as a line (1D) or an S^d grid (2D, 3D: Morton order undone and
    redone). ``[B, L, H] -> [B, L, H]``.
    """

    def __init__(self, d: int, hidden: int, side: int) -> None:
        super().__init__()
        self.d, self.side = d, side
        self.conv = _EdgeConv(d, hidden, hidden)
        if d >= 2:
            morton = morton_permutation(side, d)
            self.register_buffer("morton", morton, persistent=False)
            self.register_buffer("unmorton", torch.argsort(morton), persistent=False)

    def forward(self, x_BLH: Tensor) -> Tensor:
        """x_BLH -> [B, L, H]."""
        x_BHL = x_BLH.transpose(1, 2)
        if self.d == 1:
            return x_BLH + self.conv(x_BHL).transpose(1, 2)
        grid = x_BHL[:, :, self.unmorton].unflatten(-1, (self.side,) * self.d)
        return x_BLH + self.conv(grid).flatten(2)[:, :, self.morton].transpose(1, 2)


LINEAR_SCOPES = ("local", "global")


class _LinearPath(nn.Module):
    """The fitted linear map between one dimension's cell coefficients [B, L, F] and tokens [B, L, D].

    ``scope="local"``: one matrix for every token (``basis`` [F, D]), so token l depends on cell l
    alone and tokens stay spatially local (what the windowed operator expects). ``"global"``: one
    matrix for the whole field (``basis`` [L*F, L*D], the field's PCA when D < F), tokens being
    consecutive chunks of its components: the best linear code of its size, not local.
    Buffers (saved with the weights): ``basis`` with orthonormal columns (compressing) or rows
    (D >= F), and ``center``. ``encode(c) = (c - center) @ basis``; ``decode(z) = z @ basis.T +
    center``, the exact inverse when D >= F. Computed in fp32 whatever the autocast dtype.
    """

    def __init__(self, features: int, dim: int, tokens: int, scope: str) -> None:
        super().__init__()
        if scope not in LINEAR_SCOPES:
            raise ValueError(f"linear scope must be one of {LINEAR_SCOPES}, got {scope!r}")
        self.scope = scope
        n = tokens if scope == "global" else 1
        self.register_buffer("basis", torch.eye(n * features, n * dim))
        self.register_buffer("center", torch.zeros(n * features))

    def flat(self, c_BLF: Tensor) -> Tensor:
        """The vectors the basis acts on: per cell ([B, L, F]) or per field ([B, 1, L * F])."""
        return c_BLF.float().flatten(1)[:, None] if self.scope == "global" else c_BLF.float()

    def encode(self, c_BLF: Tensor) -> Tensor:
        B, L = c_BLF.shape[:2]
        return ((self.flat(c_BLF) - self.center.float()) @ self.basis.float()).reshape(B, L, -1)

    def decode(self, z_BLD: Tensor) -> Tensor:
        B, L = z_BLD.shape[:2]
        return (self.flat(z_BLD) @ self.basis.float().T + self.center.float()).reshape(B, L, -1)


def _modes_for(modes: int | dict[int, int], ndims: tuple[int, ...]) -> dict[int, int]:
    out = {d: (modes[d] if isinstance(modes, dict) else modes) for d in ndims}
    if any(m < 1 for m in out.values()):
        raise ValueError(f"modes must be >= 1 per dimension, got {out}")
    return out


class GridEncoder(nn.Module):
    """Field on a grid -> latent tokens. ``u_BCX`` or ``u_BCXY`` (any X, Y) -> ``z_BLD``.

    Args:
        in_channels: C. tokens: L (or ``{d: L_d}``). dim: D. hidden: H (divisible by ``heads``); 0 builds the
            linear path alone (no non-linear correction, no parameters).
        ndims: spatial dimensions to support (a stem and a linear path each).
        depth: number of global-attention mixer blocks over the L tokens.
        heads: attention heads of the mixer.
        modes: cosine modes per axis in each token's cell (m; an int, or ``{d: m}`` per
            dimension). m = the points per cell and axis of the training grid makes the
            linear path exact when D >= C * m^d.
        linear: scope of the fitted linear path, "local" (per token) or "global" (see _LinearPath).
    """

    def __init__(self, in_channels: int, tokens: int | dict[int, int], dim: int, hidden: int = 64,
                 ndims: tuple[int, ...] = (1, 2), depth: int = 2, heads: int = 4, modes: int | dict[int, int] = 4,
                 linear: str = "local") -> None:
        super().__init__()
        self.ndims, self.in_channels = tuple(ndims), in_channels
        self.tokens, self.cells = _check_layout(tokens, self.ndims)
        self.modes = _modes_for(modes, self.ndims)
        feats = {d: in_channels * self.modes[d] ** d for d in self.ndims}
        self.linear = nn.ModuleDict({f"{d}d": _LinearPath(feats[d], dim, self.tokens[d], linear) for d in self.ndims})
        _register_morton(self, self.cells)
        self.hidden = hidden
        if hidden == 0:  # the linear path alone: no parameters
            return
        # The stem also sees the coordinates, so pooled features know where they came from.
        self.stems = nn.ModuleDict({
            f"{d}d": nn.Sequential(_EdgeConv(d, in_channels + d, hidden), nn.GELU(), _EdgeConv(d, hidden, hidden))
            for d in self.ndims
        })
        self.pos = nn.ParameterDict({f"{d}d": nn.Parameter(torch.zeros(self.tokens[d], hidden)) for d in self.ndims})
        for p in self.pos.values():
            nn.init.normal_(p, std=0.02)
        self.pool_proj = nn.ModuleDict({f"{d}d": nn.Linear(hidden + feats[d], hidden) for d in self.ndims})
        self.token_conv = nn.ModuleDict({f"{d}d": TokenGridConv(d, hidden, self.cells[d]) for d in self.ndims})
        self.mixer = nn.ModuleList(MixerBlock(hidden, heads) for _ in range(depth))
        self.out = nn.Linear(hidden, dim)
        nn.init.zeros_(self.out.weight)  # a fresh encoder is its linear path
        nn.init.zeros_(self.out.bias)

    def blocks(self) -> list[nn.Module]:
        """The mixer blocks, each a unit FSDP2 can shard on its own (stems stay with the root)."""
        return list(self.mixer) if self.hidden else []

    def _dim_of(self, u: Tensor) -> int:
        d = u.ndim - 2
        if d not in self.ndims:
            raise ValueError(f"encoder built for ndims={self.ndims} got a field of shape {tuple(u.shape)}")
        return d

    def cell_coefficients(self, u: Tensor) -> Tensor:
        """Least-squares cosine coefficients of every token's cell, fp32. u [B, C, *grid] -> [B, L, C * K]."""
        d = self._dim_of(u)
        coef_BLCK = fit_cells(u, self.cells[d], self.modes[d], getattr(self, f"morton_{d}d", None))
        return coef_BLCK.flatten(2)

    def forward(self, u: Tensor) -> Tensor:
        """u: [B, C, *grid] (1, 2 or 3 spatial axes) -> z_BLD [B, L, D]."""
        d = self._dim_of(u)
        B, grid = u.shape[0], tuple(u.shape[2:])
        c_BLF = self.cell_coefficients(u)
        z_lin = self.linear[f"{d}d"].encode(c_BLF)
        if not self.hidden:
            return z_lin
        coords = cell_centres(grid, u.device).T.reshape(1, d, *grid).to(u.dtype).expand(B, -1, *grid)
        feat = self.stems[f"{d}d"](torch.cat([u, coords], dim=1))
        if d == 1:
            x_BFL = F.adaptive_avg_pool1d(feat, self.tokens[1])
        else:
            pool = F.adaptive_avg_pool2d if d == 2 else F.adaptive_avg_pool3d
            x_BFL = pool(feat, (self.cells[d],) * d).flatten(2)[:, :, getattr(self, f"morton_{d}d")]
        x_BLH = self.pool_proj[f"{d}d"](torch.cat([x_BFL.transpose(1, 2), c_BLF.to(x_BFL.dtype)], dim=-1))
        x_BLH = self.token_conv[f"{d}d"](x_BLH) + self.pos[f"{d}d"]
        for blk in self.mixer:
            x_BLH = blk(x_BLH)
        return z_lin + self.out(x_BLH).float()


class GridDecoder(nn.Module):
    """Latent tokens -> field at any grid (``forward``) or any points (``query``).

    Each token decodes to the cosine coefficients of its cell (the linear path's transpose plus
    the non-linear correction); a point takes the expansion of the cell it lies in.

    Args:
        out_channels: C. tokens: L. dim: D. hidden: H. ndims, depth, heads, modes, linear: as GridEncoder.
    """

    def __init__(self, out_channels: int, tokens: int | dict[int, int], dim: int, hidden: int = 64,
                 ndims: tuple[int, ...] = (1, 2), depth: int = 2, heads: int = 4, modes: int | dict[int, int] = 4,
                 linear: str = "local") -> None:
        super().__init__()
        self.ndims, self.out_channels = tuple(ndims), out_channels
        self.tokens, self.cells = _check_layout(tokens, self.ndims)
        self.modes = _modes_for(modes, self.ndims)
        feats = {d: out_channels * self.modes[d] ** d for d in self.ndims}
        self.linear = nn.ModuleDict({f"{d}d": _LinearPath(feats[d], dim, self.tokens[d], linear) for d in self.ndims})
        _register_morton(self, self.cells)
        self.hidden = hidden
        if hidden == 0:  # the linear path alone: no parameters
            return
        self.inp = nn.Linear(dim, hidden)
        self.pos = nn.ParameterDict({f"{d}d": nn.Parameter(torch.zeros(self.tokens[d], hidden)) for d in self.ndims})
        for p in self.pos.values():
            nn.init.normal_(p, std=0.02)
        self.mixer = nn.ModuleList(MixerBlock(hidden, heads) for _ in range(depth))
        self.token_conv = nn.ModuleDict({f"{d}d": TokenGridConv(d, hidden, self.cells[d]) for d in self.ndims})
        self.coef = nn.ModuleDict({f"{d}d": nn.Linear(hidden, feats[d]) for d in self.ndims})
        for layer in self.coef.values():  # a fresh decoder is the linear path's inverse
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def blocks(self) -> list[nn.Module]:
        """The mixer blocks, each a unit FSDP2 can shard on its own (stems stay with the root)."""
        return list(self.mixer) if self.hidden else []

    def cell_coefficients(self, z_BLD: Tensor, d: int) -> Tensor:
        """Cosine coefficients of every cell, fp32. z_BLD [B, L, D] -> [B, L, C * K]."""
        if d not in self.ndims or z_BLD.shape[1] != self.tokens[d]:
            raise ValueError(f"decoder for ndims={self.ndims}, L={self.tokens} got z {tuple(z_BLD.shape)}, d={d}")
        if not self.hidden:
            return self.linear[f"{d}d"].decode(z_BLD)
        x_BLH = self.inp(z_BLD) + self.pos[f"{d}d"]
        for blk in self.mixer:
            x_BLH = blk(x_BLH)
        correction = self.coef[f"{d}d"](self.token_conv[f"{d}d"](x_BLH))
        return self.linear[f"{d}d"].decode(z_BLD) + correction.float()

    def query(self, z_BLD: Tensor, coords_BQd: Tensor) -> Tensor:
        """Decode at arbitrary points. z_BLD: [B, L, D], coords_BQd: [B, Q, d] in [0, 1]^d -> [B, Q, C].

        Coordinate k indexes grid axis k (x for axis 2 of ``u_BCXY``, y for axis 3, z for axis 4).
        """
        d = coords_BQd.shape[-1]
        coef_BLF = self.cell_coefficients(z_BLD, d)
        if d not in self.ndims:
            raise ValueError(f"decoder for ndims={self.ndims} got {d}-dimensional coordinates")
        tok_BQ, s_BQd = locate(coords_BQd, self.cells[d], getattr(self, f"unmorton_{d}d", None))
        basis_BQK = cosine_basis(s_BQd, self.modes[d])
        coef_BQCK = coef_BLF.gather(1, tok_BQ[..., None].expand(-1, -1, coef_BLF.shape[-1])).unflatten(
            -1, (self.out_channels, -1))
        return torch.einsum("bqck,bqk->bqc", coef_BQCK, basis_BQK)

    def forward(self, z_BLD: Tensor, grid_shape: tuple[int, ...]) -> Tensor:
        """Decode on a cell-centred grid. z_BLD: [B, L, D], grid_shape (X,), (X, Y) or (X, Y, Z) -> [B, C, *grid_shape].

        Equal to ``query`` at the cell centres, evaluated one axis at a time (no per-point gather).
        """
        d = len(grid_shape)
        coef = self.cell_coefficients(z_BLD, d).unflatten(-1, (self.out_channels, -1))  # [B, L, C, K]
        return eval_cells(coef, grid_shape, self.cells[d], self.modes.get(d, 1), getattr(self, f"unmorton_{d}d", None))


@torch.no_grad()
def fit_linear_path(encoder: GridEncoder, decoder: GridDecoder, fields: Iterable[Tensor]) -> dict[int, float]:
    """Fit both halves' linear paths to training fields, in place; returns {d: captured energy fraction}.

    ``fields``: batches ``u [B, C, *grid]`` (any dimensions the codec supports, any mix). Per
    dimension, the coefficient vectors of all batches (one per cell, or one per field for the
    global scope) are centred and their leading principal directions become ``basis`` (PCA: the
    best linear code of that size). When the code is at least as long as the vector the basis
    stays the exact padded identity and only the centre is fitted. The result
    depends only on the fields, not on the order of the batches beyond float summation.
    """
    sums: dict[int, tuple[Tensor, Tensor, int]] = {}
    for u in fields:
        d = encoder._dim_of(u)
        c = encoder.linear[f"{d}d"].flat(encoder.cell_coefficients(u)).double().flatten(0, 1)  # [vectors, F']
        s, ss, n = sums.get(d, (0, 0, 0))
        sums[d] = (s + c.sum(0), ss + c.T @ c, n + c.shape[0])
    captured = {}
    for d, (s, ss, n) in sums.items():
        enc, dec = encoder.linear[f"{d}d"], decoder.linear[f"{d}d"]
        features, dim = enc.basis.shape
        mean = s / n
        cov = ss / n - torch.outer(mean, mean)
        if dim >= features:
            basis = torch.eye(features, dim, dtype=torch.float64, device=cov.device)
            captured[d] = 1.0
        else:
            values, vectors = torch.linalg.eigh(cov)  # ascending
            basis = vectors[:, -dim:].flip(-1)
            captured[d] = float(values[-dim:].sum() / values.sum().clamp_min(1e-30))
        for path in (enc, dec):
            path.basis.copy_(basis.to(path.basis))
            path.center.copy_(mean.to(path.center))
    return captured
