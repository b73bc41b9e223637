"""The stages, each defined once: what it reads, what its result depends on, when it applies, its
step, what one step holds and runs, how it is built, which cache it trains on, whether it keeps an
average, how it is validated and how it predicts at test time. Everything that walks the stages
reads `STAGES`: the pipeline's order and what a stage command builds first
(entry.training.stage_sequence), the runner (entry.training.runner, through `StageSpec.build`),
the done files' hashes and provenance (entry.training.stage_record), the memory plan (entry.plan)
and the dry-run estimate (entry.training.estimate) through `StageSpec.probe`, validation and the
evaluation's variants through `StageSpec.predict`. The builds and predictions are in
entry/stages/<name>.py; a stage's command (entry/<name>.py) runs its record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from core.steps import autoencoder_step, diffusion_step, operator_step
from entry.config.schema import Config, StageConfig
from entry.distributed.memory_sim import StageProbe
from entry.distributed.process_group import DistInfo
from entry.models.build import (build_autoencoder, build_denoiser, build_operator, latent_tokens,
                                training_grid)
from entry.stages import autoencoder, consistency, diffusion, operator, steady
from entry.stages.parts import StageParts
from entry.stages.settings import (autoencoder_step_config, consistency_step_config, diffusion_step_config,
                                   operator_step_config, steady_step_config)
from entry.stages.steps import consistency_with_operator, steady_pairs_step

Build = Callable[[Config, DistInfo, Path, Any], StageParts]
"""`build(cfg, info, run_dir, logger) -> StageParts`: data, then models (placed, blocks compiled,
sharded), then optimizer, for real training (docs/design.md, distributed rule 1)."""
Predict = Callable[[Config, nn.Module, Any], Callable]
"""`predict(cfg, model, generator) -> step_fn`: how the trained model predicts at test time, drawing
any noise from `generator`; a refiner's step_fn refines the operator's prediction."""


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
    averages: bool = False
    """Whether it keeps a moving average of its weights when its section's `ema_decay` > 0."""
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
    refines: bool = False
    """Whether its prediction refines the operator's (variant "operator+<name>") instead of
    predicting on its own (variant "<name>")."""
    samples: bool = False
    """Whether its prediction draws noise (an ensemble of it has members that differ)."""

    @property
    def trains(self) -> bool:
        """Whether it trains (and exports `<name>.pt`)."""
        return self.section is not None


def _has_steady(cfg: Config) -> bool:
    return any(t.spec.steady for t in cfg.data.tasks)


