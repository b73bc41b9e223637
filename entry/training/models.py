"""Build the stage models from a config (the config-to-constructor mapping lives here, not in core)."""

from __future__ import annotations

import math

import torch
from torch import nn

from core.models.autoencoder import Autoencoder
from core.models.denoiser import Denoiser
from core.models.grid_codec import GridDecoder, GridEncoder
from core.models.pdet import PDETUNet
from entry.config.schema import Config, PDETConfig, TaskConfig
from pipelines.tasks import get_task

FIELD_CHANNELS = 1  # every PDEBench task here has one field channel (Darcy: coefficient or solution)


def training_grid(task: TaskConfig) -> tuple[int, ...]:
    """The grid a task is trained on: its stored points per axis after ``reduce_x``."""
    points = math.ceil(task.nx / task.reduce_x)
    return (points,) * get_task(task.name).spatial_dims


def latent_tokens(cfg: Config, ndim: int) -> int:
    """Tokens L of a field with `ndim` spatial dimensions (``latent.tokens_2d`` for 2D when set)."""
    return cfg.latent.tokens_2d if ndim == 2 and cfg.latent.tokens_2d else cfg.latent.tokens


def codec_modes(cfg: Config) -> dict[int, int]:
    """Cosine modes per axis of each spatial dimension's cells: ``latent.modes``, or (0) the most
    points per cell and axis among that dimension's training grids, which makes the codec exact."""
    modes: dict[int, int] = {}
    for task in cfg.data.tasks:
        grid = training_grid(task)
        cells = latent_tokens(cfg, 1) if len(grid) == 1 else math.isqrt(latent_tokens(cfg, 2))
        need = cfg.latent.modes or math.ceil(grid[0] / cells)
        modes[len(grid)] = max(modes.get(len(grid), 1), need)
    return modes


def build_autoencoder(cfg: Config) -> nn.Module:
    """Grid encoder + decoder mapping fields of any task to [L, D] tokens and back (linear path
    unfitted: the autoencoder stage fits it, and weight files carry it)."""
    lat = cfg.latent
    # One stem per spatial dimension the config's tasks use (2D needs tokens = a power of 4).
    modes = codec_modes(cfg)
    ndims = tuple(sorted(modes))
    tokens = {d: latent_tokens(cfg, d) for d in ndims}
    kw = dict(hidden=lat.hidden, ndims=ndims, modes=modes, linear=lat.linear)
    return Autoencoder(GridEncoder(FIELD_CHANNELS, tokens, lat.dim, **kw),
                       GridDecoder(FIELD_CHANNELS, tokens, lat.dim, **kw))


def _pdet_kwargs(p: PDETConfig) -> dict:
    return dict(hidden_dim=p.hidden_dim, depths=tuple(p.depths), num_heads=p.num_heads,
                group_size=p.group_size, mlp_ratio=p.mlp_ratio, token_conv=p.token_conv)


def build_operator(cfg: Config) -> nn.Module:
    """The latent time-stepping operator (`pdet_unet`)."""
    return PDETUNet(cfg.latent.dim, num_tasks=len(cfg.data.tasks), **_pdet_kwargs(cfg.operator.pdet))


def build_denoiser(cfg: Config, pdet: PDETConfig, *, sigma_data: float = 1.0,
                   solution_mean: torch.Tensor | None = None) -> nn.Module:
    """A denoiser on the shared backbone (diffusion residual, consistency student, steady prior).

    ``sigma_data`` is the EDM scale of the signal it denoises (the diffusion stage's measured
    residual RMS; 1 for the steady prior's solution latents); ``solution_mean`` the steady
    prior's [T, L, D] measured solution mean (None: none). Loading weights replaces both with
    the stored values, so a model built only to load weights can keep the defaults.
    """
    return Denoiser(cfg.latent.dim, num_tasks=len(cfg.data.tasks), sigma_data=sigma_data,
                    solution_mean=solution_mean, **_pdet_kwargs(pdet))
