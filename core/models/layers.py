"""Small shared layers: MLP, rotary embedding, an unconditioned mixer block, Morton order.

Legend: B batch, L tokens, D width, N heads, E head dim, W window (group) size, S side of
a square token grid (L = S * S).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn


class Mlp(nn.Module):
    """``Linear -> GELU(tanh) -> Linear``; ``[..., D] -> [..., D_out]`` (D_out defaults to D)."""

    def __init__(self, dim: int, hidden: int, out_dim: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, out_dim or dim)

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., D] -> [..., D_out]."""
        return self.fc2(self.act(self.fc1(x)))


def apply_rope(x_NWE: Tensor, base: float = 100.0) -> Tensor:
    """Rotary position embedding over the second-to-last axis (positions 0 .. W-1).

    Used inside attention windows: every window gets the same local positions, so the
    attention depends on relative offsets only and moving a whole window keeps the result
    (the window-shift test relies on this). Angles are computed on the fly in float32
    (no buffers: nothing to re-initialise after meta-device construction).

    Args:
        x_NWE: [..., W, E] queries or keys, E even.
    Returns:
        Tensor of the same shape and dtype.
    """
    W, E = x_NWE.shape[-2], x_NWE.shape[-1]
    half = E // 2
    inv_freq = base ** (-torch.arange(half, device=x_NWE.device, dtype=torch.float32) / half)
    angles_WH = torch.arange(W, device=x_NWE.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angles_WH), torch.sin(angles_WH)
    x1, x2 = x_NWE[..., :half].float(), x_NWE[..., half:].float()
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x_NWE.dtype)


class MixerBlock(nn.Module):
    """Pre-norm transformer block with global self-attention (no conditioning).

    Used by the grid encoder/decoder to mix a small, fixed number of tokens. ``[B, L, D]
    -> [B, L, D]``.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 2.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} must be divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x_BLD: Tensor) -> Tensor:
        """x_BLD -> [B, L, D]."""
        qkv = self.qkv(self.norm1(x_BLD))
        q, k, v = rearrange(qkv, "b l (three n e) -> three b n l e", three=3, n=self.num_heads)
        o_BNLE = F.scaled_dot_product_attention(q, k, v)
        x_BLD = x_BLD + self.proj(rearrange(o_BNLE, "b n l e -> b l (n e)"))
        return x_BLD + self.mlp(self.norm2(x_BLD))


def morton_permutation(side: int, ndim: int = 2) -> Tensor:
    """Z-order of a ``side``^ndim grid: ``perm[k]`` is the row-major cell index of token k. -> int64 [side**ndim].

    Interleaving the bits of the cell's indices keeps neighbouring tokens spatially close, and every
    aligned run of (2^ndim)^m tokens is a cube of side 2^m: in 2D windows of 4, 16, 64 tokens are
    square patches, in 3D windows of 8, 64 tokens are cubes, and merging neighbouring token pairs
    merges neighbouring cells. ``side`` must be a power of two; ``ndim`` 1 is the identity.
    """
    if side < 1 or side & (side - 1):
        raise ValueError(f"Morton order needs a power-of-two side, got {side}")
    if ndim < 1:
        raise ValueError(f"Morton order needs ndim >= 1, got {ndim}")
    bits = max(side.bit_length() - 1, 0)
    # Row-major cell indices along each axis; the first axis takes the most significant bit of
    # each interleaved group, as the 2D order always has (row bit above column bit).
    index = torch.stack(torch.meshgrid(*[torch.arange(side)] * ndim, indexing="ij")).reshape(ndim, -1)
    codes = torch.zeros(index.shape[1], dtype=torch.int64)
    for b in range(bits):
        for a in range(ndim):
            codes |= ((index[a] >> b) & 1) << (ndim * b + ndim - 1 - a)
    return torch.argsort(codes)
