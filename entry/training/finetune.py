"""Fine-tuning from a finished run (`finetune.from`): the source checked before anything is
written, its weights fingerprinted in the done files, and the frozen stages' weights copied.

A source is usable when its folder holds the config it recorded, the weights of every stage it
trained that this config trains too, and, for each of those, a model this config builds the same
but for its task count (the model descriptions beside the weights against the registry's
description of this config's model: `StageSpec.model`). Each failure is a `ConfigError` of one
line naming the folder or file, raised before the run folder exists (exit 2).
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.models.registry import describe
from entry.config.from_run import source_folder
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.evaluation.task_frames import task_label
from entry.models.build import dims_mismatch
from entry.models.files import read_description
from entry.stages.autoencoder import FORECAST_STAGE
from entry.stages.record import SPECS, selected_training_stages
from entry.stages.source import (TASK_TABLE, forecasts_new_fields, new_datasets, new_fields, source_config,
                                 source_stages, task_rows)
from entry.storage.run_folder import weights_file
from entry.storage.weights_fingerprint import weights_fingerprint

__all__ = ["UNCOMPARED_ARGS", "FIELD_CODEC_GROWS", "check_source", "source_inputs", "frozen_source",
           "trains_new_only"]

UNCOMPARED_ARGS = ("num_tasks", "sigma_data")
"""Model arguments a fine-tuning run may change: the task count (its new tasks' rows are added) and
what the stage measures on its data (the diffusion residual's scale)."""


FIELD_CODEC_GROWS = ("datasets", "tasks")
"""A field codec's arguments a fine-tuning run changes: the datasets it knows (the new data's are
appended, with their new fields) and each task's dataset."""


def _incompatible(stage: str, theirs: dict, mine: dict) -> str | None:
    """Why the source's model description `theirs` of `stage` is not this config's `mine`, and what
    to do about it (None: it is)."""
    if (theirs["kind"], theirs["arch"]) != (mine["kind"], mine["arch"]):
        return (f"the source's {stage} is {theirs['kind']} {theirs['arch']}, this config builds "
                f"{mine['kind']} {mine['arch']}")
    why = _codec_data_mismatch(theirs, mine) if mine["kind"] == "codec" else None
    if why:
        return why
    uncompared = set(UNCOMPARED_ARGS)
    if mine["kind"] == "codec" and mine["arch"] == "fields":
        # A field codec grows by the new data's datasets (entry.models.build: the source's first) and
        # reads its own tasks' datasets; its layout is the source's.
        uncompared |= set(FIELD_CODEC_GROWS)
    keys = sorted((set(theirs["args"]) | set(mine["args"])) - uncompared)
    differ = [k for k in keys if theirs["args"].get(k) != mine["args"].get(k)]
    if differ:
        shown = ", ".join(f"{k} {theirs['args'].get(k)} -> {mine['args'].get(k)}" for k in differ[:4])
        return (f"the source's {stage} model differs from this config's ({shown}); leave the model sections "
                f"out of the config so they default from the source")
    return None


def _codec_data_mismatch(theirs: dict, mine: dict) -> str | None:
    """Why the source's codec (description `theirs`) cannot read the new data where the difference
    comes from the data, not from a model setting (so leaving the model sections out would not
    help): another channel count, a spatial dimension the source's codec does not serve, another
    grid for a codec fitted to one. None otherwise."""
    a, b = theirs["args"], mine["args"]
    if a.get("channels") != b.get("channels"):
        return (f"the source's codec reads {a.get('channels')} fields, the new data have {b.get('channels')}; "
                f"fine-tune on data of the source's fields, or pretrain with latent.codec: fields (a codec of "
                f"named fields takes new ones)")
    dims = [set(args["tokens"]) for args in (a, b) if isinstance(args.get("tokens"), dict)]
    if len(dims) == 2 and dims[0] != dims[1]:
        return dims_mismatch(*dims)
    if "grid" in a and "grid" in b and a["grid"] != b["grid"]:
        return (f"the source's codec was fitted to its data's {a.get('grid')} grid (latent.linear: global), the "
                f"new data are on {b.get('grid')}; fine-tune on data of the source's grid (a codec with "
                f"latent.linear: local reads any grid)")
    return None


def check_source(cfg: Config) -> list[str]:
    """The lines that say where each training stage starts (none when the config fine-tunes
    nothing) when the source is usable (module docstring); otherwise a `ConfigError` of one line
    naming what is wrong and how to fix it."""
    if not cfg.finetune.source:
        return []
    folder = source_folder(cfg.finetune.source)
    source = source_config(cfg)  # a ConfigError for a missing folder or config.json
    trained = source_stages(source)
    for stage in selected_training_stages(cfg):
        if stage not in trained:
            continue  # trains from the config's initialisation
        path = weights_file(folder, stage)
        if not path.is_file():
            raise ConfigError(f"finetune.from: {folder} is not a finished run: {path} is missing (its {stage} stage "
                              f"did not finish); finish that run (python -m entry.pipeline --config CFG) or name "
                              f"another")
        spec = SPECS[stage]
        theirs = read_description(path) or describe(spec.model(source))
        mine = describe(spec.model(cfg))
        # A model the registry did not build has no description: its weights' shapes are checked on loading.
        why = _incompatible(stage, theirs, mine) if theirs and mine else None
        if why:
            raise ConfigError(f"finetune.from: incompatible model: {why} ({folder / 'config.json'})")
    identical = task_rows(source, cfg) == list(range(len(source.data.tasks)))
    grown = new_fields(cfg)
    for stage in cfg.finetune.freeze:
        if stage not in trained:
            raise ConfigError(f"finetune.freeze: the source run {folder} did not train {stage}; remove it from "
                              f"finetune.freeze")
        if not identical and _has_task_table(weights_file(folder, stage)):
            raise ConfigError(f"finetune.freeze: a frozen {stage} keeps the source's task table, which has no rows "
                              f"for this config's other tasks; remove {stage} from finetune.freeze")
    forecast = forecasts_new_fields(cfg)
    if forecast:
        _check_forecast(cfg, folder, trained)
    stages = selected_training_stages(cfg)
    starts = [s for s in stages if s in trained and s not in cfg.finetune.freeze]
    fresh = [s for s in stages if s not in trained]
    new = [task_label(cfg, i) for i, r in enumerate(task_rows(source, cfg)) if r is None]
    refit = new_datasets(cfg)
    alone = " (but the new fields' embeddings, trained alone)" if trains_new_only(cfg, "autoencoder") else ""
    return [f"fine-tuning from {folder} (finetune.from):",
            f"  starting from its weights: {', '.join(starts) or '(none)'}; frozen, copied from it: "
            f"{', '.join(cfg.finetune.freeze) or '(none)'}{alone}; trained from scratch (it did not train them): "
            f"{', '.join(fresh) or '(none)'}",
            f"  new tasks (new task-embedding rows, lr x {cfg.finetune.new_lr_scale:g}): {', '.join(new) or '(none)'}",
            f"  new fields (new codec embeddings, lr x {cfg.finetune.new_lr_scale:g}): {', '.join(grown) or '(none)'}"
            + (" (finetune.new_lr_scale=10 lets them learn ahead of the trained codec: docs/using.md)"
               if grown and cfg.finetune.new_lr_scale == 1 else "")
            + (", fitted by reconstruction and the source operator's forecast" if forecast else ""),
            f"  normalisation fitted on the new data (the datasets the source's codec never read): "
            f"{', '.join(refit) or '(none)'}"]


def _check_forecast(cfg: Config, folder: Path, trained: list[str]) -> None:
    """`finetune.new_fields: forecast` needs an operator in the source and time series alone (a steady
    task has no step to forecast); a `ConfigError` of one line otherwise."""
    if FORECAST_STAGE not in trained:
        raise ConfigError(f"finetune.new_fields: forecast fits new fields through the source's operator, and the "
                          f"source run {folder} trained none; set finetune.new_fields=reconstruction")
    steady = [task_label(cfg, i) for i, t in enumerate(cfg.data.tasks) if t.spec.steady]
    if steady:
        raise ConfigError(f"finetune.new_fields: forecast steps every task with the source's operator, and "
                          f"{', '.join(steady)} is steady; fine-tune steady tasks with "
                          f"finetune.new_fields=reconstruction")


def _has_task_table(path: Path) -> bool:
    return any(k.endswith(TASK_TABLE) for k in torch.load(path, map_location="cpu", weights_only=True))


def source_inputs(cfg: Config, stage: str) -> dict:
    """The fingerprints (entry.storage.weights_fingerprint) of the source weights `stage`
    starts from, keyed by stage: its own and its inputs' (`StageSpec.weights_read`) that the
    source trained; {} when the config fine-tunes nothing. A changed source retrains the stage."""
    if not cfg.finetune.source or stage not in SPECS:
        return {}
    folder = source_folder(cfg.finetune.source)
    trained = source_stages(source_config(cfg))
    spec = SPECS[stage]
    # A codec fitting new fields by the forecast reads the source's operator too.
    also = (FORECAST_STAGE,) if stage == "autoencoder" and forecasts_new_fields(cfg) else ()
    out = {}
    for s in (*spec.weights_read, stage, *also):
        path = weights_file(folder, s)
        if s in trained:
            out[s] = weights_fingerprint(path) if path.is_file() else None
    return out


def frozen_source(cfg: Config, stage: str) -> Path | None:
    """The source weights a frozen `stage` (`finetune.freeze`) is copied from; None when it trains
    (a frozen field codec grown by new fields trains their embeddings alone: `trains_new_only`)."""
    if stage not in cfg.finetune.freeze or trains_new_only(cfg, stage):
        return None
    return weights_file(source_folder(cfg.finetune.source), stage)


def trains_new_only(cfg: Config, stage: str) -> bool:
    """Whether `stage` is frozen (`finetune.freeze`) yet trains what the source lacks, and that alone: a
    field codec meeting fields its source never read (their embeddings)."""
    return stage == "autoencoder" and stage in cfg.finetune.freeze and bool(new_fields(cfg))
