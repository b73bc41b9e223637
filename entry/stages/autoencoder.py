"""The autoencoder stage's record (`SPEC`) and build: the codec's linear path fitted in closed form
to training fields of every task (`entry.models.codec_fit.fit_codec`), then the learned correction
trained on field snapshots of every task's training split, one task per step on every rank. A field
codec fine-tuned with new fields under `finetune.new_fields: forecast` trains on pairs of frames instead,
through the source's operator frozen beside it (`core.steps.autoencoder.autoencoder_step`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from core.steps.autoencoder import AutoencoderStepConfig, autoencoder_step
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.files import task_path, task_split
from entry.distributed.memory_sim import StageProbe
from entry.distributed.process_group import DistInfo
from entry.models.build import build_autoencoder, build_operator
from entry.models.codec_fit import fit_codec
from entry.models.weights import frozen_placed
from entry.stages.parts import StageParts
from entry.stages.source import forecasts_new_fields, new_datasets, new_fields, source_weights
from entry.stages.spec import BASE_SECTIONS, StageSpec, always, field_batch
from entry.stages.stage_build import from_source, optimizer_for, place_with_copy, seeded
from pipelines.fields import FieldSnapshots, FieldTrajectoryPairs, build_field_loader
from pipelines.memory import read_budget

FORECAST_STAGE = "operator"
"""The source's stage whose model the forecast of `finetune.new_fields: forecast` runs through."""

FIT_CHUNK = 1024
"""Frames encoded at a time while fitting the linear path (fewer when they would exceed the read
budget, `pipelines.memory.read_budget`)."""


def autoencoder_step_config(cfg: Config) -> AutoencoderStepConfig:
    """The autoencoder step's settings (its reconstruction loss)."""
    return AutoencoderStepConfig(loss=cfg.autoencoder.resolved_loss(cfg.latent.codec))


def field_datasets(cfg: Config, split: str = "train") -> list[FieldSnapshots]:
    """One FieldSnapshots per task over its `split` rows."""
    return [FieldSnapshots(task_path(cfg, task), task_split(cfg, i, split)[0], reduce_x=task.reduce_x,
                           reduce_t=task.reduce_t, task_id=i, task=task.spec) for i, task in enumerate(cfg.data.tasks)]


def pair_datasets(cfg: Config, split: str = "train") -> list[FieldTrajectoryPairs]:
    """One FieldTrajectoryPairs per task over its `split` rows, `operator.horizon` steps apart."""
    return [FieldTrajectoryPairs(task_path(cfg, task), task_split(cfg, i, split)[0], reduce_x=task.reduce_x,
                                 reduce_t=task.reduce_t, horizon=cfg.operator.horizon, task_id=i, task=task.spec)
            for i, task in enumerate(cfg.data.tasks)]


def source_operator(cfg: Config, info: DistInfo) -> nn.Module:
    """The operator as the operator stage starts it (the source's weights, a new task's row the seeded
    draw it starts from: `entry.stages.stage_build.from_source`), frozen and whole on every rank, placed
    as every frozen helper network is (`entry.models.weights.frozen_placed`)."""
    model = seeded(from_source(lambda: build_operator(cfg), cfg, FORECAST_STAGE), cfg)
    return frozen_placed(model, info, compile=cfg.training.compile)


def field_loader(cfg: Config, info: DistInfo, datasets: list):
    """Single-task field batches of `datasets`, sharded over ranks; a `ConfigError` when no task
    has the frames for one global batch (every batch holds one task's frames)."""
    most = max(len(d) for d in datasets)
    if most < cfg.autoencoder.batch_size:
        raise ConfigError(f"autoencoder.batch_size ({cfg.autoencoder.batch_size}) is larger than any task's training "
                          f"frames (at most {most}); lower it, e.g. --set autoencoder.batch_size="
                          f"{1 << max(0, most.bit_length() - 1)}, or generate more samples")
    return build_field_loader(datasets, rank=info.rank, world_size=info.world_size,
                              batch_size_per_rank=cfg.autoencoder.batch_size // info.world_size,
                              seed=cfg.training.seed, num_workers=cfg.training.num_workers,
                              prefetch_factor=cfg.training.prefetch_factor, pin_memory=info.device.type == "cuda")