def _has_dynamic(cfg: Config) -> bool:
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
    task per step; its own channels and task id), random values."""
    i = max(range(len(cfg.data.tasks)), key=lambda k: len(cfg.data.tasks[k].spec.channels)
            * torch.Size(training_grid(cfg.data.tasks[k])).numel())
    shape, channels = training_grid(cfg.data.tasks[i]), len(cfg.data.tasks[i].spec.channels)

    def make(b: int) -> TensorDict:
        return TensorDict({"u": torch.randn(b, channels, *shape), "sample_id": torch.arange(b),
                           "task_id": torch.full((b,), i, dtype=torch.long)}, batch_size=[b])

    return make


def _resident(cfg: Config) -> tuple:
    # Validation keeps the frozen autoencoder resident beside the stage's own networks.
    return (lambda: build_autoencoder(cfg),) if cfg.evaluation.val_every > 0 else ()


def _denoiser(cfg: Config, pdet):
    return lambda: build_denoiser(cfg, pdet)


def _probe_autoencoder(cfg: Config) -> StageProbe:
    return StageProbe("autoencoder", lambda: build_autoencoder(cfg), autoencoder_step, autoencoder_step_config(cfg),
                      field_batch(cfg))


def _probe_operator(cfg: Config) -> StageProbe:
    return StageProbe("operator", lambda: build_operator(cfg), operator_step, operator_step_config(cfg),
                      latent_batch(cfg, cfg.operator.unroll_steps), resident=_resident(cfg))


def _probe_diffusion(cfg: Config) -> StageProbe:
    return StageProbe("diffusion", _denoiser(cfg, cfg.diffusion.pdet), diffusion_step, diffusion_step_config(cfg),
                      latent_batch(cfg), {"operator": (lambda: build_operator(cfg), False)})


def _probe_consistency(cfg: Config) -> StageProbe:
    teacher = _denoiser(cfg, cfg.diffusion.pdet)
    return StageProbe("consistency", _denoiser(cfg, cfg.diffusion.pdet), consistency_with_operator,
                      consistency_step_config(cfg), latent_batch(cfg),
                      {"operator": (lambda: build_operator(cfg), False), "teacher": (teacher, False),
                       "target": (teacher, True)})


def _probe_steady(cfg: Config) -> StageProbe:
    return StageProbe("steady", _denoiser(cfg, cfg.steady.pdet), steady_pairs_step, steady_step_config(cfg),
                      latent_batch(cfg, ndim=2), resident=_resident(cfg))


_BASE = ("data", "latent", "autoencoder", "training")
_ALWAYS = lambda cfg: True  # noqa: E731

STAGES: tuple[StageSpec, ...] = (
    StageSpec("autoencoder", (), (), _BASE, _ALWAYS, lambda c: c.autoencoder, autoencoder_step_config,
              _probe_autoencoder, model=build_autoencoder, evaluated="required", build=autoencoder.build,
              validates="reconstruction"),
    StageSpec("cache", ("autoencoder",), ("autoencoder",), _BASE, _ALWAYS),
    StageSpec("operator", ("cache",), ("autoencoder",), _BASE + ("operator", "evaluation"), _has_dynamic,
              lambda c: c.operator, operator_step_config, _probe_operator, averages=True, model=build_operator,
              evaluated="required", build=operator.build, cache_kind="dynamic", validates="rollout",
              predict=operator.predict),
    StageSpec("diffusion", ("operator",), ("autoencoder", "operator"),
              _BASE + ("operator", "diffusion", "evaluation"), _has_dynamic, lambda c: c.diffusion,
              diffusion_step_config, _probe_diffusion, model=lambda c: build_denoiser(c, c.diffusion.pdet),
              evaluated="optional", build=diffusion.build, cache_kind="dynamic", predict=diffusion.predict,
              refines=True, samples=True),
    StageSpec("consistency", ("diffusion",), ("autoencoder", "operator", "diffusion"),
              _BASE + ("operator", "diffusion", "consistency", "evaluation"), _has_dynamic, lambda c: c.consistency,
              consistency_step_config, _probe_consistency, model=lambda c: build_denoiser(c, c.diffusion.pdet),
              evaluated="optional", build=consistency.build, cache_kind="dynamic", predict=consistency.predict,
              refines=True, samples=True),
    StageSpec("steady", ("cache",), ("autoencoder",), _BASE + ("steady", "evaluation"), _has_steady,
              lambda c: c.steady, steady_step_config, _probe_steady, averages=True,
              model=lambda c: build_denoiser(c, c.steady.pdet), evaluated="required", build=steady.build,
              cache_kind="steady", validates="rollout", predict=steady.predict, samples=True),
)
"""Every stage, in the order the pipeline runs them (evaluation, not a stage of training, follows)."""

SPECS = {spec.name: spec for spec in STAGES}
TRAINING_STAGES = tuple(spec.name for spec in STAGES if spec.trains)


def stage_spec(name: str) -> StageSpec:
    """The record of stage `name`; a `ValueError` naming the stages for another name."""
    if name not in SPECS:
        raise ValueError(f"no stage named {name!r}; stages: {list(SPECS)}")
    return SPECS[name]


def applicable(cfg: Config, name: str) -> bool:
    """Whether stage `name` has anything to do for `cfg` (evaluation always has)."""
    return name not in SPECS or SPECS[name].applies(cfg)


def selected_training_stages(cfg: Config) -> list[str]:
    """The training stages `cfg.stages` selects that have something to train on, in order."""
    return [name for name in cfg.stages if name in TRAINING_STAGES and applicable(cfg, name)]


def upstream(names: list[str]) -> set[str]:
    """Every stage the stages `names` read, transitively (their inputs' inputs too), not `names`."""
    wanted: set[str] = set()
    todo = list(names)
    while todo:
        for dep in SPECS[todo.pop()].reads:
            if dep not in wanted:
                wanted.add(dep)
                todo.append(dep)
    return wanted


def input_stages(cfg: Config, name: str) -> list[str]:
    """Every stage `name` needs done before it runs, in pipeline order (its inputs' inputs too);
    for `evaluate`, the training stages `cfg.stages` selects and theirs."""
    roots = selected_training_stages(cfg) if name == "evaluate" else [name]
    wanted = upstream(roots) | (set(roots) if name == "evaluate" else set())
    return [spec.name for spec in STAGES if spec.name in wanted and spec.applies(cfg)]
