"""Build the stage models from a config (the config-to-constructor mapping lives here, not in core)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from core.models import conv_codec
from core.models.grid_codec import cells_per_axis
from core.models.pdet import PDETSettings
from core.models.registry import build
from core.models.registry import entry as registry_entry
from core.models.settings import as_args
from entry.config.from_run import source_folder
from entry.config.load import ConfigError
from entry.config.schema import Config, TaskConfig
from entry.models.files import read_description
from entry.storage.run_folder import weights_file


def field_channels(cfg: Config) -> int:
    """Channels C of every task's field (one grid or conv codec reads them all; the config refuses
    tasks whose counts differ unless latent.codec is fields). Darcy's coefficient and solution are
    each one channel."""
    return len(cfg.data.tasks[0].spec.channels)


def training_grid(task: TaskConfig) -> tuple[int, ...]:
    """The grid a task is trained on: its stored points per axis after ``reduce_x``."""
    return task.training_grid


def latent_tokens(cfg: Config, ndim: int) -> int:
    """Tokens L of a field with `ndim` spatial dimensions.

    Codec grid: ``latent.tokens_2d`` for 2D when set, else ``latent.tokens``. Codec conv: the
    latent cells of the config's one training grid (the config refuses tasks of other grids or
    dimensions), whatever `ndim` a caller asks for.
    """
    lat = cfg.latent
    if lat.codec == "conv":
        return conv_codec.latent_tokens(training_grid(cfg.data.tasks[0]), lat.patch)
    return lat.tokens_2d if ndim == 2 and lat.tokens_2d else lat.tokens


def require_grid_codec(cfg: Config, what: str, *, fields: bool = False) -> None:
    """A `ConfigError` naming `what` when the config's codec is not the grid codec (nor, with
    `fields`, the field codec, which cuts fields into the same cells): for the tools that measure
    the grid codec's own layouts (its tokens, modes and linear scopes)."""
    if cfg.latent.codec != "grid" and not (fields and cfg.latent.codec == "fields"):
        raise ConfigError(f"{what} measures the grid codec (latent.codec: grid, latent.tokens); this config sets "
                          f"latent.codec: {cfg.latent.codec}; run it on a grid-codec config")


def codec_modes(cfg: Config) -> dict[int, int]:
    """Cosine modes per axis of each spatial dimension's cells (codec grid): ``latent.modes``, or (0)
    the most points per cell and axis among that dimension's training grids, which makes the codec exact
    (codec fields: which keeps every point of the training grid in its patch embedding)."""
    require_grid_codec(cfg, "codec_modes", fields=True)
    modes: dict[int, int] = {}
    for task in cfg.data.tasks:
        grid = training_grid(task)
        cells = cells_per_axis(latent_tokens(cfg, len(grid)), len(grid))
        need = cfg.latent.modes or max(math.ceil(n / cells) for n in grid)
        modes[len(grid)] = max(modes.get(len(grid), 1), need)
    return modes


