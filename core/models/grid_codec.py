"""Grid encoder and decoder: fields on uniform grids (any resolution) <-> L latent tokens.

Legend: B batch, C channels, X/Y grid sizes, L tokens, D latent dim, H hidden dim,
Q query points, d spatial dimension (1 or 2), S side of the 2D token grid (L = S * S).

Grids are cell-centred on the unit interval/square: point i of X sits at (i + 0.5) / X
(PDEBench's x-coordinate convention). Token layout, shared by encoder and decoder:
  1D: token l is the segment [l / L, (l + 1) / L), left to right;
  2D: the unit square is an S x S patch grid (L must be a power of 4) whose patches are
      listed in Morton (Z) order, so runs of 4^m tokens are square patches.
Tasks of either dimension and of any resolution map to the same [L, D], so one operator
serves all of them. Each spatial dimension has its own stem (convolutions and local
Legendre moments, adaptive pooling to the token grid, a token-grid convolution, a
positional embedding); the global-attention token mixer is shared.
Build with ``ndims=(1,)`` or ``(2,)`` when only one kind of field is trained: a stem that
never runs leaves parameters without gradients (DDP then needs find_unused_parameters).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.models.layers import MixerBlock, morton_permutation


def _check_layout(tokens: int, ndims: tuple[int, ...]) -> int:
    """Validate the token layout; returns S (side of the 2D token grid, 0 if unused)."""
    if tokens < 1 or not ndims or any(d not in (1, 2) for d in ndims):
        raise ValueError(f"need tokens >= 1 and ndims within (1, 2), got {tokens}, {ndims}")
    if 2 not in ndims:
        return 0
    side = math.isqrt(tokens)
    if side * side != tokens or side & (side - 1):
        raise ValueError(f"2D fields need tokens = a power of 4 (an S x S Morton grid), got {tokens}")
    return side


class _EdgeConv(nn.Module):
    """3 (x 3) convolution with edge-replicating padding, same size out. ``[B, C, *grid] -> [B, C_out, *grid]``.

    Replicate padding avoids an artificial zero wall at (often non-periodic) boundaries.
    It is done by index clamping rather than ``padding_mode="replicate"``: with torch 2.13
    inductor's ``replication_pad2d_backward`` fails a stride assertion on CPU.
    """

    def __init__(self, d: int, c_in: int, c_out: int) -> None:
        super().__init__()
        self.d = d
        self.conv = (nn.Conv1d if d == 1 else nn.Conv2d)(c_in, c_out, kernel_size=3)

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, C, *grid] -> [B, C_out, *grid]."""
        for axis in range(2, 2 + self.d):
            n = x.shape[axis]
            idx = torch.arange(-1, n + 1, device=x.device).clamp(0, n - 1)
            x = x.index_select(axis, idx)
        return self.conv(x)


def local_basis(t_Nd: Tensor, order: int) -> Tensor:
    """Tensor-product Legendre polynomials P_0..P_order of local coordinates. [..., d] -> [..., (order + 1) ** d].

    The encoder projects each token cell's field onto them (local moments, with t in
    [-1, 1] across the cell) and the decoder expands each token's coefficients in them
    (t = offset from the cell centre in cell units), so smooth fields have an exact
    linear path through the codec; convolutions and attention add non-linear
    corrections. Legendre rather than monomials: orthogonal on [-1, 1], so the linear
    path is well conditioned for Adam.
    """
    per_axis = []
    for a in range(t_Nd.shape[-1]):
        t = t_Nd[..., a]
        polys = [torch.ones_like(t), t]
        for k in range(1, order):  # Bonnet: (k + 1) P_{k+1} = (2k + 1) t P_k - k P_{k-1}
            polys.append(((2 * k + 1) * t * polys[k] - k * polys[k - 1]) / (k + 1))
        per_axis.append(torch.stack(polys[: order + 1], dim=-1))
    out = per_axis[0]
    for p in per_axis[1:]:
        out = (out[..., :, None] * p[..., None, :]).flatten(-2)
    return out


class TokenGridConv(nn.Module):
    """Residual 3 (x 3) convolution over the token grid: each token mixes with its neighbours.

    Tokens are laid out as a line (1D) or an S x S grid (2D, Morton order undone and
    redone), so a token's features describe its neighbourhood: the local expansions in
    the decoder then extrapolate from several cells' data, not from their own cell alone.
    ``[B, L, H] -> [B, L, H]``.
    """

    def __init__(self, d: int, hidden: int, side: int) -> None:
        super().__init__()
        self.d, self.side = d, side
        self.conv = _EdgeConv(d, hidden, hidden)
        if d == 2:
            morton = morton_permutation(side)
            self.register_buffer("morton", morton, persistent=False)
            self.register_buffer("unmorton", torch.argsort(morton), persistent=False)

    def forward(self, x_BLH: Tensor) -> Tensor:
        """x_BLH -> [B, L, H]."""
        x_BHL = x_BLH.transpose(1, 2)
        if self.d == 1:
            return x_BLH + self.conv(x_BHL).transpose(1, 2)
        grid = x_BHL[:, :, self.unmorton].unflatten(-1, (self.side, self.side))
        return x_BLH + self.conv(grid).flatten(2)[:, :, self.morton].transpose(1, 2)


