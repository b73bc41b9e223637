"""Plain transformer on the raw field: the ablation peer of our operator.

Legend: B batch, I input channels (C * initial_step), O output channels (C), X, Y grid points,
P patch, L tokens, W width, d spatial axes (1 or 2).

What it keeps from our operator is only the transformer; what it lacks is the point of the
ablation: no codec (it patches the raw field), no token stencil (global attention over all
patches), no identity start (the next frame is predicted directly, not as a change of the last).
The rest is the standard ViT recipe: a learned patch embedding (a convolution with kernel =
stride = P), a learned position embedding, pre-norm encoder layers (``nn.TransformerEncoderLayer``
with ``norm_first=True``, GELU MLP of ``mlp_ratio * W``, no dropout: the race trains regressors
on a fixed budget), a final LayerNorm, and a linear head that un-patchifies each token back to
its ``O * P^d`` values.

A grid that is not a multiple of the patch is padded periodically at the far end of each axis
(`core.models.unet.pad_periodic`) and the output cropped back, as our U-Net peer does.

`plain_transformer_args` picks the width whose parameter count is closest to a target (the race
compares models of the same size); `plain_transformer_params` is the exact count, in closed form.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from core.models.registry import register
from core.models.unet import pad_periodic

__all__ = ["PlainTransformer", "plain_transformer_args", "plain_transformer_params"]


def _tokens_per_axis(grid: list[int] | tuple[int, ...], patch: int) -> list[int]:
    """Patches along each axis after padding the grid up to a multiple of ``patch``."""
    return [math.ceil(n / patch) for n in grid]


@register("peer", "plain_transformer")
class PlainTransformer(nn.Module):
    """``[B, in_channels, *grid] -> [B, out_channels, *grid]`` through a ViT on patches of the field.

    Args:
        in_channels: input channels I (C * initial_step for the autoregressive peer).
        out_channels: output channels O (C).
        grid: spatial shape ``[X]`` or ``[X, Y]``; its length is the number of spatial axes. The
            position embedding has one entry per patch of this grid, so inputs must have it.
        patch: patch side P (the same on every axis).
        width: token width W (a multiple of ``heads``).
        depth: encoder layers.
        heads: attention heads.
        mlp_ratio: MLP hidden width over W (4, as ViT).
    """

    def __init__(self, in_channels: int, out_channels: int, grid: list[int], patch: int = 4, width: int = 128,
                 depth: int = 4, heads: int = 4, mlp_ratio: int = 4):
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels), ("patch", patch),
                            ("width", width), ("depth", depth), ("heads", heads), ("mlp_ratio", mlp_ratio)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if len(grid) not in (1, 2) or min(grid) < 1:
            raise ValueError(f"grid={list(grid)} must list 1 or 2 positive sizes")
        if width % heads:
            raise ValueError(f"width={width} must be a multiple of heads={heads}")
        self.in_channels, self.out_channels, self.patch = in_channels, out_channels, patch
        self.grid, self.ndim = tuple(grid), len(grid)
        self.tokens = _tokens_per_axis(grid, patch)
        conv = (nn.Conv1d, nn.Conv2d)[self.ndim - 1]
        self.embed = conv(in_channels, width, kernel_size=patch, stride=patch)
        self.position = nn.Parameter(torch.zeros(1, math.prod(self.tokens), width))
        torch.nn.init.trunc_normal_(self.position, std=0.02)  # ViT's initialisation
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=mlp_ratio * width, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        # enable_nested_tensor is a padding-mask fast path; it is off for norm_first layers anyway.
        self.encoder = nn.TransformerEncoder(layer, depth, norm=nn.LayerNorm(width), enable_nested_tensor=False)
        self.head = nn.Linear(width, out_channels * patch**self.ndim)

    def forward(self, u: Tensor) -> Tensor:
        """Next frame, predicted directly.

        Args:
            u: ``[B, I, *grid]``.

        Returns:
            ``[B, O, *grid]``.
        """
        if u.ndim != 2 + self.ndim or u.shape[1] != self.in_channels or tuple(u.shape[2:]) != self.grid:
            raise ValueError(f"expected u of shape [B, {self.in_channels}, {', '.join(map(str, self.grid))}], "
                             f"got {tuple(u.shape)}")
        z = self.embed(pad_periodic(u, self.patch, self.ndim))  # [B, W, *tokens]
        z_BLW = self.encoder(z.flatten(2).transpose(1, 2) + self.position)
        v = self.head(z_BLW).unflatten(1, self.tokens)  # [B, *tokens, O * P^d]
        v = v.unflatten(-1, (self.out_channels, *[self.patch] * self.ndim))  # [B, *tokens, O, *P]
        # [B, T1, (T2,) O, P1, (P2)] -> [B, O, T1, P1, (T2, P2)]: each token's patch back in place.
        d = self.ndim
        order = [0, d + 1, *[i for axis in range(1, d + 1) for i in (axis, axis + d + 1)]]
        out = v.permute(order).reshape(u.shape[0], self.out_channels, *[t * self.patch for t in self.tokens])
        return out[(..., *[slice(0, n) for n in self.grid])]


def plain_transformer_params(in_channels: int, out_channels: int, grid: list[int], patch: int = 4,
                             width: int = 128, depth: int = 4, heads: int = 4, mlp_ratio: int = 4) -> int:
    """Exact parameter count of ``PlainTransformer(**same arguments)``, without building it."""
    del heads  # the heads split W; they add no parameters
    per_patch = patch ** len(grid)
    tokens = math.prod(_tokens_per_axis(grid, patch))
    layer = (4 + 2 * mlp_ratio) * width**2 + (9 + mlp_ratio) * width  # attention 4W^2+4W, MLP, 2 norms
    return (in_channels * per_patch * width + width  # patch embedding
            + tokens * width  # position embedding
            + depth * layer + 2 * width  # layers, final norm
            + width * out_channels * per_patch + out_channels * per_patch)  # head


def plain_transformer_args(params_target: int, *, in_channels: int, out_channels: int, grid: list[int],
                           patch: int = 4, depth: int = 4, heads: int = 4, mlp_ratio: int = 4) -> dict:
    """Arguments of a `PlainTransformer` whose parameter count is closest to ``params_target``.

    Everything but the width is given; the width is the multiple of ``heads`` whose count is
    nearest (the count grows with the width, quadratically). A target below the smallest model
    (width = heads) gets the smallest model. Returns the constructor's keyword arguments as
    plain JSON values, ready for ``core.models.registry.build("peer", "plain_transformer", **args)``.
    """
    if params_target < 1:
        raise ValueError(f"params_target={params_target} must be >= 1")
    args = {"in_channels": in_channels, "out_channels": out_channels, "grid": list(grid), "patch": patch,
            "depth": depth, "heads": heads, "mlp_ratio": mlp_ratio}
    # count(W) = a W^2 + b W + c; read a, b, c off three evaluations instead of restating the sum.
    c = plain_transformer_params(**args, width=0)
    b_plus_a = plain_transformer_params(**args, width=1) - c
    a = (plain_transformer_params(**args, width=2) - c - 2 * b_plus_a) / 2
    b = b_plus_a - a
    root = (-b + math.sqrt(b * b + 4 * a * max(params_target - c, 0))) / (2 * a)
    below = max(heads, math.floor(root / heads) * heads)
    width = min((below, below + heads), key=lambda w: abs(plain_transformer_params(**args, width=w) - params_target))
    return {**args, "width": width}
