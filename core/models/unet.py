"""U-Net baselines (1D, 2D) after PDEBench's published peer.

Legend: B batch, I = C * initial_step input channels, O output channels (C), X, Y grid points,
F = ``init_features``.

Written from the facts of pdebench/PDEBench ``pdebench/models/unet/unet.py`` (itself after
mateuszbuda/brain-segmentation-pytorch): four encoder levels of ``F, 2F, 4F, 8F`` channels and a
``16F`` bottleneck; each block is twice ``conv3 (no bias) -> BatchNorm -> Tanh`` with zero
padding; 2x max-pooling on the way down, 2x transposed convolutions (kernel 2, stride 2) on the
way up, the encoder's output concatenated to the upsampled one at each level (upsampled first),
and a 1x1 convolution (with bias) to the output channels. PDEBench's configs use F = 32.

Differences, on purpose:
- a grid whose size is not a multiple of 16 (four halvings) is padded periodically at the far
  end of each axis up to the next multiple and the output cropped back; PDEBench's U-Net needs
  the multiple. Periodic, because most PDEBench tasks are periodic; the padded points are never
  scored;
- constructor arguments are plain JSON values and the class registers itself as a peer
  (``core.models.registry``), as our FNO does.
Like PDEBench's, a BatchNorm in training mode needs more than one value per channel: a batch of
one on a grid of 16 (bottleneck of one point) fails in ``train()`` mode, as it does there.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from core.models.registry import register

__all__ = ["LEVELS", "UNet1d", "UNet2d", "pad_periodic"]

LEVELS = 4
"""Encoder levels (max-pool halvings) between the input and the bottleneck (PDEBench)."""


def pad_periodic(u: Tensor, multiple: int, ndim: int) -> Tensor:
    """Pad the last ``ndim`` axes at their far end, periodically, up to a multiple of ``multiple``.

    Takes ``u`` of shape ``[..., *S]``; returns ``[..., *S']`` with ``S'_i = ceil(S_i / multiple) *
    multiple`` (``u`` itself when nothing is needed). Wraps as often as needed, so it works for an
    axis shorter than the pad too (``F.pad(mode="circular")`` refuses a pad longer than the axis).
    """
    for axis in range(u.ndim - ndim, u.ndim):
        n = u.shape[axis]
        extra = -n % multiple
        if extra:
            index = torch.arange(n + extra, device=u.device) % n
            u = u.index_select(axis, index)
    return u


def _block(conv, norm, in_channels: int, features: int) -> nn.Sequential:
    """Two ``conv3 -> norm -> tanh`` (PDEBench's ``_block``). [B, in, *S] -> [B, features, *S]."""
    return nn.Sequential(
        conv(in_channels, features, kernel_size=3, padding=1, bias=False), norm(features), nn.Tanh(),
        conv(features, features, kernel_size=3, padding=1, bias=False), norm(features), nn.Tanh(),
    )


class _UNet(nn.Module):
    """Shared body of UNet1d/UNet2d; ``ndim`` spatial axes; layers are the ``ndim``-D torch ones."""

    ndim: int

    def __init__(self, in_channels: int, out_channels: int, init_features: int, conv, norm, pool, up):
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels),
                            ("init_features", init_features)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        self.in_channels, self.out_channels = in_channels, out_channels
        widths = [init_features * 2**level for level in range(LEVELS + 1)]  # F, 2F, 4F, 8F, 16F
        self.encoders = nn.ModuleList(
            _block(conv, norm, c_in, c_out) for c_in, c_out in zip([in_channels, *widths[:-2]], widths[:-1]))
        self.pool = pool(kernel_size=2, stride=2)
        self.bottleneck = _block(conv, norm, widths[-2], widths[-1])
        # Decoder levels from the deepest up: upsample 2w -> w, concatenate the skip (w), block 2w -> w.
        self.upconvs = nn.ModuleList(up(2 * w, w, kernel_size=2, stride=2) for w in reversed(widths[:-1]))
        self.decoders = nn.ModuleList(_block(conv, norm, 2 * w, w) for w in reversed(widths[:-1]))
        self.head = conv(widths[0], out_channels, kernel_size=1)

    def forward(self, u: Tensor) -> Tensor:
        """Next frame from the stacked input frames.

        Args:
            u: ``[B, I, *S]`` (I = ``in_channels``; for an autoregressive peer the last
                ``initial_step`` frames stacked time-major on channels, as the FNO takes them).

        Returns:
            ``[B, O, *S]`` (O = ``out_channels``).
        """
        if u.ndim != 2 + self.ndim or u.shape[1] != self.in_channels:
            raise ValueError(f"expected u of shape [B, {self.in_channels}, {', '.join('XY'[:self.ndim])}], "
                             f"got {tuple(u.shape)}")
        spatial = tuple(u.shape[2:])
        h = pad_periodic(u, 2**LEVELS, self.ndim)
        skips = []
        for encoder in self.encoders:
            h = encoder(h)
            skips.append(h)
            h = self.pool(h)
        h = self.bottleneck(h)
        for upconv, decoder, skip in zip(self.upconvs, self.decoders, reversed(skips)):
            h = decoder(torch.cat([upconv(h), skip], dim=1))
        return self.head(h)[(..., *[slice(0, n) for n in spatial])]


@register("peer", "unet1d")
class UNet1d(_UNet):
    """1D U-Net: ``[B, in_channels, X] -> [B, out_channels, X]`` (see ``_UNet.forward``).

    Args:
        in_channels: input channels, C * initial_step for the autoregressive peer (PDEBench passes
            ``num_channels * initial_step``).
        out_channels: output channels C.
        init_features: channels of the first level, doubled at each level below (PDEBench: 32).
    """

    ndim = 1

    def __init__(self, in_channels: int, out_channels: int = 1, init_features: int = 32):
        super().__init__(in_channels, out_channels, init_features, nn.Conv1d, nn.BatchNorm1d, nn.MaxPool1d,
                         nn.ConvTranspose1d)


@register("peer", "unet2d")
class UNet2d(_UNet):
    """2D U-Net: ``[B, in_channels, X, Y] -> [B, out_channels, X, Y]``; arguments as `UNet1d`."""

    ndim = 2

    def __init__(self, in_channels: int, out_channels: int = 1, init_features: int = 32):
        super().__init__(in_channels, out_channels, init_features, nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d,
                         nn.ConvTranspose2d)
