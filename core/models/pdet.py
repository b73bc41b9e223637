"""PDE-Transformer operator ``pdet_unet``: a U-shaped windowed transformer over latent tokens.

Legend: B batch, L tokens, D latent dim, H hidden dim (width of a level), N heads,
E head dim, W window (group) size, n windows per sequence.

Tokens are spatially ordered (see ``grid_codec``), so a window of W consecutive tokens is
a local patch. Attention runs inside windows; odd blocks cyclically shift the sequence by
W // 2 first (Swin), so information crosses window borders. The cyclic shift wraps the
last tokens onto the first ones, i.e. the token sequence is treated as periodic.
Going down, pairs of neighbouring tokens are concatenated and projected to twice the width
(L -> L/2, H -> 2H); going up they are split again and fused with the skip connection.
Every ``PDETBlock`` is its own module, listed by ``PDETUNet.blocks()`` for FSDP2.

Padding: L is padded at the end with zero tokens to a multiple of ``group_size *
2 ** (levels - 1)`` (so every level splits into whole windows). Padded tokens are masked
out as keys (a padded query still sees itself, so no attention row is empty) and cut off
at the end; real tokens never read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from core.models.conditioning import AdaLNZero, ConditionEmbedding, modulate
from core.models.layers import Mlp, apply_rope
from core.models.registry import register
from core.models.settings import SETTINGS, heads_divide, positive, shown


def _norm_in_own_dtype(norm: nn.RMSNorm, x: Tensor) -> Tensor:
    """``norm(x)`` with the weight in ``x``'s dtype. Under bf16 autocast the queries and keys are bf16
    while an unsharded model's weights stay fp32, and a mixed pair misses torch's fused kernel (a
    warning, and half its speed on a CPU); FSDP2's bf16 parameters already match. fp32 is unchanged."""
    return F.rms_norm(x, norm.normalized_shape, norm.weight.to(x.dtype), norm.eps)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside windows of ``group_size`` tokens, optionally shifted.

    Args:
        dim: H; num_heads: N (H divisible by N, head dim even); group_size: W;
        shifted: roll the sequence by ``-(W // 2)`` before windowing and back afterwards.
    """

    def __init__(self, dim: int, num_heads: int, group_size: int, shifted: bool) -> None:
        super().__init__()
        if dim % num_heads or (dim // num_heads) % 2:
            raise ValueError(f"width {dim} must split into {num_heads} heads of even size")
        self.num_heads, self.group_size = num_heads, group_size
        self.shift = group_size // 2 if shifted else 0
        self.qkv = nn.Linear(dim, 3 * dim)
        # RMS-normalised queries and keys keep attention logits bounded in bf16.
        self.q_norm = nn.RMSNorm(dim // num_heads, eps=1e-6)
        self.k_norm = nn.RMSNorm(dim // num_heads, eps=1e-6)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x_BLD: Tensor, valid_L: Tensor | None = None) -> Tensor:
        """x_BLD: [B, L, H] with L a multiple of W; valid_L: bool [L] (False = padding) or None."""
        B, L, _ = x_BLD.shape
        W = self.group_size
        if L % W:
            raise ValueError(f"sequence length {L} is not a multiple of group_size {W}")
        if self.shift:
            x_BLD = torch.roll(x_BLD, -self.shift, dims=1)
            valid_L = None if valid_L is None else torch.roll(valid_L, -self.shift, dims=0)
        qkv = self.qkv(x_BLD)
        q, k, v = rearrange(qkv, "b (n w) (three h e) -> three (b n) h w e", w=W, three=3, h=self.num_heads)
        q, k = apply_rope(_norm_in_own_dtype(self.q_norm, q)), apply_rope(_norm_in_own_dtype(self.k_norm, k))
        mask = None
        if valid_L is not None:
            keys_n11W = rearrange(valid_L, "(n w) -> n 1 1 w", w=W)
            eye_WW = torch.eye(W, dtype=torch.bool, device=x_BLD.device)
            mask = (keys_n11W | eye_WW).repeat(B, 1, 1, 1)  # [(b n), 1, W, W], b-major like q
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out_BLD = self.proj(rearrange(o, "(b n) h w e -> b (n w) (h e)", b=B))
        if self.shift:
            out_BLD = torch.roll(out_BLD, self.shift, dims=1)
        return out_BLD


class PDETBlock(nn.Module):
    """adaLN-Zero transformer block: windowed attention + MLP, both gated by c.

    ``x = x + g1 * attn(modulate(norm(x)))``; ``x = x + g2 * mlp(modulate(norm(x)))``.
    At initialisation the gates are exactly 0, so ``block(x, c) == x``.

    Args:
        dim: H; num_heads: N; group_size: W; cond_dim: width of c;
        shifted: shifted windows; mlp_ratio: MLP hidden width / H.
    """

    def __init__(self, dim: int, num_heads: int, group_size: int, cond_dim: int, shifted: bool,
                 mlp_ratio: float = 4.0, token_conv: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = WindowAttention(dim, num_heads, group_size, shifted)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        # Optional third branch: a 3-tap convolution along the token sequence (circular, as the
        # shifted windows treat the sequence). A local PDE's step is a fixed stencil across
        # neighbouring tokens, which attention can only learn as position-dependent weights.
        self.conv = nn.Conv1d(dim, dim, 3, padding=1, padding_mode="circular") if token_conv else None
        self.ada = AdaLNZero(cond_dim, dim, 9 if token_conv else 6)

    def forward(self, x_BLD: Tensor, c_BH: Tensor, valid_L: Tensor | None = None) -> Tensor:
        """x_BLD: [B, L, H], c_BH: [B, cond_dim], valid_L: bool [L] or None -> [B, L, H]."""
        mods = self.ada(c_BH)
        shift1, scale1, gate1, shift2, scale2, gate2 = mods[:6]
        x_BLD = x_BLD + gate1 * self.attn(modulate(self.norm1(x_BLD), shift1, scale1), valid_L)
        if self.conv is not None:
            shift3, scale3, gate3 = mods[6:]
            h = modulate(self.norm1(x_BLD), shift3, scale3)
            x_BLD = x_BLD + gate3 * self.conv(h.transpose(1, 2)).transpose(1, 2)
        return x_BLD + gate2 * self.mlp(modulate(self.norm2(x_BLD), shift2, scale2))


class TokenMerge(nn.Module):
    """Concatenate neighbouring token pairs and project: [B, L, H] -> [B, L/2, H_out]."""

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(2 * dim)
        self.proj = nn.Linear(2 * dim, out_dim)

    def forward(self, x_BLD: Tensor) -> Tensor:
        """x_BLD with even L -> [B, L/2, H_out]."""
        return self.proj(self.norm(rearrange(x_BLD, "b (l two) d -> b l (two d)", two=2)))


class TokenSplit(nn.Module):
    """Project and split every token into a neighbouring pair: [B, L, H] -> [B, 2L, H_out]."""

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 2 * out_dim)

    def forward(self, x_BLD: Tensor) -> Tensor:
        """x_BLD -> [B, 2L, H_out]."""
        return rearrange(self.proj(x_BLD), "b l (two d) -> b (l two) d", two=2)


@dataclass(**SETTINGS)
class PDETSettings:
    """PDE-Transformer U-Net backbone (windowed attention, token merging): the settings of operator
    ``pdet_unet`` (config ``operator.pdet``) and of the denoisers (``diffusion.pdet``, ``steady.pdet``)."""

    hidden_dim: int = 64
    """Width of the first level; doubles at each merge."""
    depths: tuple[int, ...] = (2, 2)
    """Transformer blocks per level, top to bottom."""
    num_heads: int = 4
    """Attention heads per block."""
    group_size: int = 8
    """Tokens per attention window."""
    mlp_ratio: float = 4.0
    """MLP width relative to the block width."""
    token_conv: bool = False
    """Add a 3-tap convolution along the token sequence to every block (a learned local stencil,
    what a local PDE's time step is; attention alone must learn it as position-dependent weights)."""

    def __post_init__(self):
        positive(self, "hidden_dim", "num_heads", "group_size", "mlp_ratio")
        if not self.depths or any(d <= 0 for d in self.depths):
            raise ValueError(f"depths must be a non-empty tuple of positive ints, got {shown(self.depths)}")
        if self.group_size % 2:  # the shifted windows move by half a window (`PDETUNet` refuses it too)
            raise ValueError(f"group_size must be even, got {shown(self.group_size)}")
        heads_divide(self)


@register("operator", "pdet_unet", settings=PDETSettings, section="pdet")
class PDETUNet(nn.Module):
    """U-shaped windowed transformer; the operator ``pdet_unet``.

    Level i has width ``hidden_dim * 2**i``, ``num_heads * 2**i`` heads (constant head dim)
    and ``depths[i]`` blocks on the way down; levels below the bottom repeat their depth
    on the way up. Blocks alternate plain / shifted windows.

    Args:
        dim: D, latent token width (input and output).
        hidden_dim: width of the first level (also the conditioning width).
        depths: blocks per level, e.g. (2, 2); len(depths) = number of levels.
        num_heads: heads at the first level.
        group_size: W, tokens per attention window (the same at every level).
        num_tasks: size of the task-id table.
        mlp_ratio: MLP hidden width / level width.
        cond_noise: also condition on a noise level (``noise_B`` required in forward).
        extra_in: width of extra per-token inputs concatenated to z (0 = none).
        residual: return ``z + f(z)`` (True, an operator) or ``f(z)`` alone (False).
    """

    def __init__(self, dim: int, hidden_dim: int, depths: tuple[int, ...], num_heads: int, group_size: int,
                 num_tasks: int, mlp_ratio: float = 4.0, cond_noise: bool = False, extra_in: int = 0,
                 residual: bool = True, token_conv: bool = False) -> None:
        super().__init__()
        if not depths or min(depths) < 1:
            raise ValueError(f"depths must be a non-empty tuple of positive ints, got {depths}")
        if group_size < 2 or group_size % 2:
            raise ValueError(f"group_size must be even and >= 2, got {group_size}")
        self.dim, self.extra_in, self.residual = dim, extra_in, residual
        self.group_size, self.levels = group_size, len(depths)
        widths = [hidden_dim * 2**i for i in range(self.levels)]

        def level(i: int) -> nn.ModuleList:
            return nn.ModuleList(
                PDETBlock(widths[i], num_heads * 2**i, group_size, hidden_dim, shifted=j % 2 == 1, mlp_ratio=mlp_ratio,
                          token_conv=token_conv)
                for j in range(depths[i])
            )

        self.cond = ConditionEmbedding(hidden_dim, num_tasks, cond_noise)
        self.in_proj = nn.Linear(dim + extra_in, hidden_dim)
        self.down = nn.ModuleList(level(i) for i in range(self.levels))
        self.merges = nn.ModuleList(TokenMerge(widths[i], widths[i + 1]) for i in range(self.levels - 1))
        self.splits = nn.ModuleList(TokenSplit(widths[i + 1], widths[i]) for i in range(self.levels - 1))
        self.fuses = nn.ModuleList(nn.Linear(2 * widths[i], widths[i]) for i in range(self.levels - 1))
        self.up = nn.ModuleList(level(i) for i in range(self.levels - 1))
        self.out_norm = nn.LayerNorm(hidden_dim, elementwise_affine=False, eps=1e-6)
        self.out_ada = AdaLNZero(hidden_dim, hidden_dim, 2)
        self.out_proj = nn.Linear(hidden_dim, dim)
        # Zero output layer: a fresh operator returns z exactly (the persistence baseline).
        nn.init.zeros_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def blocks(self) -> list[PDETBlock]:
        """All transformer blocks (down, bottom and up), each a unit for FSDP2 ``fully_shard``."""
        return [blk for level in (*self.down, *self.up) for blk in level]

    def padded_length(self, tokens: int) -> int:
        """Smallest multiple of ``group_size * 2 ** (levels - 1)`` that is >= tokens."""
        mult = self.group_size * 2 ** (self.levels - 1)
        return -(-tokens // mult) * mult

    def forward(self, z_BLD: Tensor, dt_B: Tensor, task_id_B: Tensor, noise_B: Tensor | None = None,
                extra_BLD: Tensor | None = None) -> Tensor:
        """z_BLD: [B, L, D], dt_B: [B], task_id_B: int64 [B], noise_B: [B] or None,
        extra_BLD: [B, L, extra_in] or None -> next latent [B, L, D] (or f(z) if not residual)."""
        B, L, _ = z_BLD.shape
        if (extra_BLD is None) != (self.extra_in == 0):
            raise ValueError(f"extra_BLD must be given iff extra_in > 0 (extra_in={self.extra_in})")
        c_BH = self.cond(dt_B, task_id_B, noise_B)
        inputs = z_BLD if extra_BLD is None else torch.cat([z_BLD, extra_BLD], dim=-1)
        # In the weights' dtype: under FSDP2's bf16 policy the root receives the fp32 latent state
        # uncast (its skip below needs it) while its weights are bf16.
        x = self.in_proj(inputs.to(self.in_proj.weight.dtype))
        Lp = self.padded_length(L)
        valid_L = None
        if Lp != L:
            x = F.pad(x, (0, 0, 0, Lp - L))
            valid_L = torch.arange(Lp, device=x.device) < L
        skips: list[tuple[Tensor, Tensor | None]] = []
        for i, level in enumerate(self.down):
            for blk in level:
                x = blk(x, c_BH, valid_L)
            if i < self.levels - 1:
                skips.append((x, valid_L))
                x = self.merges[i](x)
                # A merged pair starts at an even index; it is real iff its first token is.
                valid_L = None if valid_L is None else valid_L[0::2]
        for i in reversed(range(self.levels - 1)):
            skip, valid_L = skips[i]
            x = self.fuses[i](torch.cat([self.splits[i](x), skip], dim=-1))
            for blk in self.up[i]:
                x = blk(x, c_BH, valid_L)
        shift, scale = self.out_ada(c_BH)
        delta_BLD = self.out_proj(modulate(self.out_norm(x), shift, scale))[:, :L]
        # The skip runs in the latent state's own dtype (fp32), whatever the compute dtype was:
        # a bf16 skip would round the state by up to 2**-9 of |z| at every step.
        return z_BLD + delta_BLD.to(z_BLD.dtype) if self.residual else delta_BLD
