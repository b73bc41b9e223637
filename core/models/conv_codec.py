# long file: one codec: encoder, decoder and the fit share the linear path and the token layout
"""Convolutional codec: fields on uniform grids <-> a latent grid at a chosen compression rate, as tokens.

Legend: B batch, C field channels, S spatial axes (X / X, Y / X, Y, Z), d spatial dimension,
P patch (downsampling factor per axis), D latent channels, H hidden width, L tokens (latent
cells), K = C * P^d numbers per patch, N fitting frames.

Rate: a field of C channels on S becomes prod(S / P) cells of D numbers, C * P^d / D times
fewer numbers (e.g. C = 4, P = 4 in 2D, D = 4: 16x).

The codec is a linear path plus a learned correction, summed (as in the grid codec):
  * linear: a per-channel normalisation (``mean``, ``scale`` buffers), then one of two linear
    maps, fitted by ``fit_linear`` from training frames; their weights are buffers (training
    leaves them alone and learns the correction):
    - ``linear="local"``: a patch-wise map (a convolution with kernel = stride = P) and its
      transpose convolution, the PCA of the normalised patches (exact when D >= K). Each latent
      cell sees its own patch only, so it cannot use what neighbouring patches share (a
      velocity field that its vorticity determines, a smooth field's curvature);
    - ``linear="global"``: the PCA of whole normalised fields (M = L * D components, the best
      linear code of the latent's size), written in the orthonormal basis closest to the local
      code (orthogonal Procrustes: Q = polar(E V) for the local encoder E and the PCA basis V),
      so latent cell p, channel j still reads mostly patch p's j-th component (on 2D
      Navier-Stokes the two latents correlate at 0.99) while the reconstruction is PCA's. Dense
      maps [M, C * prod(S)]: one training grid (``grid``) per codec, at most `GLOBAL_MAX_NUMBERS`
      numbers per field. ``fit_linear`` takes the principal components from the (C * prod(S))^2
      covariance up to `GLOBAL_COVARIANCE_NUMBERS` numbers, and above it from the N x N Gram
      matrix of the N fitting frames (the thin SVD of the data matrix: the same components, at the
      memory of the frames themselves; it needs N >= M);
  * learned: a convolutional encoder (stem, then per stage residual blocks and a strided
    downsampling, the shape DC-AE and LOLA use) added to the linear latent, and its mirror
    image decoder added to the linear reconstruction (in normalised units). Their last layers
    start at zero, so an untrained codec is its linear path exactly and training starts from
    PCA's accuracy.
Tokens: the latent grid [B, D, *S/P] becomes z [B, L, D], one token per latent cell:
  1D: left to right;
  2D / 3D with a square / cubic latent grid of power-of-two side: Morton (Z) order, the grid
      codec's (``core.models.layers.morton_permutation``), so the windowed operator steps it
      unchanged;
  any other latent grid (non-square, non-power-of-two): row-major. A transformer operator
      takes it as is; the windowed PDE-Transformer needs the Morton case.
Grids must be divisible by P along every axis (a ValueError names the size and the patch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.models.autoencoder import Autoencoder
from core.models.registry import register

NDIMS = (1, 2, 3)
"""Spatial dimensions a conv codec may serve (one per codec)."""
LINEAR = ("local", "global")
"""Scopes of the linear path (module docstring)."""
GLOBAL_COVARIANCE_NUMBERS = 12288
"""The largest field (C * prod(S) numbers) whose global path is fitted from its covariance (3 channels
on 64 x 64): that float64 matrix is then 1.1 GiB, and the fit holds about five such matrices at its
peak (the moments, the covariance, eigh's vectors and workspace). Larger fields go through the Gram
matrix of the fitting frames (`_principal_fields`)."""
GLOBAL_MAX_NUMBERS = 3 * 128 * 128
"""The largest field a global linear path takes (3 channels on 128 x 128): its two dense maps hold
M * C * prod(S) numbers each (at 64x, 151 MiB apiece in float32), and its fit the N fitting frames
(8192 of them: 1.5 GiB in float32) and their N x N Gram matrix."""

_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_CONV_F = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T_F = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def compression_rate(channels: int, ndim: int, patch: int, latent_channels: int) -> float:
    """Numbers of the field per number of the latent: C * P^d / D."""
    return channels * patch ** ndim / latent_channels


def stage_factors(patch: int, stages: int | None) -> list[int]:
    """Downsampling factor of each stage, largest first; their product is ``patch``.

    The prime factors of ``patch`` are dealt to ``stages`` stages, each to the one with the
    smallest product so far (patch 8, 2 stages: [4, 2]). ``None``: one stage per prime
    factor (patch 8: [2, 2, 2]). More stages than prime factors is a ValueError.
    """
    primes, n, p = [], patch, 2
    while n > 1:
        while n % p == 0:
            primes.append(p)
            n //= p
        p += 1
    stages = len(primes) if stages is None else stages
    if not 0 <= stages <= len(primes):
        raise ValueError(f"patch {patch} splits into at most {len(primes)} downsampling stages "
                         f"(its prime factors {primes}), got stages={stages}")
    factors = [1] * stages
    for prime in sorted(primes, reverse=True):
        factors[factors.index(min(factors))] *= prime
    return sorted(factors, reverse=True)


def latent_shape(grid_shape: tuple[int, ...], patch: int) -> tuple[int, ...]:
    """Latent cells per axis of a field on ``grid_shape``: each size divided by ``patch``.
    A size that ``patch`` does not divide is a ValueError naming both."""
    for axis, n in enumerate(grid_shape):
        if n < 1 or n % patch:
            raise ValueError(f"grid size {n} (axis {axis} of grid {tuple(grid_shape)}) is not a positive "
                             f"multiple of the codec's patch {patch}")
    return tuple(n // patch for n in grid_shape)


def latent_tokens(grid_shape: tuple[int, ...], patch: int) -> int:
    """Tokens L of a field on ``grid_shape``: the number of latent cells (a config builder's L)."""
    return math.prod(latent_shape(grid_shape, patch))


def _morton_levels(cells: tuple[int, ...]) -> int:
    """Bits per axis of a latent grid listed in Morton order, or 0 for row-major order (1D, a
    non-cubic or non-power-of-two grid, or a single cell: the two orders then agree or Morton
    is undefined)."""
    side = cells[0]
    if len(cells) < 2 or any(n != side for n in cells) or side < 2 or side & (side - 1):
        return 0
    return side.bit_length() - 1


def grid_to_tokens(z_BDS: Tensor) -> Tensor:
    """Latent grid -> tokens. z_BDS [B, D, *cells] -> z_BLD [B, L, D] in the codec's token order.

    Morton order is built one bit level at a time: each level splits every axis in halves and
    lists the 2^d sub-blocks (first axis most significant) after the blocks already listed.
    This is ``flatten(2)[:, :, morton_permutation(side, d)]`` without an index tensor to
    place on the device, and with at most 3 + 2d dims at a time (one reshape over all bits
    would need 2 + d * bits dims, past what some kernels take for large grids).
    """
    B, D, *cells = z_BDS.shape
    d, levels = len(cells), _morton_levels(tuple(cells))
    x = z_BDS.unsqueeze(2)  # [B, D, blocks listed so far, *block]
    for _ in range(levels):
        q, half = x.shape[2], x.shape[3] // 2
        x = x.reshape(B, D, q, *[v for _ in range(d) for v in (2, half)])
        x = x.permute(0, 1, 2, *[3 + 2 * a for a in range(d)], *[4 + 2 * a for a in range(d)])
        x = x.reshape(B, D, q * 2 ** d, *[half] * d)
    return x.reshape(B, D, -1).transpose(1, 2)


def tokens_to_grid(z_BLD: Tensor, cells: tuple[int, ...]) -> Tensor:
    """Tokens -> latent grid, the inverse of ``grid_to_tokens``. z_BLD [B, L, D] -> [B, D, *cells]."""
    B, L, D = z_BLD.shape
    d, levels = len(cells), _morton_levels(tuple(cells))
    x = z_BLD.transpose(1, 2).reshape(B, D, L, *[1] * d)
    for _ in range(levels):  # finest bit first: the last d bits of the block index
        q, r = x.shape[2] // 2 ** d, x.shape[3]
        x = x.reshape(B, D, q, *[2] * d, *[r] * d)
        x = x.permute(0, 1, 2, *[v for a in range(d) for v in (3 + a, 3 + d + a)])
        x = x.reshape(B, D, q, *[2 * r] * d)
    return x.reshape(B, D, *cells)


class _ChannelNorm(nn.Module):
    """Per-channel affine normalisation ``(u - mean) / scale`` (buffers [C], set by ``fit_linear``),
    so channels of different units weigh alike in the PCA and the learned path's loss."""

    def __init__(self, channels: int, ndim: int) -> None:
        super().__init__()
        self.ndim = ndim
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("scale", torch.ones(channels))

    def _shaped(self, t: Tensor) -> Tensor:
        return t.float().reshape(-1, *[1] * self.ndim)

    def normalise(self, u_BCS: Tensor) -> Tensor:
        """u [B, C, *S] -> fp32 [B, C, *S] in normalised units."""
        return (u_BCS.float() - self._shaped(self.mean)) / self._shaped(self.scale)

    def denormalise(self, u_BCS: Tensor) -> Tensor:
        """Normalised [B, C, *S] -> fp32 field units."""
        return u_BCS.float() * self._shaped(self.scale) + self._shaped(self.mean)


class _ResBlock(nn.Module):
    """``x + conv3(SiLU(conv3(SiLU(x))))`` at constant width and size. [B, H, *S] -> [B, H, *S].

    No normalisation layer: GroupNorm's per-sample statistics would make every token depend on
    the whole field (and on its resolution), while without it a token depends on its
    neighbourhood only. Zero padding sits at the normalised field's mean.
    """

    def __init__(self, ndim: int, width: int) -> None:
        super().__init__()
        self.conv1 = _CONV[ndim](width, width, 3, padding=1)
        self.conv2 = _CONV[ndim](width, width, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(F.silu(self.conv1(F.silu(x))))


def _zero(layer: nn.Module) -> nn.Module:
    """``layer`` with weight and bias zeroed: the learned path starts as exactly nothing."""
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


class _CodecHalf(nn.Module):
    """What encoder and decoder share: sizes, the normalisation and the linear path's basis.

    ``basis`` [D, C, *P] holds the basis (row j: latent channel j's patch vector), read as a
    convolution by the encoder and as a transpose convolution by the decoder. Before
    ``fit_linear`` it is the padded identity and the normalisation is the identity.
    """

    def __init__(self, channels: int, ndim: int, patch: int, latent_channels: int, hidden: int, blocks: int,
                 stages: int | None, linear: str, grid: tuple[int, ...] | None) -> None:
        super().__init__()
        if ndim not in NDIMS:
            raise ValueError(f"ndim must be one of {NDIMS}, got {ndim}")
        if linear not in LINEAR:
            raise ValueError(f"linear must be one of {LINEAR}, got {linear!r}")
        for name, value, least in (("channels", channels, 1), ("patch", patch, 1),
                                   ("latent_channels", latent_channels, 1), ("hidden", hidden, 0),
                                   ("blocks", blocks, 0)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.channels, self.ndim, self.patch, self.latent_channels = channels, ndim, patch, latent_channels
        self.hidden, self.factors = hidden, stage_factors(patch, stages)
        self.norm = _ChannelNorm(channels, ndim)
        features = channels * patch ** ndim
        self.register_buffer("basis", torch.eye(latent_channels, features).reshape(
            latent_channels, channels, *[patch] * ndim))
        self.linear, self.grid = linear, None
        if linear == "global":
            if grid is None or len(grid) != ndim:
                raise ValueError(f"linear='global' needs the training grid ({ndim} sizes), got grid={grid}")
            self.grid = tuple(int(n) for n in grid)
            self.cells = latent_shape(self.grid, patch)
            numbers, latent = channels * math.prod(self.grid), latent_channels * math.prod(self.cells)
            if numbers > GLOBAL_MAX_NUMBERS or latent > numbers:
                raise ValueError(f"linear='global' fits fields of at most {GLOBAL_MAX_NUMBERS} numbers into a latent "
                                 f"no larger than the field; got {numbers} numbers into {latent}: use linear='local'")
            # Unfitted: zero maps (the local path's padded identity has no dense form worth building).
            self.register_buffer("field_map", torch.zeros(*self._map_shape(latent, numbers)))

    def _map_shape(self, latent: int, numbers: int) -> tuple[int, int]:
        """Shape of the global path's dense map: [M, C * prod(S)] (encoder) or its transpose (decoder)."""
        raise NotImplementedError

    def _check_grid(self, grid_shape: tuple[int, ...]) -> None:
        if self.grid is not None and tuple(grid_shape) != self.grid:
            raise ValueError(f"a codec with linear='global' reads fields on its training grid {self.grid} only, "
                             f"got {tuple(grid_shape)}")


class ConvEncoder(_CodecHalf):
    """Field -> tokens. u [B, C, *S] (every size a multiple of P) -> z_BLD [B, L, D].

    Args (as ``conv_autoencoder``): channels, ndim, patch, latent_channels, hidden (0: the
    linear path alone, no parameters), blocks, stages.
    """

    def __init__(self, channels: int, ndim: int, patch: int, latent_channels: int, hidden: int = 64,
                 blocks: int = 1, stages: int | None = None, linear: str = "local",
                 grid: tuple[int, ...] | None = None) -> None:
        super().__init__(channels, ndim, patch, latent_channels, hidden, blocks, stages, linear, grid)
        self.register_buffer("bias", torch.zeros(latent_channels))
        if linear == "global":
            self.register_buffer("field_bias", torch.zeros(self.field_map.shape[0]))
        if not hidden:
            return
        conv = _CONV[ndim]
        layers: list[nn.Module] = [conv(channels, hidden, 3, padding=1)]
        for f in self.factors:
            layers += [_ResBlock(ndim, hidden) for _ in range(blocks)]
            layers.append(conv(hidden, hidden, f, stride=f))
        layers += [_ResBlock(ndim, hidden) for _ in range(blocks)]
        layers += [nn.SiLU(), _zero(conv(hidden, latent_channels, 3, padding=1))]  # fresh encoder = linear path
        self.trunk = nn.Sequential(*layers)

    def _map_shape(self, latent: int, numbers: int) -> tuple[int, int]:
        return latent, numbers

    def forward(self, u: Tensor) -> Tensor:
        """u [B, C, *S] -> z_BLD [B, L, D] (fp32), L = prod(S / P)."""
        if u.ndim != self.ndim + 2 or u.shape[1] != self.channels:
            raise ValueError(f"encoder for {self.channels}-channel {self.ndim}D fields got shape {tuple(u.shape)}")
        cells = latent_shape(tuple(u.shape[2:]), self.patch)
        self._check_grid(tuple(u.shape[2:]))
        # The linear path in fp32 whatever the autocast dtype: bf16 would cap its exactness at ~1e-3.
        with torch.autocast(u.device.type, enabled=False):
            u_n = self.norm.normalise(u)
            if self.linear == "global":
                z = torch.addmm(self.field_bias.float(), u_n.flatten(1), self.field_map.float().T)
                z = z.reshape(u.shape[0], self.latent_channels, *cells)
            else:
                z = _CONV_F[self.ndim](u_n, self.basis.float(), self.bias.float(), stride=self.patch)
        if self.hidden:
            z = z + self.trunk(u_n).float()
        return grid_to_tokens(z)


class ConvDecoder(_CodecHalf):
    """Tokens -> field. (z_BLD [B, L, D], grid_shape) -> u [B, C, *grid_shape].

    Args: as ``ConvEncoder``.
    """

    def __init__(self, channels: int, ndim: int, patch: int, latent_channels: int, hidden: int = 64,
                 blocks: int = 1, stages: int | None = None, linear: str = "local",
                 grid: tuple[int, ...] | None = None) -> None:
        super().__init__(channels, ndim, patch, latent_channels, hidden, blocks, stages, linear, grid)
        if linear == "global":
            # Normalised units: the reconstruction is field_map @ z + mean_field.
            self.register_buffer("mean_field", torch.zeros(self.field_map.shape[0]))
        # The PCA's mean patch (normalised units), tiled over the grid: a transpose convolution's
        # bias is one number per channel, the mean patch one per channel and position in the patch.
        self.register_buffer("mean_patch", torch.zeros(channels, *[patch] * ndim))
        if not hidden:
            return
        conv, conv_t = _CONV[ndim], _CONV_T[ndim]
        layers: list[nn.Module] = [conv(latent_channels, hidden, 3, padding=1)]
        layers += [_ResBlock(ndim, hidden) for _ in range(blocks)]
        for f in reversed(self.factors):
            layers.append(conv_t(hidden, hidden, f, stride=f))
            layers += [_ResBlock(ndim, hidden) for _ in range(blocks)]
        layers += [nn.SiLU(), _zero(conv(hidden, channels, 3, padding=1))]  # fresh decoder = linear path
        self.trunk = nn.Sequential(*layers)

    def _map_shape(self, latent: int, numbers: int) -> tuple[int, int]:
        return numbers, latent

    def forward(self, z_BLD: Tensor, grid_shape: tuple[int, ...]) -> Tensor:
        """z_BLD [B, L, D], grid_shape (d sizes, multiples of P) -> u [B, C, *grid_shape] (fp32)."""
        cells = latent_shape(tuple(grid_shape), self.patch)
        if len(cells) != self.ndim or z_BLD.ndim != 3 or z_BLD.shape[1:] != (math.prod(cells), self.latent_channels):
            raise ValueError(f"decoder for {self.ndim}D grids, D={self.latent_channels}, patch {self.patch} got "
                             f"z {tuple(z_BLD.shape)} for grid {tuple(grid_shape)}")
        self._check_grid(tuple(grid_shape))
        z = tokens_to_grid(z_BLD, cells)
        with torch.autocast(z.device.type, enabled=False):  # fp32 linear path, as in the encoder
            if self.linear == "global":
                u_n = torch.addmm(self.mean_field.float(), z.float().flatten(1), self.field_map.float().T)
                u_n = u_n.reshape(z.shape[0], self.channels, *grid_shape)
            else:
                u_n = _CONV_T_F[self.ndim](z.float(), self.basis.float(), stride=self.patch)
                u_n = u_n + self.mean_patch.float().repeat(1, *cells)
        if self.hidden:
            u_n = u_n + self.trunk(z).float()
        return self.norm.denormalise(u_n)


@register("codec", "conv")
def conv_autoencoder(channels: int, ndim: int, patch: int, latent_channels: int, hidden: int = 64,
                     blocks: int = 1, stages: int | None = None, linear: str = "local",
                     grid: list[int] | tuple[int, ...] | None = None) -> Autoencoder:
    """The convolutional codec as an ``Autoencoder``, from plain JSON arguments.

    Args:
        channels: C, field channels.
        ndim: d, the spatial dimension of the fields (1, 2 or 3).
        patch: P, downsampling factor per axis (grids must be multiples of it).
        latent_channels: D, numbers per latent cell (token width); the rate is C * P^d / D.
        hidden: width of the learned trunks (0: the linear path alone, no parameters).
        blocks: residual blocks per stage (and at the latent resolution).
        stages: downsampling stages, their factors multiplying to P (``stage_factors``; None:
            one per prime factor of P).
        linear: the linear path's scope, "local" (PCA of patches) or "global" (PCA of whole
            fields in the basis closest to the local code; module docstring).
        grid: the training grid (d sizes), required by linear="global", which reads that grid only.
    Returns:
        ``Autoencoder(ConvEncoder, ConvDecoder)`` with the linear path unfitted (``fit_linear``
        fits it; weight files carry it).
    """
    kw = dict(hidden=hidden, blocks=blocks, stages=stages, linear=linear, grid=None if grid is None else tuple(grid))
    return Autoencoder(ConvEncoder(channels, ndim, patch, latent_channels, **kw),
                       ConvDecoder(channels, ndim, patch, latent_channels, **kw))


def _patches(u_NCS: Tensor, patch: int) -> Tensor:
    """Every patch of every frame as a row, channel-major then row-major inside the patch (the
    layout of a convolution weight's [C, *P]). u [N, C, *S] -> [N * prod(S / P), K]."""
    N, C, *grid = u_NCS.shape
    cells = latent_shape(tuple(grid), patch)
    d = len(grid)
    x = u_NCS.reshape(N, C, *[v for n in cells for v in (n, patch)])
    x = x.permute(0, *[2 + 2 * a for a in range(d)], 1, *[3 + 2 * a for a in range(d)])
    return x.reshape(-1, C * patch ** d)


def _moments(enc: ConvEncoder, u_NCS: Tensor | Iterable[Tensor]) -> tuple:
    """One pass over the frames: (shift [C], sum and sum of outer products of the patch vectors
    about the shift, their count, and, for a global path, the sum of whole fields and (the fields
    themselves as float32 rows above `GLOBAL_COVARIANCE_NUMBERS` numbers, else None; else the sum
    of their outer products); else 0, (None, 0)), float64 but the kept fields. A frame-less input
    is a ValueError."""
    C = enc.channels
    shift, total, outer, n = None, 0, 0, 0
    field_total, field_outer, kept = 0, 0, []
    for u in ([u_NCS] if isinstance(u_NCS, Tensor) else u_NCS):
        u = u.double()
        if shift is None:
            # Moments about a rough mean (the first batch's), so a field far from zero
            # (pressure ~1e5 +- 1) loses no digits in E[vv] - E[v]E[v].
            shift = u.transpose(0, 1).reshape(C, -1).mean(1)
        centred = u - shift.reshape(1, C, *[1] * enc.ndim)
        v = _patches(centred, enc.patch)
        total, outer, n = total + v.sum(0), outer + v.T @ v, n + v.shape[0]
        if enc.linear == "global":
            enc._check_grid(tuple(u.shape[2:]))
            flat = centred.flatten(1)
            field_total = field_total + flat.sum(0)
            if flat.shape[1] <= GLOBAL_COVARIANCE_NUMBERS:
                field_outer = field_outer + flat.T @ flat
            else:  # the frames themselves (float32, about the shift): their Gram matrix replaces the covariance
                kept.append(flat.float())
    if n == 0:
        raise ValueError("fit_linear needs at least one frame")
    return shift, total, outer, n, field_total, (torch.cat(kept) if kept else None, field_outer)


@torch.no_grad()
def fit_linear(codec: Autoencoder, u_NCS: Tensor | Iterable[Tensor]) -> float:
    """Fit the linear path of a conv codec to training frames, in place; returns the fraction
    of the normalised patches' variance the latent keeps (1.0 when D >= K).

    ``u_NCS``: frames [N, C, *S], or an iterable of such batches (one pass; any grid sizes
    that are multiples of P). Sets, in both halves: the per-channel ``mean`` and ``scale``
    (the channel's standard deviation over all frames and points; 1 for a constant channel),
    and the basis: the top-D principal directions of the normalised patch vectors (eigh of
    their covariance in float64; each direction's largest entry made positive, so the fit
    depends on the frames only), the mean patch as the bias. When D >= K the basis is the
    padded identity, which makes encode/decode exact. K x K float64 must fit in memory
    (K = C * P^d: 4 channels, P = 8 in 3D is 2048).
    """
    enc, dec = codec.encoder, codec.decoder
    C, P, D = enc.channels, enc.patch, enc.latent_channels
    K = C * P ** enc.ndim
    shift, total, outer, n, field_total, field_fields = _moments(enc, u_NCS)
    mean_v, second_v = total / n, outer / n                       # about the shift; entry k is channel k // P^d
    channel_of = torch.arange(K, device=mean_v.device) // (K // C)
    mean_c = mean_v.reshape(C, -1).mean(1)
    std_c = (second_v.diagonal().reshape(C, -1).mean(1) - mean_c ** 2).clamp_min(0).sqrt()
    # A spread below float32 rounding of the channel's level is no spread: a constant channel
    # gets scale 1 rather than 1 / rounding noise.
    scale_c = torch.where(std_c > 1e-6 * (mean_c + shift).abs(), std_c, torch.ones_like(std_c))
    s_k = scale_c[channel_of]
    cov = (second_v - torch.outer(mean_v, mean_v)) / torch.outer(s_k, s_k)
    mean_patch = (mean_v - mean_c[channel_of]) / s_k              # normalised units
    if D >= K:
        basis_KD = torch.eye(K, D, dtype=torch.float64, device=cov.device)
        captured = 1.0
    else:
        values, vectors = torch.linalg.eigh(cov)                  # ascending
        basis_KD = vectors[:, -D:].flip(-1)
        signs = basis_KD.gather(0, basis_KD.abs().argmax(0, keepdim=True)).sign()
        basis_KD = basis_KD * signs
        captured = float(values[-D:].sum() / values.clamp_min(0).sum().clamp_min(1e-300))
    basis = basis_KD.T.reshape(enc.basis.shape)
    for half in (enc, dec):
        half.norm.mean.copy_(mean_c + shift)
        half.norm.scale.copy_(scale_c)
        half.basis.copy_(basis)
    enc.bias.copy_(-(basis_KD.T @ mean_patch))
    dec.mean_patch.copy_(mean_patch.reshape(dec.mean_patch.shape))
    if enc.linear == "global":
        frames = n // math.prod(enc.cells)
        kept, field_outer = field_fields
        second = None if kept is not None else field_outer / frames
        captured = _fit_global(codec, field_total / frames, mean_c, scale_c, second=second, frames=kept)
    return captured


def _principal_fields(mean_u: Tensor, s: Tensor, M: int, *, second: Tensor | None = None,
                      frames: Tensor | None = None) -> tuple[Tensor, float]:
    """The top M principal directions [N', M] (any order and signs) of the normalised fields and the
    fraction of their variance those keep, from the moments about the shift: the second moment
    ``second`` [N', N'] (float64), or else the ``frames`` themselves [N, N'] (float32, N frames).
    From frames: the eigenvectors of the Gram matrix X X^T / N of the normalised, centred frames X
    give the covariance's, X^T U / sqrt(N lambda), with the same eigenvalues (the thin SVD of X)."""
    if second is not None:
        cov = (second - torch.outer(mean_u, mean_u)) / torch.outer(s, s)
        values, vectors = torch.linalg.eigh(cov)                              # ascending
        return vectors[:, -M:], _kept(values, M)
    n = frames.shape[0]
    if n < M:
        raise ValueError(f"the global linear path keeps {M} components but was fitted to {n} frames: fit it "
                         f"to at least {M} frames (autoencoder.fit_frames) or keep fewer latent numbers")
    gram = torch.zeros(n, n, dtype=torch.float64, device=frames.device)
    for _, x in _normalised_blocks(frames, mean_u, s):
        gram += x @ x.T
    values, vectors = torch.linalg.eigh(gram / n)                              # ascending
    top, lam = vectors[:, -M:], values[-M:].clamp_min(1e-300)
    V = torch.empty(frames.shape[1], M, dtype=torch.float64, device=frames.device)
    for cols, x in _normalised_blocks(frames, mean_u, s):
        V[cols] = x.T @ top / (n * lam).sqrt()
    return V, _kept(values, M)


def _kept(values: Tensor, M: int) -> float:
    """The fraction of the variance the top M of the ascending eigenvalues `values` hold."""
    return float(values[-M:].clamp_min(0).sum() / values.clamp_min(0).sum().clamp_min(1e-300))


def _normalised_blocks(frames: Tensor, mean_u: Tensor, s: Tensor):
    """(columns, the frames' normalised, centred float64 values there) per block of columns: a block
    of at most 2^24 numbers (128 MiB), so the frames are never held in float64 whole."""
    chunk = max(1, 2 ** 24 // frames.shape[0])
    for j in range(0, frames.shape[1], chunk):
        cols = slice(j, j + chunk)
        yield cols, (frames[:, cols].double() - mean_u[cols]) / s[cols]


def _fit_global(codec: Autoencoder, mean_u: Tensor, mean_c: Tensor, scale_c: Tensor, *,
                second: Tensor | None = None, frames: Tensor | None = None) -> float:
    """The global linear path from whole-field moments about the shift (float64 ``mean_u`` [N'], N' =
    C * prod(S); the second moment ``second`` or the ``frames``, `_principal_fields`) and the
    fitted normalisation (about the shift); the local basis must be fitted already. Returns the
    fraction of the normalised fields' variance that the M = L * D principal components keep."""
    enc, dec = codec.encoder, codec.decoder
    C, numbers = enc.channels, mean_u.numel()
    s = scale_c.repeat_interleave(numbers // C)
    mean_field = (mean_u - mean_c.repeat_interleave(numbers // C)) / s       # normalised units
    M = enc.field_map.shape[0]
    V, captured = _principal_fields(mean_u, s, M, second=second, frames=frames)  # [N', M]
    # E V: the local encoder (no bias: V's columns are deviations) applied to each principal field.
    local = _CONV_F[enc.ndim](V.T.reshape(M, C, *enc.grid), enc.basis.double(), stride=enc.patch)
    U_, _, Wh = torch.linalg.svd(local.reshape(M, M).T)                      # E V = U_ S Wh
    Q = U_ @ Wh   # the orthogonal matrix closest to E V (its polar factor): independent of V's basis
    field_map = Q @ V.T                                                       # [M, N'], orthonormal rows
    # The offset makes the mean latent the local code's of the mean field: z - z_local has mean 0.
    local_mean = _CONV_F[enc.ndim](mean_field.reshape(1, C, *enc.grid), enc.basis.double(), enc.bias.double(),
                                   stride=enc.patch).flatten()
    enc.field_map.copy_(field_map)
    enc.field_bias.copy_(local_mean - field_map @ mean_field)
    dec.field_map.copy_(field_map.T)
    dec.mean_field.copy_(mean_field - field_map.T @ local_mean)
    return captured
