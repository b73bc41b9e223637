"""Build the stage models from a config (the config-to-constructor mapping lives here, not in core)."""

from __future__ import annotations

import math

import torch
from torch import nn

from core.models.grid_codec import cells_per_axis
from core.models.registry import build
from entry.config.schema import Config, PDETConfig, TaskConfig


def field_channels(cfg: Config) -> int:
    """Channels C of every task's field (one codec reads them all; the config refuses tasks whose
    counts differ). Darcy's coefficient and solution are each one channel."""
    return len(cfg.data.tasks[0].spec.channels)


def training_grid(task: TaskConfig) -> tuple[int, ...]:
    """The grid a task is trained on: its stored points per axis after ``reduce_x``."""
    grid = task.spec.grid or (task.nx,) * task.spec.spatial_dims
    return tuple(math.ceil(n / task.reduce_x) for n in grid)


def latent_tokens(cfg: Config, ndim: int) -> int:
    """Tokens L of a field with `ndim` spatial dimensions (``latent.tokens_2d`` for 2D when set)."""
    return cfg.latent.tokens_2d if ndim == 2 and cfg.latent.tokens_2d else cfg.latent.tokens


def codec_modes(cfg: Config) -> dict[int, int]:
    """Cosine modes per axis of each spatial dimension's cells: ``latent.modes``, or (0) the most
    points per cell and axis among that dimension's training grids, which makes the codec exact."""
    modes: dict[int, int] = {}
    for task in cfg.data.tasks:
        grid = training_grid(task)
        cells = cells_per_axis(latent_tokens(cfg, len(grid)), len(grid))
        need = cfg.latent.modes or max(math.ceil(n / cells) for n in grid)
        modes[len(grid)] = max(modes.get(len(grid), 1), need)
    return modes


def build_autoencoder(cfg: Config) -> nn.Module:
    """Grid encoder + decoder mapping fields of any task to [L, D] tokens and back (linear path
    unfitted: the autoencoder stage fits it, and weight files carry it); registered as codec "grid"."""
    lat = cfg.latent
    # One stem per spatial dimension the config's tasks use (2D needs tokens = a power of 4).
    modes = codec_modes(cfg)
    return build("codec", "grid", channels=field_channels(cfg), dim=lat.dim,
                 tokens={str(d): latent_tokens(cfg, d) for d in sorted(modes)},
                 modes={str(d): m for d, m in sorted(modes.items())}, hidden=lat.hidden, linear=lat.linear)


def _pdet_kwargs(p: PDETConfig) -> dict:
    return dict(hidden_dim=p.hidden_dim, depths=tuple(p.depths), num_heads=p.num_heads,
                group_size=p.group_size, mlp_ratio=p.mlp_ratio, token_conv=p.token_conv)


def operator_args(cfg: Config) -> dict:
    """Constructor arguments of the config's operator (`operator.arch`), plain JSON values."""
    op, tasks = cfg.operator, len(cfg.data.tasks)
    if op.arch == "transformer":
        t = op.transformer
        # The position table covers the longest latent any task of the config has.
        tokens = max(latent_tokens(cfg, task.spec.spatial_dims) for task in cfg.data.tasks)
        return dict(dim=cfg.latent.dim, tokens=tokens, hidden_dim=t.hidden_dim, depth=t.depth,
                    num_heads=t.num_heads, num_tasks=tasks, mlp_ratio=t.mlp_ratio)
    return dict(dim=cfg.latent.dim, num_tasks=tasks, **_pdet_kwargs(op.pdet))


def build_operator(cfg: Config) -> nn.Module:
    """The latent time-stepping operator `operator.arch` ("pdet_unet" or "transformer"), from the registry."""
    return build("operator", cfg.operator.arch, **operator_args(cfg))


def build_denoiser(cfg: Config, pdet: PDETConfig, *, sigma_data: float = 1.0,
                   solution_mean: torch.Tensor | None = None) -> nn.Module:
    """A denoiser on the shared backbone (diffusion residual, consistency student, steady prior).

    ``sigma_data`` is the EDM scale of the signal it denoises (the diffusion stage's measured
    residual RMS; 1 for the steady prior's solution latents); ``solution_mean`` the steady
    prior's [T, L, D] measured solution mean (None: none). Loading weights replaces both with
    the stored values, so a model built only to load weights can keep the defaults.
    """
    model = build("denoiser", "pdet_unet", dim=cfg.latent.dim, num_tasks=len(cfg.data.tasks),
                  sigma_data=float(sigma_data), **_pdet_kwargs(pdet))
    # A tensor is no constructor argument of a description: the weights carry it.
    model.set_solution_mean(solution_mean)
    return model
