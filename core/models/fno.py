"""Fourier Neural Operator baselines (1D, 2D) after PDEBench's published set-up.

Legend: B batch, C field channels, I = C * in_steps input channels, X, Y grid points,
K kept Fourier modes, W width (hidden channels), G grid coordinates (1 or 2).

Written from the facts of pdebench/PDEBench ``pdebench/models/fno/fno.py`` (itself after
Zongyi Li's FNO): the last ``in_steps`` frames stacked on channels plus the grid
coordinate(s) are lifted pointwise to ``width`` (fc0), pass 4 Fourier layers
``gelu(K u + W u)`` (spectral conv + 1x1 conv, no GELU after the last), then a pointwise
projection ``width -> 128 -> C`` with a GELU between (fc1, fc2). The domain is padded by
2 points at the far end before the Fourier layers and cropped after ("non-periodic"
padding, as PDEBench does for every task). Spectral weights start as
``uniform[0, 1) / (W * W)`` in both real and imaginary part, as in PDEBench.

Differences, on purpose:
- channel-first layout (``[B, I, X]``), so the pointwise layers are 1x1 convolutions;
- the time-major stacking is kept: input channel ``t * C + c`` holds frame ``t``,
  channel ``c`` (PDEBench reshapes ``[..., t, v] -> [..., t * v]``);
- the grid defaults to cell centres of [0, 1] (PDEBench's ``x-coordinate``); pass ``grid``
  for other coordinates;
- spectral weights are stored as real ``[..., 2]`` tensors and viewed as complex in
  ``forward`` (same arithmetic; keeps optimizers and sharding on real parameters);
- a grid too coarse for ``modes`` keeps the modes it has instead of failing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.models.registry import register

__all__ = ["FNO1d", "FNO2d", "SpectralConv1d", "SpectralConv2d", "PADDING", "PROJECTION"]

PADDING = 2
"""Points appended at the end of each spatial axis before the Fourier layers (PDEBench)."""
PROJECTION = 128
"""Hidden size of the projection fc1 -> fc2 (PDEBench)."""


def _spectral_weight(*shape: int) -> nn.Parameter:
    """Real view ``[*shape, 2]`` of a complex weight, uniform[0, 1/(in*out)) per part."""
    w = nn.Parameter(torch.empty(*shape, 2))
    torch.nn.init.uniform_(w, 0.0, 1.0 / (shape[0] * shape[1]))
    return w


def _fft_dtype(u: Tensor) -> Tensor:
    """Half precision (autocast) goes up to fp32: cuFFT half needs power-of-two sizes."""
    return u if u.dtype in (torch.float32, torch.float64) else u.float()


class SpectralConv1d(nn.Module):
    """Multiply the lowest ``modes`` rfft coefficients by learned complex matrices. [B, Ci, X] -> [B, Co, X]."""

    def __init__(self, in_channels: int, out_channels: int, modes: int):
        super().__init__()
        if modes < 1:
            raise ValueError(f"modes={modes} must be >= 1")
        self.modes = modes
        self.out_channels = out_channels
        self.weight = _spectral_weight(in_channels, out_channels, modes)

    def forward(self, u_BCX: Tensor) -> Tensor:
        n = u_BCX.shape[-1]
        f_BCK = torch.fft.rfft(_fft_dtype(u_BCX))
        k = min(self.modes, f_BCK.shape[-1])
        w = torch.view_as_complex(self.weight).to(f_BCK.dtype)[..., :k]
        out = f_BCK.new_zeros(u_BCX.shape[0], self.out_channels, f_BCK.shape[-1])
        out[..., :k] = torch.einsum("bik,iok->bok", f_BCK[..., :k], w)
        return torch.fft.irfft(out, n=n).to(u_BCX.dtype)


class SpectralConv2d(nn.Module):
    """2D version: ``modes1`` lowest positive and negative rows, ``modes2`` lowest rfft columns.

    [B, Ci, X, Y] -> [B, Co, X, Y]. As PDEBench, the positive (``weight1``) and negative
    (``weight2``) first-axis frequencies have their own weights; the rfft axis has no
    negative half. ``modes1`` is capped at ``X // 2`` so the two blocks never overlap.
    """

    def __init__(self, in_channels: int, out_channels: int, modes1: int, modes2: int):
        super().__init__()
        if modes1 < 1 or modes2 < 1:
            raise ValueError(f"modes1={modes1}, modes2={modes2} must be >= 1")
        self.modes1, self.modes2 = modes1, modes2
        self.out_channels = out_channels
        self.weight1 = _spectral_weight(in_channels, out_channels, modes1, modes2)
        self.weight2 = _spectral_weight(in_channels, out_channels, modes1, modes2)

    def forward(self, u_BCXY: Tensor) -> Tensor:
        nx, ny = u_BCXY.shape[-2:]
        f = torch.fft.rfft2(_fft_dtype(u_BCXY))
        k1, k2 = min(self.modes1, nx // 2), min(self.modes2, f.shape[-1])
        out = f.new_zeros(u_BCXY.shape[0], self.out_channels, nx, f.shape[-1])
        if k1 > 0:
            w1 = torch.view_as_complex(self.weight1).to(f.dtype)[:, :, :k1, :k2]
            w2 = torch.view_as_complex(self.weight2).to(f.dtype)[:, :, :k1, :k2]
            out[..., :k1, :k2] = torch.einsum("bixy,ioxy->boxy", f[..., :k1, :k2], w1)
            out[..., -k1:, :k2] = torch.einsum("bixy,ioxy->boxy", f[..., -k1:, :k2], w2)
        else:  # X == 1: only the zero frequency exists along the first axis
            w1 = torch.view_as_complex(self.weight1).to(f.dtype)[:, :, :1, :k2]
            out[..., :1, :k2] = torch.einsum("bixy,ioxy->boxy", f[..., :1, :k2], w1)
        return torch.fft.irfft2(out, s=(nx, ny)).to(u_BCXY.dtype)


def _cell_centre_grid(spatial: tuple[int, ...], like: Tensor) -> Tensor:
    """Cell centres of [0, 1]^d as channels. -> [1, d, *spatial]."""
    axes = [(torch.arange(n, device=like.device, dtype=like.dtype) + 0.5) / n for n in spatial]
    return torch.stack(torch.meshgrid(*axes, indexing="ij")).unsqueeze(0)


class _FNO(nn.Module):
    """Shared body of FNO1d/FNO2d; ``ndim`` spatial axes."""

    ndim: int

    def __init__(self, in_steps: int, channels: int, width: int, layers: int, conv, spectral):
        super().__init__()
        for name, value in (("in_steps", in_steps), ("channels", channels), ("width", width), ("layers", layers)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        self.in_steps, self.channels, self.width = in_steps, channels, width
        self.fc0 = conv(in_steps * channels + self.ndim, width, 1)
        self.spectral = nn.ModuleList(spectral() for _ in range(layers))
        self.pointwise = nn.ModuleList(conv(width, width, 1) for _ in range(layers))
        self.fc1 = conv(width, PROJECTION, 1)
        self.fc2 = conv(PROJECTION, channels, 1)

    def forward(self, u: Tensor, grid: Tensor | None = None) -> Tensor:
        """Next frame from the last ``in_steps`` frames.

        Args:
            u: ``[B, C * in_steps, *S]``, channel ``t * C + c`` = frame t (oldest first), channel c.
            grid: ``[B or 1, ndim, *S]`` coordinates; default: cell centres of [0, 1]^ndim.

        Returns:
            ``[B, C, *S]``.
        """
        expected = self.in_steps * self.channels
        if u.ndim != 2 + self.ndim or u.shape[1] != expected:
            raise ValueError(f"expected u of shape [B, {expected}, {', '.join('XY'[:self.ndim])}], "
                             f"got {tuple(u.shape)}")
        spatial = tuple(u.shape[2:])
        if grid is None:
            grid = _cell_centre_grid(spatial, u)
        elif grid.ndim != u.ndim or grid.shape[1] != self.ndim or tuple(grid.shape[2:]) != spatial:
            raise ValueError(f"grid {tuple(grid.shape)} does not match u {tuple(u.shape)}")
        h = self.fc0(torch.cat([u, grid.to(u.dtype).expand(u.shape[0], -1, *spatial)], dim=1))
        # F.pad lists (left, right) pairs from the last axis backwards.
        h = F.pad(h, [0, PADDING] * self.ndim)
        last = len(self.spectral) - 1
        for i, (k, w) in enumerate(zip(self.spectral, self.pointwise)):
            h = k(h) + w(h)
            if i < last:  # PDEBench applies no activation after the last Fourier layer
                h = F.gelu(h)
        h = h[(..., *[slice(0, n) for n in spatial])]
        return self.fc2(F.gelu(self.fc1(h)))


@register("peer", "fno1d")
class FNO1d(_FNO):
    """1D FNO: ``[B, C * in_steps, X] -> [B, C, X]`` (see ``_FNO.forward``).

    Args:
        in_steps: frames given to the model (PDEBench ``initial_step``, 10 in its configs).
        channels: field channels C (PDEBench ``num_channels``).
        modes: Fourier modes kept (PDEBench configs: 12).
        width: hidden channels (PDEBench configs: 20).
        layers: Fourier layers (PDEBench: 4).
    """

    ndim = 1

    def __init__(self, in_steps: int, channels: int = 1, modes: int = 12, width: int = 20, layers: int = 4):
        super().__init__(in_steps, channels, width, layers, nn.Conv1d,
                         lambda: SpectralConv1d(width, width, modes))


@register("peer", "fno2d")
class FNO2d(_FNO):
    """2D FNO: ``[B, C * in_steps, X, Y] -> [B, C, X, Y]``; ``modes`` per axis, else as `FNO1d`."""

    ndim = 2

    def __init__(self, in_steps: int, channels: int = 1, modes: int = 12, width: int = 20, layers: int = 4):
        super().__init__(in_steps, channels, width, layers, nn.Conv2d,
                         lambda: SpectralConv2d(width, width, modes, modes))