def cell_centres(grid_shape: tuple[int, ...], device: torch.device | None = None) -> Tensor:
    """Cell-centred coordinates of a uniform grid on [0, 1]^d, row-major. -> [prod(grid), d]."""
    axes = [(torch.arange(n, device=device, dtype=torch.float32) + 0.5) / n for n in grid_shape]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(grid_shape))


class GridEncoder(nn.Module):
    """Field on a grid -> latent tokens. ``u_BCX`` or ``u_BCXY`` (any X, Y) -> ``z_BLD``.

    Args:
        in_channels: C. tokens: L. dim: D. hidden: H (divisible by ``heads``).
        ndims: spatial dimensions to support (a stem each).
        depth: number of global-attention mixer blocks over the L tokens.
        heads: attention heads of the mixer.
        order: polynomial order of the local moments (see ``local_basis``).
    """

    def __init__(self, in_channels: int, tokens: int, dim: int, hidden: int = 64, ndims: tuple[int, ...] = (1, 2),
                 depth: int = 2, heads: int = 4, order: int = 3) -> None:
        super().__init__()
        self.tokens, self.ndims, self.order = tokens, tuple(ndims), order
        self.side = _check_layout(tokens, self.ndims)
        # The stem also sees the coordinates, so pooled features know where they came from.
        self.stems = nn.ModuleDict({
            f"{d}d": nn.Sequential(_EdgeConv(d, in_channels + d, hidden), nn.GELU(), _EdgeConv(d, hidden, hidden), nn.GELU(),
                                   _EdgeConv(d, hidden, hidden))
            for d in self.ndims
        })
        self.pos = nn.ParameterDict({f"{d}d": nn.Parameter(torch.zeros(tokens, hidden)) for d in self.ndims})
        for p in self.pos.values():
            nn.init.normal_(p, std=0.02)
        self.pool_proj = nn.ModuleDict({
            f"{d}d": nn.Linear(hidden + in_channels * (order + 1) ** d, hidden) for d in self.ndims
        })
        self.token_conv = nn.ModuleDict({f"{d}d": TokenGridConv(d, hidden, self.side) for d in self.ndims})
        if self.side:
            self.register_buffer("morton", morton_permutation(self.side), persistent=False)
        self.mixer = nn.ModuleList(MixerBlock(hidden, heads) for _ in range(depth))
        self.out = nn.Linear(hidden, dim)

    def blocks(self) -> list[nn.Module]:
        """The mixer blocks, each a unit FSDP2 can shard on its own (stems stay with the root)."""
        return list(self.mixer)

    def forward(self, u: Tensor) -> Tensor:
        """u: [B, C, X] or [B, C, X, Y] -> z_BLD [B, L, D]."""
        d = u.ndim - 2
        if d not in self.ndims:
            raise ValueError(f"encoder built for ndims={self.ndims} got a field of shape {tuple(u.shape)}")
        B, grid = u.shape[0], tuple(u.shape[2:])
        n = self.tokens if d == 1 else self.side  # token cells per axis
        coords_Pd = cell_centres(grid, u.device)  # [P, d], P = prod(grid)
        # Offset of each grid point from the centre of its token cell, in cell units.
        rel_Pd = coords_Pd * n - (coords_Pd * n).floor() - 0.5
        basis_KP = local_basis(2 * rel_Pd, self.order).T.reshape(-1, *grid).to(u.dtype)
        moments = (u[:, :, None] * basis_KP).flatten(1, 2)  # [B, C * K, *grid]
        coords = coords_Pd.T.reshape(1, d, *grid).to(u.dtype).expand(B, -1, *grid)
        feat = torch.cat([self.stems[f"{d}d"](torch.cat([u, coords], dim=1)), moments], dim=1)
        if d == 1:
            x_BFL = F.adaptive_avg_pool1d(feat, self.tokens)
        else:
            x_BFL = F.adaptive_avg_pool2d(feat, (self.side, self.side)).flatten(2)[:, :, self.morton]
        x_BLH = self.token_conv[f"{d}d"](self.pool_proj[f"{d}d"](x_BFL.transpose(1, 2))) + self.pos[f"{d}d"]
        for blk in self.mixer:
            x_BLH = blk(x_BLH)
        return self.out(x_BLH)


