"""Conditioning: Fourier embeddings of scalars, task embeddings, and adaLN-Zero modulation.

Legend: B batch, L tokens, D latent (block) dim, H hidden / conditioning dim, F frequencies.

A block is conditioned on one vector ``c_BH`` (time step, task, and optionally noise
level). ``AdaLNZero`` turns ``c_BH`` into per-channel (shift, scale, gate) triples; its
linear layer starts at zero, so every gate is 0 and a fresh residual block is exactly the
identity (DiT's adaLN-Zero), which keeps deep stacks stable at the start of training.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def fourier_embedding(x_B: Tensor, dim: int, max_freq: float = 1000.0) -> Tensor:
    """Sinusoidal features of a scalar per sample. -> [B, dim] (float32).

    Frequencies are geometric from 1 to ``max_freq`` (radians per unit), so scalars from
    about ``1 / max_freq`` (a small dt) up to a few units are all resolved; ``[cos, sin]``
    halves are concatenated. Computed in float32 whatever the autocast dtype, because
    ``x * max_freq`` loses its phase in bf16.

    Args:
        x_B: [B] scalar per sample (any float dtype).
        dim: even embedding width.
        max_freq: highest angular frequency.
    """
    if dim % 2:
        raise ValueError(f"fourier_embedding needs an even dim, got {dim}")
    half = dim // 2
    freqs_F = torch.exp(torch.linspace(0.0, math.log(max_freq), half, device=x_B.device, dtype=torch.float32))
    args_BF = x_B.to(torch.float32)[:, None] * freqs_F[None, :]
    return torch.cat([torch.cos(args_BF), torch.sin(args_BF)], dim=-1)


class ScalarEmbedding(nn.Module):
    """Fourier features of a scalar followed by a two-layer MLP. ``[B] -> [B, H]``."""

    def __init__(self, cond_dim: int, freq_dim: int = 64, max_freq: float = 1000.0) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.max_freq = max_freq
        self.mlp = nn.Sequential(nn.Linear(freq_dim, cond_dim), nn.SiLU(), nn.Linear(cond_dim, cond_dim))

    def forward(self, x_B: Tensor) -> Tensor:
        """x_B: [B] scalars -> [B, H]."""
        emb_BF = fourier_embedding(x_B, self.freq_dim, self.max_freq)
        return self.mlp(emb_BF.to(self.mlp[0].weight.dtype))


class ConditionEmbedding(nn.Module):
    """Conditioning vector from dt, task id and (optionally) a noise level.

    ``c = mlp_dt(fourier(dt)) + task_table[task_id] (+ mlp_noise(fourier(noise)))``.

    Args:
        cond_dim: H, width of the conditioning vector.
        num_tasks: size of the task-id table (ids in ``[0, num_tasks)``).
        cond_noise: if True, ``forward`` requires ``noise_B`` and embeds it as well.
        freq_dim: width of the Fourier features of each scalar.
    """

    def __init__(self, cond_dim: int, num_tasks: int, cond_noise: bool = False, freq_dim: int = 64) -> None:
        super().__init__()
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        self.dt_embed = ScalarEmbedding(cond_dim, freq_dim)
        self.task_embed = nn.Embedding(num_tasks, cond_dim)
        nn.init.normal_(self.task_embed.weight, std=0.02)
        self.noise_embed = ScalarEmbedding(cond_dim, freq_dim) if cond_noise else None

    def forward(self, dt_B: Tensor, task_id_B: Tensor, noise_B: Tensor | None = None) -> Tensor:
        """dt_B: [B] float, task_id_B: [B] int64, noise_B: [B] float or None -> c_BH."""
        c_BH = self.dt_embed(dt_B) + self.task_embed(task_id_B)
        if self.noise_embed is not None:
            if noise_B is None:
                raise ValueError("this model is conditioned on the noise level: pass noise_B")
            c_BH = c_BH + self.noise_embed(noise_B)
        elif noise_B is not None:
            raise ValueError("noise_B given to a model built with cond_noise=False")
        return c_BH


class AdaLNZero(nn.Module):
    """``SiLU -> Linear`` from c_BH to ``chunks`` modulation vectors of width D, zero-initialised.

    Args:
        cond_dim: H.
        dim: D, width of the modulated activations.
        chunks: number of vectors returned (6 for a block: shift/scale/gate x 2).
    """

    def __init__(self, cond_dim: int, dim: int, chunks: int) -> None:
        super().__init__()
        self.chunks = chunks
        self.act = nn.SiLU()
        self.linear = nn.Linear(cond_dim, chunks * dim)
        # Zero weights and bias: all shifts, scales and gates start at 0, so blocks start
        # as the identity (the gate multiplies the whole residual branch).
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, c_BH: Tensor) -> tuple[Tensor, ...]:
        """c_BH -> ``chunks`` tensors of shape [B, 1, D] (broadcast over tokens)."""
        mod_BK = self.linear(self.act(c_BH))
        return tuple(m[:, None, :] for m in mod_BK.chunk(self.chunks, dim=-1))


def modulate(x_BLD: Tensor, shift_B1D: Tensor, scale_B1D: Tensor) -> Tensor:
    """adaLN modulation ``x * (1 + scale) + shift``; identity when both are zero. -> [B, L, D]."""
    return x_BLD * (1 + scale_B1D) + shift_B1D