def build_autoencoder(cfg: Config) -> nn.Module:
    """The codec ``latent.codec`` mapping fields of any task to [L, D] tokens and back, from the
    registry (linear path unfitted: the autoencoder stage fits it, `entry.models.codec_fit`, and
    weight files carry it).

    Codec "grid": one stem per spatial dimension the config's tasks use (2D needs tokens = a
    power of 4). Codec "conv": ``latent.patch`` per axis, ``latent.dim`` latent channels. Codec
    "fields": a dataset per task (``dataset_key``: its name and parameter) with the task's field names
    (``spec.channels``; a name shared by tasks is one field, one embedding, normalised per dataset),
    the same tokens and modes per dimension as the grid codec, width ``latent.hidden``.
    """
    lat = cfg.latent
    if lat.codec == "fields":
        tasks = [dataset_key(task) for task in cfg.data.tasks]
        datasets: dict[str, list[str]] = {}
        for key, task in zip(tasks, cfg.data.tasks, strict=True):
            if datasets.setdefault(key, list(task.spec.channels)) != list(task.spec.channels):
                raise ConfigError(f"data.tasks: two tasks named {task.name!r} with param {task.param:g} have other "
                                  f"fields ({datasets[key]} and {list(task.spec.channels)}); give each its own name")
        modes = codec_modes(cfg)
        layout = {"datasets": [[key, names] for key, names in datasets.items()],
                  "tokens": {str(d): latent_tokens(cfg, d) for d in sorted(modes)},
                  "modes": {str(d): m for d, m in sorted(modes.items())}}
        return build("codec", "fields", **{**layout, **_source_field_layout(cfg, layout)}, dim=lat.dim,
                     hidden=lat.hidden, tasks=tasks)
    if lat.codec == "conv":
        ndim = cfg.data.tasks[0].spec.spatial_dims  # one dimension per conv codec (the config checks)
        return build("codec", "conv", channels=field_channels(cfg), ndim=ndim, patch=lat.patch,
                     latent_channels=lat.dim, hidden=lat.hidden, blocks=lat.blocks, linear=lat.linear,
                     **({"grid": list(training_grid(cfg.data.tasks[0]))} if lat.linear == "global" else {}))
    modes = codec_modes(cfg)
    modes.update((d, m) for d, m in _source_grid_modes(cfg).items() if d in modes)
    return build("codec", "grid", channels=field_channels(cfg), dim=lat.dim,
                 tokens={str(d): latent_tokens(cfg, d) for d in sorted(modes)},
                 modes={str(d): m for d, m in sorted(modes.items())}, hidden=lat.hidden, linear=lat.linear)


def source_codec(cfg: Config, arch: str) -> dict | None:
    """The arguments of the codec the fine-tuning source (`finetune.from`) exported, from the
    description beside its weights; None when the config fine-tunes nothing or that codec is not
    of registry arch `arch` (or has no description)."""
    if not cfg.finetune.source:
        return None
    path = weights_file(source_folder(cfg.finetune.source), "autoencoder")
    found = read_description(path) if path.is_file() else None
    if not found or found.get("kind") != "codec" or found.get("arch") != arch:
        return None
    return found["args"]


def source_field_codec(cfg: Config) -> dict | None:
    """`source_codec` of the field codec; a `ConfigError` for a field codec exported before it
    normalised per dataset (its description names no datasets)."""
    found = source_codec(cfg, "fields")
    if found is None:
        return None
    if "datasets" not in found:
        path = weights_file(source_folder(cfg.finetune.source), "autoencoder")
        raise ConfigError(f"finetune.from: incompatible model: the source's field codec ({path}) normalises by field "
                          f"name, as codecs exported before 2026-11-29 did; this version normalises per dataset: "
                          f"train the source again")
    return found


def dataset_key(task: TaskConfig) -> str:
    """The field codec's name of `task`'s data (its normalisation table): its name and parameter, what
    makes two configs' tasks the same task (`entry.stages.source.task_key`)."""
    return f"{task.name}@{task.param!r}"


def _source_field_layout(cfg: Config, own: dict) -> dict:
    """A field codec fine-tuned from a run (`finetune.from`) is the source's codec grown by the new
    data: its datasets (the new ones appended, in the new tasks' order; a new dataset's fields the
    source lacks get new embeddings) and its tokens and cosine modes per dimension (so a resolution
    the source never saw is cut into the source's cells, and a trained patch embedding reads it). {}
    when the config fine-tunes nothing or the source's codec is no field codec described beside its
    weights; a `ConfigError` when the new data have a spatial dimension the source's codec does not serve."""
    theirs = source_field_codec(cfg)
    if theirs is None:
        return {}
    if set(own["tokens"]) - set(theirs["tokens"]):
        raise ConfigError(f"finetune.from: incompatible model: "
                          f"{dims_mismatch(theirs['tokens'], own['tokens'])}")
    known = [key for key, _ in theirs["datasets"]]
    return {"datasets": [*theirs["datasets"], *(d for d in own["datasets"] if d[0] not in known)],
            "tokens": dict(theirs["tokens"]),
            "modes": dict(theirs["modes"])}