def fit_batches(datasets: list[FieldSnapshots], frames_per_task: int) -> Iterator[TensorDict]:
    """Up to `frames_per_task` frames of every dataset, evenly spaced over it (the same frames on
    every rank, so every rank fits the same codec), in chunks of at most `FIT_CHUNK` frames:
    TensorDicts of `u` and `task_id` (the field codec names the fields by the task)."""
    for ds in datasets:
        if len(ds) == 0:
            continue
        picks = np.unique(np.linspace(0, len(ds) - 1, min(frames_per_task, len(ds))).round().astype(np.int64))
        chunk = max(1, min(FIT_CHUNK, read_budget() // (4 * math.prod(ds.sample_shape))))
        for s in range(0, len(picks), chunk):
            yield ds.gather(picks[s:s + chunk]).select("u", "task_id")


def build(cfg: Config, info: DistInfo, run_dir: Path, logger) -> StageParts:
    """Data, then the model (linear path fitted, then placed, blocks compiled, sharded), then optimizer."""
    datasets = field_datasets(cfg)
    forecast = forecasts_new_fields(cfg)
    loader = field_loader(cfg, info, pair_datasets(cfg) if forecast else datasets)

    def fitted():
        model = build_autoencoder(cfg)
        kept = fit_codec(model, fit_batches(datasets, cfg.autoencoder.fit_frames))
        logger.info(f"autoencoder: linear path fitted ({kept})")
        return model

    fine_tuned = source_weights(cfg, "autoencoder") is not None
    # The average (`autoencoder.ema_decay`) starts as a copy of the fitted (or source) codec, not a fresh build:
    # that would lack the fitted linear path and the fields' normalisation (fitting twice costs minutes).
    model, average = place_with_copy(lambda: started(cfg, datasets, logger) if fine_tuned else fitted(), cfg, info,
                                     copied=cfg.autoencoder.ema_decay > 0)
    optimizer, scheduler = optimizer_for(model, cfg.autoencoder, info)
    frozen = {}
    if forecast:
        frozen["operator"] = source_operator(cfg, info)
        logger.info(f"autoencoder: the new fields {new_fields(cfg)} fitted by reconstruction and by the source "
                    f"operator's one-step forecast (finetune.new_fields: forecast)")
    return StageParts("autoencoder", model, autoencoder_step, autoencoder_step_config(cfg), loader, optimizer,
                      scheduler, frozen=frozen, ema=average)


def started(cfg: Config, datasets: list[FieldSnapshots], logger) -> nn.Module:
    """Fine-tuning's codec: the source run's, its fitted linear path included; only the normalisation
    of the datasets the source never read (`new_datasets`) is fitted here, on their training frames."""
    model = from_source(lambda: build_autoencoder(cfg), cfg, "autoencoder")()
    refit = new_datasets(cfg)
    if refit:
        kept = fit_codec(model, fit_batches(datasets, cfg.autoencoder.fit_frames), only=refit)
        logger.info(f"autoencoder: the new datasets' normalisation fitted on their data ({kept})")
    return model


def frozen(cfg: Config, logger) -> nn.Module | None:
    """What a frozen codec (`finetune.freeze: [autoencoder]`) publishes: None (the source's weights,
    copied) when the source's codec has every dataset of the config; else the source's codec with the
    normalisation of the datasets it never read (`new_datasets`) fitted on their training frames,
    nothing trained (a frozen codec meeting new fields trains their embeddings instead, through `build`:
    entry.training.finetune.trains_new_only)."""
    return started(cfg, field_datasets(cfg), logger) if new_datasets(cfg) else None


def probe(cfg: Config) -> StageProbe:
    """One step of the codec on batches of the largest task's fields (pairs of them through the frozen
    operator under `finetune.new_fields: forecast`)."""
    if not forecasts_new_fields(cfg):
        return StageProbe("autoencoder", lambda: build_autoencoder(cfg), autoencoder_step,
                          autoencoder_step_config(cfg), field_batch(cfg))
    frames = field_batch(cfg)

    def pairs(b: int) -> TensorDict:
        batch = frames(b)
        u = batch.pop("u")
        batch.update({"u_t": u, "u_next": u.clone(), "dt": torch.full((b,), 0.01)})
        return batch

    return StageProbe("autoencoder", lambda: build_autoencoder(cfg), autoencoder_step, autoencoder_step_config(cfg),
                      pairs, frozen={"operator": (lambda: build_operator(cfg), False)})


SPEC = StageSpec("autoencoder", (), (), BASE_SECTIONS, always, lambda c: c.autoencoder, autoencoder_step_config,
                 probe, model=build_autoencoder, evaluated="required", build=build, validates="reconstruction",
                 frozen=frozen)
"""The codec: reads the fields, trained first, required by the evaluation, validated by reconstruction."""
