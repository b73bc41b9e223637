"""What a stage's record holds (`StageSpec`), and the blocks the records share: when a stage
applies, the config sections every stage depends on, and the makers of probe batches of the
training shapes. Each stage's module (entry/stages/<name>.py) defines its record, `SPEC`, from
these; entry.stages.record collects them in pipeline order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from entry.config.schema import STAGE_CONFIGS, Config, StageConfig
from entry.distributed.memory_sim import StageProbe
from entry.distributed.process_group import DistInfo
from entry.models.build import build_autoencoder, latent_tokens, training_grid
from entry.stages.parts import StageParts

Build = Callable[[Config, DistInfo, Path, Any], StageParts]
"""`build(cfg, info, run_dir, logger) -> StageParts`: data, then models (placed, blocks compiled,
sharded), then optimizer, for real training (docs/design.md, distributed rule 1)."""
Predict = Callable[[Config, nn.Module, Any], Callable]
"""`predict(cfg, model, generator) -> step_fn`: how the trained model predicts at test time, drawing
any noise from `generator`; a refiner's step_fn refines the prediction of the stage it refines."""


@dataclass(frozen=True)
class StageSpec:
    """One stage of the pipeline, as every part of the stack sees it."""

    name: str
    reads: tuple[str, ...]
    """The stages whose results it reads (weights or the latent cache); the data come first for all."""
    weights_read: tuple[str, ...]
    """Earlier stages whose exported weights its result depends on (directly, or through the latent
    cache their encoder wrote): recorded in its done file by fingerprint."""
    sections: tuple[str, ...]
    """Config sections its result depends on, its own and its inputs' (evaluation: the validation
    that picks the weights). Changing the operator does not retrain the autoencoder."""
    applies: Callable[[Config], bool]
    """Whether the config has anything for it to do (no steady task: no steady prior)."""
    section: Callable[[Config], StageConfig] | None = None
    """Its own config section (steps, batch, optimizer); None for a stage that trains nothing."""
    step_config: Callable[[Config], object] | None = None
    """Its step's settings as the config gives them (a build adds what it measures, e.g. sigma_data)."""
    probe: Callable[[Config], StageProbe] | None = None
    """What one optimizer step builds, holds frozen and runs, on batches of the training shapes."""
    model: Callable[[Config], nn.Module] | None = None
    """Builds the model it exports, untrained (what its weights load into)."""
    evaluated: str = ""
    """What the evaluation needs of its weights where it applies: "required", "optional" (a
    variant scored when present) or "" (nothing)."""
    build: Build | None = None
    """Builds what its training runs (`StageParts`); None for a stage that trains nothing."""
    cache_kind: str = ""
    """The latent cache it trains on ("dynamic" or "steady"); "" for none (it reads the fields)."""
    validates: str = ""
    """What validation during training scores (`evaluation.val_every > 0`): "rollout" (its
    predictions rolled out over the validation trajectories of its cache kind's tasks),
    "reconstruction" (the codec's) or "" (nothing)."""
    predict: Predict | None = None
    """How its trained model predicts at test time (validation and evaluation); None: it is not a
    variant of its own (the codec)."""
    refines: str = ""
    """The stage whose prediction its prediction refines (variant "<refines>+<name>"); "": it
    predicts on its own (variant "<name>")."""
    samples: bool = False
    """Whether its prediction draws noise (an ensemble of it has members that differ)."""
    frozen: Callable[[Config, object], nn.Module | None] | None = None
    """`frozen(cfg, logger)`: what the stage publishes when `finetune.freeze` names it and the source's
    weights alone do not serve the config (a field codec meeting datasets it never read: their
    normalisation fitted, nothing trained), built unplaced on rank 0; None (or a None result): the
    source's weights are copied as they are."""

    @property
    def trains(self) -> bool:
        """Whether it trains (and exports `<name>.pt`)."""
        return self.section is not None

    @property
    def averages(self) -> bool:
        """Whether it keeps a moving average of its weights when its section's `ema_decay` > 0 (its
        section says: `StageConfig.KEEPS_AVERAGE`)."""
        return self.trains and STAGE_CONFIGS[self.name].KEEPS_AVERAGE


BASE_SECTIONS = ("data", "latent", "autoencoder", "training", "finetune")
"""The config sections every stage's result depends on: the data and the codec that encodes them."""


def always(cfg: Config) -> bool:
    """A stage every config has something for."""
    return True


def has_steady(cfg: Config) -> bool:
    """Whether the config has a steady task."""
    return any(t.spec.steady for t in cfg.data.tasks)


def has_dynamic(cfg: Config) -> bool:
    """Whether the config has a time-dependent task."""
    return any(not t.spec.steady for t in cfg.data.tasks)


def latent_batch(cfg: Config, unroll: int = 1, *, ndim: int = 1) -> Callable[[int], TensorDict]:
    """A maker of latent-pair batches of `b` samples as the cache loader yields them (with z_seq
    when unrolled), of the tokens of `ndim`-dimensional fields; values are random (a step's cost
    and memory do not depend on them)."""
    tokens = latent_tokens(cfg, ndim)

    def make(b: int) -> TensorDict:
        z = lambda *lead: torch.randn(b, *lead, tokens, cfg.latent.dim)  # noqa: E731
        out = {"z_t": z(), "z_next": z(), "dt": torch.full((b,), 0.01), "task_id": torch.zeros(b, dtype=torch.long),
               "sample_id": torch.arange(b), "t": torch.zeros(b, dtype=torch.long)}
        if unroll > 1:
            out["z_seq"] = z(unroll)
        return TensorDict(out, batch_size=[b])

    return make


def field_batch(cfg: Config) -> Callable[[int], TensorDict]:
    """A maker of the autoencoder's batches of `b` fields of the task with the largest field (one
    task per step; its own channels and task id), random values. The task id is also given on the host
    (``task``): the memory plan's tensors have no values a field codec could read it from."""
    i = max(range(len(cfg.data.tasks)), key=lambda k: len(cfg.data.tasks[k].spec.channels)
            * torch.Size(training_grid(cfg.data.tasks[k])).numel())
    shape, channels = training_grid(cfg.data.tasks[i]), len(cfg.data.tasks[i].spec.channels)

    def make(b: int) -> TensorDict:
        batch = TensorDict({"u": torch.randn(b, channels, *shape), "sample_id": torch.arange(b),
                            "task_id": torch.full((b,), i, dtype=torch.long)}, batch_size=[b])
        batch.set_non_tensor("task", i)
        return batch

    return make


def validation_resident(cfg: Config) -> tuple:
    """What a stage validated by rollouts keeps resident beside its own networks: the frozen
    autoencoder when `evaluation.val_every > 0`, else nothing (`StageProbe.resident`)."""
    return (lambda: build_autoencoder(cfg),) if cfg.evaluation.val_every > 0 else ()