def dims_mismatch(theirs, mine) -> str:
    """The refusal's reason (and its fix) when new data have a spatial dimension the source's codec
    does not serve; `theirs` and `mine` name the dimensions each serves (ints or their strings, as a
    codec description's per-dimension tables key them)."""
    dims = [sorted(int(d) for d in side) for side in (theirs, mine)]
    return (f"the source's codec serves {dims[0]}D fields, the new data have {dims[1]}D ones; fine-tune on "
            f"fields of the source's dimensions")


def _source_grid_modes(cfg: Config) -> dict[int, int]:
    """A grid codec fine-tuned from a run keeps the source's cosine modes per dimension unless the
    config sets `latent.modes`: its per-cell fit serves any resolution (core.models.grid_codec), so
    data at a resolution the source never saw are read by the source's trained layers, not refused
    as another model (a dimension only one side has still makes another model, which the
    fine-tuning check refuses). {} when the config fine-tunes nothing, sets the modes, or the
    source's codec is no grid codec described beside its weights."""
    theirs = source_codec(cfg, "grid") if not cfg.latent.modes else None
    return {int(d): m for d, m in theirs["modes"].items()} if theirs else {}


def _max_tokens(cfg: Config) -> int:
    """The longest latent any task of the config has (a position table must cover it)."""
    return max(latent_tokens(cfg, task.spec.spatial_dims) for task in cfg.data.tasks)


STACK_VALUES: dict[str, Callable[[Config], Any]] = {"tokens": _max_tokens}
"""Values the stack supplies to an operator that declares it takes them (`stack_args` of its
registry entry), beyond the `dim`, `num_tasks` and `residual` every operator takes."""


def operator_args(cfg: Config) -> dict:
    """Constructor arguments of the config's operator (`operator.arch`), plain JSON values: its
    settings (the arch's section, `operator.<section>`) and what the stack supplies (the latent
    width, the task count, the identity start, and the `STACK_VALUES` its registry entry names)."""
    op = cfg.operator
    takes = registry_entry("operator", op.arch).stack_args
    unknown = [name for name in takes if name not in STACK_VALUES]
    if unknown:
        raise ValueError(f"operator {op.arch!r} takes stack argument(s) {unknown}; the stack supplies "
                         f"{sorted(STACK_VALUES)}")
    stack = dict(dim=cfg.latent.dim, num_tasks=len(cfg.data.tasks), residual=op.identity_start,
                 **{name: STACK_VALUES[name](cfg) for name in takes})
    settings = as_args(op.settings)
    both = sorted(set(stack) & set(settings))
    if both:
        raise ValueError(f"operator {op.arch!r}: settings field(s) {both} are arguments the stack supplies; "
                         f"rename them in its settings class")
    return {**stack, **settings}


def build_operator(cfg: Config) -> nn.Module:
    """The latent time-stepping operator `operator.arch`, from the registry."""
    return build("operator", cfg.operator.arch, **operator_args(cfg))


def build_denoiser(cfg: Config, pdet: PDETSettings, *, sigma_data: float = 1.0,
                   solution_mean: torch.Tensor | None = None) -> nn.Module:
    """A denoiser on the shared backbone (diffusion residual, consistency student, steady prior).

    ``sigma_data`` is the EDM scale of the signal it denoises (the diffusion stage's measured
    residual RMS; 1 for the steady prior's solution latents); ``solution_mean`` the steady
    prior's [T, L, D] measured solution mean (None: none). Loading weights replaces both with
    the stored values, so a model built only to load weights can keep the defaults.
    """
    model = build("denoiser", "pdet_unet", dim=cfg.latent.dim, num_tasks=len(cfg.data.tasks),
                  sigma_data=float(sigma_data), **as_args(pdet))
    # A tensor is no constructor argument of a description: the weights carry it.
    model.set_solution_mean(solution_mean)
    return model
