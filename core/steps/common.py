"""Shared pieces of the step functions: per-sample noise, the EDM-weighted refiner loss and sampler.

Legend: B batch, L tokens, D latent dim, K noise levels, N elements per sample.

Per-sample randomness (why not ``torch.randn(..., generator=g)``): a step's loss must not
change when the batch is permuted or split into micro-batches, but noise drawn in batch
order depends on each sample's position. So a training step draws only a *seed* from the
generator and derives every random number of sample ``b`` from a counter-based hash of
``(seed, stream, sample key b, element index)``. The sample key is ``sample_id`` plus,
when the batch has it, the pair's time index ``t`` (pairs of one trajectory share a
``sample_id``). The hash is integer arithmetic kept below 2**63 (32-bit words inside
int64), so it is exact and identical on every device; the normals come from Box-Muller.

Training steps *peek* at the generator (they copy its state and draw from the copy): the
generator is a key, as in equinox, and a step never advances it. The training loop makes
one generator per optimizer step and hands the same object to every micro-step, which is
exactly what keeps gradient accumulation exact. Inference helpers (``refiner_sample``)
draw from the generator directly and do advance it, so successive rollout steps differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF

# Streams: one per kind of random number inside a step, so they never share counters.
STREAM_INPUT_NOISE = 1
STREAM_LEVEL = 2
STREAM_EPS = 3
STREAM_SIGMA = 4
STREAM_INFERENCE = 1000
"""First stream of ``SampleNoise``: its k-th draw uses stream ``STREAM_INFERENCE + k``."""


# ----------------------------------------------------------------------------- hashing


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for ``x`` in [0, 2**32) without int64 overflow (16-bit halves)."""
    lo = (x & _MASK16) * c
    hi = ((x >> 16) * c) & _MASK16
    return (lo + (hi << 16)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """Chris Wellons' "lowbias32" integer finaliser on 32-bit words held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _hash_words(*words: Tensor | int) -> Tensor:
    """Sponge-style hash of a sequence of 32-bit words (tensors broadcast)."""
    h = torch.as_tensor(0x9E3779B9, dtype=torch.int64)
    for w in words:
        h = _mix32(h ^ (torch.as_tensor(w, dtype=torch.int64) & _MASK32))
    return h


def step_seed(generator: torch.Generator) -> Tensor:
    """Two 32-bit seed words drawn from a *copy* of ``generator`` (it is not advanced). -> int64 [2].

    The words stay on the generator's device; ``sample_keys`` moves them to the batch.
    """
    peek = torch.Generator(device=generator.device)
    peek.set_state(generator.get_state())
    return torch.randint(0, 2**32, (2,), generator=peek, device=generator.device, dtype=torch.int64)


def sample_keys(seed: Tensor, batch: TensorDictBase) -> tuple[Tensor, Tensor]:
    """Two independent 32-bit keys per sample from ``(seed, sample_id[, t])``. -> int64 [B] x 2.

    Raises ``KeyError`` naming ``sample_id`` when the batch has none: noise drawn in batch
    order would break the permutation and micro-batch invariance of the loss.
    """
    if "sample_id" not in batch.keys():
        raise KeyError("batch needs an int64 'sample_id' [B] (stable id of each sample) for per-sample noise")
    sid = batch["sample_id"].to(torch.int64)
    s = seed.to(sid.device, non_blocking=True)  # a blocking host-to-device copy would sync the GPU
    t = batch["t"].to(torch.int64) if "t" in batch.keys() else torch.zeros_like(sid)
    words = (sid, sid >> 32, t, t >> 32)
    k1 = _hash_words(s[0], s[1], *words)
    k2 = _hash_words(s[1], 0x68E31DA4, *words[::-1], s[0])
    return k1, k2


def _bits(keys: tuple[Tensor, Tensor], stream: int, count: int) -> Tensor:
    """``count`` pseudo-random 32-bit words per sample. -> int64 [B, count]."""
    k1, k2 = (k[:, None] for k in keys)
    c = torch.arange(count, device=k1.device, dtype=torch.int64)[None, :]
    h = _mix32(_mix32(c ^ _hash_words(k1, stream)) ^ k2)
    return _mix32(h ^ k1)


def _uniform24(bits: Tensor) -> Tensor:
    """Uniforms in (0, 1) from the top 24 bits of 32-bit words (exact in float32). -> float32, shape of ``bits``."""
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)


def sample_normal(keys: tuple[Tensor, Tensor], stream: int, shape: tuple[int, ...],
                  *, dtype: torch.dtype = torch.float32) -> Tensor:
    """Standard normals for each sample, a function of (keys, stream, element) only. -> [B, *shape].

    Box-Muller on two 24-bit uniforms in (0, 1) per element (tails to about 5.9 sigma).
    """
    n = math.prod(shape)
    u = _uniform24(_bits(keys, stream, 2 * n))
    u1, u2 = u[:, 0::2], u[:, 1::2]
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return z.reshape(-1, *shape).to(dtype)


def sample_uniform(keys: tuple[Tensor, Tensor], stream: int) -> Tensor:
    """One uniform in (0, 1) per sample (24-bit), a function of (keys, stream) only. -> float32 [B]."""
    return _uniform24(_bits(keys, stream, 1)[:, 0])


def sample_index(keys: tuple[Tensor, Tensor], stream: int, high: int) -> Tensor:
    """An integer in ``[0, high)`` per sample (modulo bias below 1e-9 for small ``high``). -> int64 [B]."""
    return _bits(keys, stream, 1)[:, 0] % high


# ----------------------------------------------------------------------------- reductions


def per_sample_mse(a: Tensor, b: Tensor) -> Tensor:
    """Mean squared difference over all but the batch axis, in float32. -> [B]."""
    return (a.float() - b.float()).square().flatten(1).mean(1)


def make_metrics(**values: Tensor) -> TensorDict:
    """Detached float32 scalars in a TensorDict with batch size []."""
    return TensorDict({k: v.detach().float().reshape(()) for k, v in values.items()}, batch_size=[])


def bcast(x_B: Tensor, like: Tensor) -> Tensor:
    """[B] -> [B, 1, ..., 1] matching ``like``'s rank and dtype."""
    return x_B.reshape(-1, *([1] * (like.ndim - 1))).to(like.dtype)


# ----------------------------------------------------------------------------- refiner
#
# A Denoiser (core/models/denoiser.py) is EDM-preconditioned inside: ``denoiser(x_noisy,
# cond, sigma, dt, task_id)`` returns D, the clean-signal estimate, with
# ``D = c_skip x + c_out F``. The refiner loss is the EDM loss ``|(D - x0) / c_out|^2``
# (weight 1 / c_out**2), which equals ``|F - F_target|^2``: unit scale at every sigma,
# eps-prediction at small sigma and signal prediction at large sigma, so the finest levels
# still carry gradient.

DenoiserFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""``fn(x_noisy_BLD, cond_BLD, sigma_B, dt_B, task_id_B) -> D_BLD``: a Denoiser call."""


def edm_c_out(sigma_B: Tensor, sigma_data: float) -> Tensor:
    """EDM's output scale ``sigma * sd / sqrt(sigma^2 + sd^2)``. -> [B] float32."""
    s = sigma_B.float()
    return s * sigma_data * (s.square() + sigma_data**2).rsqrt()


def refiner_loss(fn: DenoiserFn, target: Tensor, cond: Tensor, dt_B: Tensor, task_id_B: Tensor,
                 keys: tuple[Tensor, Tensor], *, sigmas_K: Tensor, sigma_data: float,
                 continuous: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """PDE-Refiner training loss, per sample. -> (loss_B, denoised_mse_B, level_B).

    Level ``k`` is uniform in ``[0, K)`` per sample. Level 0 (sigma_0 = 1) shows the
    network zeros: it predicts ``target`` from the condition alone (the plain one-step
    prediction). Level ``k >= 1`` shows ``target + sigma * eps``, with ``sigma = sigma_k``
    (the sampler's levels), or with ``continuous`` a sigma drawn log-uniformly between the
    finest level and 1, so the network is trained at every noise level in between, where
    consistency distillation's ODE steps query it (the sampler's levels are among them).
    """
    level_B = sample_index(keys, STREAM_LEVEL, sigmas_K.numel())
    sigmas = sigmas_K.to(target.device, non_blocking=True)  # non_blocking: no GPU sync
    sigma_B = sigmas[level_B]
    if continuous and sigmas_K.numel() > 1:
        # The finest level's log as a tensor op: reading it back (float()) would sync the device
        # every step and cannot run under the memory plan's fake tensors.
        drawn_B = torch.exp(sample_uniform(keys, STREAM_SIGMA).to(target.device) * sigmas[-1].log())
        sigma_B = torch.where(level_B > 0, drawn_B, sigma_B)
    eps = sample_normal(keys, STREAM_EPS, tuple(target.shape[1:]), dtype=target.dtype)
    keep = bcast((level_B > 0).float(), target)
    x = keep * (target + bcast(sigma_B, target) * eps)
    denoised = fn(x, cond, sigma_B, dt_B, task_id_B)
    err = (denoised.float() - target.float()) / bcast(edm_c_out(sigma_B, sigma_data), denoised).float()
    return err.square().flatten(1).mean(1), per_sample_mse(denoised, target), level_B


class SampleNoise:
    """Inference noise that belongs to the samples, not to their place in a batch.

    Draw k for sample b is a function of (seed, ``sample_id[b]``, ``t[b]``, k) only, so a rollout
    scores the same whether its samples are evaluated on one rank or split over several, in any
    batch size (a ``torch.Generator`` draws by position in the batch). Every sample of a batch
    takes the same sequence of draws, so the k-th draw means the same for all of them.
    """

    def __init__(self, seed: int, sample_id_B: Tensor, t_B: Tensor | None = None) -> None:
        sid = sample_id_B.to(torch.int64)
        t = torch.zeros_like(sid) if t_B is None else t_B.to(torch.int64).to(sid.device)
        words = (sid, sid >> 32, t, t >> 32)
        self.keys = (_hash_words(seed & _MASK32, seed >> 32, *words), _hash_words(0x68E31DA4, *words[::-1], seed))
        self.draws = 0

    def normal(self, shape_BX: tuple[int, ...], *, dtype: torch.dtype, device) -> Tensor:
        """The next draw: standard normals of shape ``[B, *X]`` (B = the number of sample ids)."""
        if shape_BX[0] != self.keys[0].shape[0]:
            raise ValueError(f"noise for {self.keys[0].shape[0]} samples asked for a batch of {shape_BX[0]}")
        out = sample_normal(self.keys, STREAM_INFERENCE + self.draws, tuple(shape_BX[1:]), dtype=dtype)
        self.draws += 1
        return out.to(device)


NoiseSource = torch.Generator | SampleNoise


def draw_normal(source: NoiseSource, shape: tuple[int, ...], *, dtype: torch.dtype, device) -> Tensor:
    """Standard normals from a generator (advancing it) or from a ``SampleNoise`` (its next draw)."""
    if isinstance(source, SampleNoise):
        return source.normal(shape, dtype=dtype, device=device)
    return torch.randn(shape, generator=source, device=source.device, dtype=dtype).to(device)


@torch.no_grad()
def refiner_sample(fn: DenoiserFn, cond: Tensor, dt_B: Tensor, task_id_B: Tensor, *, sigmas_K: Tensor,
                   generator: NoiseSource) -> Tensor:
    """PDE-Refiner inference: predict from zeros at level 0, then re-noise and denoise at
    every finer level. Draws from (and advances) ``generator`` (a ``torch.Generator`` or a
    ``SampleNoise``). -> [B, L, D] like ``cond``."""
    b = cond.shape[0]
    estimate = torch.zeros_like(cond)
    for k, sigma in enumerate(sigmas_K.tolist()):
        sigma_B = torch.full((b,), sigma, device=cond.device, dtype=torch.float32)
        x = estimate
        if k > 0:
            x = estimate + sigma * draw_normal(generator, tuple(cond.shape), dtype=cond.dtype, device=cond.device)
        estimate = fn(x, cond, sigma_B, dt_B, task_id_B)
    return estimate


@dataclass(frozen=True, kw_only=True, slots=True)
class RefinerStepConfig:
    """Settings of a few-level refiner loss (the diffusion residual stage and the steady prior)."""

    num_levels: int = 3
    """Refinement levels K (level 0 predicts the target from the condition alone)."""
    sigma_min: float = 2e-3
    """Finest noise level, in the target's units: keep it below ``sigma_data``, or the finest
    level's noise swamps the signal and refining adds little (PDE-Refiner uses far below 1e-2)."""
    sigma_data: float = 1.0
    """The Denoiser's ``sigma_data`` (it sets the loss weight ``1 / c_out**2``); must equal the
    model's own (``Denoiser.sigma_data``), or the loss weight and the preconditioning disagree."""
    continuous_levels: bool = False
    """Train the noisy levels at sigmas drawn log-uniformly in ``[sigma_min, 1]`` instead of at the
    ``num_levels - 1`` sampling levels only (see `refiner_loss`); sampling is unchanged."""

    def __post_init__(self):
        if self.num_levels < 1:
            raise ValueError(f"num_levels must be >= 1, got {self.num_levels}")
        if not 0.0 < self.sigma_min < 1.0:
            raise ValueError(f"sigma_min must lie in (0, 1), got {self.sigma_min}")
        if self.sigma_data <= 0:
            raise ValueError(f"sigma_data must be > 0, got {self.sigma_data}")