class GridDecoder(nn.Module):
    """Latent tokens -> field at any grid (``forward``) or any points (``query``).

    Local implicit decoding: tokens are mixed by global attention and each is mapped to
    the coefficients of a local polynomial per channel (``local_basis``). A query point
    takes the 2 (1D) or 4 (2D) token cells whose centres surround it, evaluates each
    cell's polynomial at the point's offset from that centre, and blends the values with
    linear/bilinear weights, so the output is continuous across cell borders and costs
    one small contraction per point (the networks run on the L tokens only).

    Args:
        out_channels: C. tokens: L. dim: D. hidden: H. ndims, depth, heads: as GridEncoder.
        order: polynomial order per axis of the local expansion.
    """

    def __init__(self, out_channels: int, tokens: int, dim: int, hidden: int = 64, ndims: tuple[int, ...] = (1, 2),
                 depth: int = 2, heads: int = 4, order: int = 3) -> None:
        super().__init__()
        self.tokens, self.ndims, self.out_channels, self.order = tokens, tuple(ndims), out_channels, order
        self.side = _check_layout(tokens, self.ndims)
        self.inp = nn.Linear(dim, hidden)
        self.pos = nn.ParameterDict({f"{d}d": nn.Parameter(torch.zeros(tokens, hidden)) for d in self.ndims})
        for p in self.pos.values():
            nn.init.normal_(p, std=0.02)
        if self.side:
            # row-major cell -> token index: inverse of the Morton permutation.
            self.register_buffer("unmorton", torch.argsort(morton_permutation(self.side)), persistent=False)
        self.mixer = nn.ModuleList(MixerBlock(hidden, heads) for _ in range(depth))
        self.token_conv = nn.ModuleDict({f"{d}d": TokenGridConv(d, hidden, self.side) for d in self.ndims})
        self.coef = nn.ModuleDict({
            f"{d}d": nn.Linear(hidden, out_channels * (order + 1) ** d) for d in self.ndims
        })

    def blocks(self) -> list[nn.Module]:
        """The mixer blocks, each a unit FSDP2 can shard on its own (stems stay with the root)."""
        return list(self.mixer)

    def query(self, z_BLD: Tensor, coords_BQd: Tensor) -> Tensor:
        """Decode at arbitrary points. z_BLD: [B, L, D], coords_BQd: [B, Q, d] in [0, 1]^d -> [B, Q, C].

        Coordinate k indexes grid axis k (x for axis 2 of ``u_BCXY``, y for axis 3).
        """
        B, Q, d = coords_BQd.shape
        if d not in self.ndims or z_BLD.shape[1] != self.tokens:
            raise ValueError(f"decoder for ndims={self.ndims}, L={self.tokens} got z {tuple(z_BLD.shape)}, d={d}")
        x_BLH = self.inp(z_BLD) + self.pos[f"{d}d"]
        for blk in self.mixer:
            x_BLH = blk(x_BLH)
        coef_BLF = self.coef[f"{d}d"](self.token_conv[f"{d}d"](x_BLH))  # F = C * K
        n = self.tokens if d == 1 else self.side  # token cells per axis
        # Per axis: the two cells whose centres (i + 0.5) / n bracket the point. At the
        # borders both stay inside [0, n) and the weight is clamped, so the nearest cell
        # extrapolates through its offset input instead of the blend extrapolating.
        p_BQd = coords_BQd.float() * n - 0.5
        lo_BQd = p_BQd.floor().clamp(0, max(n - 2, 0))
        w_hi_BQd = (p_BQd - lo_BQd).clamp(0, 1)
        out = 0
        for corner in range(2**d):
            bits = [(corner >> a) & 1 for a in range(d)]
            sel = torch.tensor(bits, device=coords_BQd.device, dtype=torch.bool)
            idx_BQd = torch.where(sel, (lo_BQd + 1).clamp(max=n - 1), lo_BQd)
            w_BQ = torch.where(sel, w_hi_BQd, 1 - w_hi_BQd).prod(-1)
            rel_BQd = p_BQd - idx_BQd  # offset from the cell centre, in cell units
            idx_BQd = idx_BQd.long()
            tok_BQ = idx_BQd[..., 0] if d == 1 else self.unmorton[idx_BQd[..., 0] * n + idx_BQd[..., 1]]
            coef_BQCK = coef_BLF.gather(1, tok_BQ[..., None].expand(-1, -1, coef_BLF.shape[-1])).unflatten(
                -1, (self.out_channels, -1))
            basis_BQK = local_basis(rel_BQd, self.order).to(coef_BQCK.dtype)
            out = out + w_BQ[..., None].to(coef_BQCK.dtype) * torch.einsum("bqck,bqk->bqc", coef_BQCK, basis_BQK)
        return out

    def forward(self, z_BLD: Tensor, grid_shape: tuple[int, ...]) -> Tensor:
        """Decode on a cell-centred grid. z_BLD: [B, L, D], grid_shape (X,) or (X, Y) -> [B, C, *grid_shape]."""
        B = z_BLD.shape[0]
        coords = cell_centres(tuple(grid_shape), z_BLD.device)
        u_BQC = self.query(z_BLD, coords[None].expand(B, -1, -1))
        return u_BQC.transpose(1, 2).reshape(B, self.out_channels, *grid_shape)
