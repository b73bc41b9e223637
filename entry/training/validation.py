"""Validation during training (`StageSpec.validates`: the autoencoder's reconstruction, the operator's
and the steady prior's rollouts; `evaluation.val_every > 0`).

After a stage's build, the runner reads the first `evaluation.val_samples` rows of each task's val
split (drawn from the training part of the file, never the test set) with `with_validation`; the loop
(entry/training/loop.py) scores them every `val_every` steps, as entry.evaluation.scoring scores the test
split: nRMSE of the rollout over predicted steps only, `validation_rollout_steps` of them.

Legend: N samples, T time steps, C channels, S spatial axes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from core.evaluation import MetricSums, accumulate_reconstruction
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.files import task_path, task_split
from entry.distributed.process_group import DistInfo
from entry.evaluation.scoring import evaluate_task
from entry.evaluation.task_frames import given_and_stride, task_label, window
from entry.models.build import build_autoencoder
from entry.models.weights import load_frozen
from entry.stages.parts import StageParts
from entry.stages.record import StageSpec
from entry.training.stage_record import weights_file
from pipelines.task_data import open_task, read_trajectories

VAL_ON_DEVICE_BYTES = 256 * 2 ** 20
"""Validation data up to this size stay on the device between validations; a larger set is moved
there task by task at each validation (evaluate_task scores a task from one tensor)."""

Validate = Callable[[nn.Module], dict[str, float]]
StepFnFor = Callable[[nn.Module, int], Callable]
"""`(model, task_index) -> step_fn(z_BLD, dt_B, task_id_B) -> z_next`, made afresh per validation."""


@dataclass(frozen=True)
class ValidationSet:
    """One task's validation trajectories, read and strided as entry.evaluation.scoring reads test data."""

    task_index: int
    key: str
    """The task's name in metrics (entry.evaluation.task_frames.task_label)."""
    u_NTCS: torch.Tensor
    """Trajectories in the operator's own steps, cut to the scored window (steady: T = 1)."""
    coefficient_NCS: torch.Tensor | None
    """Steady tasks' coefficient fields, else None."""
    given_steps: int
    dt: float


def validation_rollout_steps(cfg: Config) -> int:
    """Predicted steps a validation rollout scores: `evaluation.val_rollout_steps`, else
    `evaluation.rollout_steps` (0: to the end of the stored trajectory)."""
    return cfg.evaluation.val_rollout_steps or cfg.evaluation.rollout_steps


def validation_rows(cfg: Config, task_index: int) -> np.ndarray:
    """File rows validated for a task: the first `evaluation.val_samples` of its val split, which
    `data.split` draws from the training part (never a test row). A ConfigError when it is empty."""
    rows, _ = task_split(cfg, task_index, "val")
    if rows.size == 0:
        task = cfg.data.tasks[task_index]
        raise ConfigError(
            f"data.tasks[{task_index}] ({task.name}): the val split of {task_path(cfg, task)} is empty, but "
            f"evaluation.val_every={cfg.evaluation.val_every} asks for validation; raise "
            f"data.split.val_fraction, generate more samples (data.tasks[{task_index}].samples), or set "
            f"evaluation.val_every=0")
    return rows[: cfg.evaluation.val_samples]


def read_validation_sets(cfg: Config, *, steady: bool) -> list[ValidationSet]:
    """The val trajectories (on the CPU) of every steady task, or of every dynamic one."""
    sets = []
    for i, task in enumerate(cfg.data.tasks):
        if task.spec.steady != steady:
            continue
        with open_task(task_path(cfg, task), task.spec) as reader:
            data = read_trajectories(reader, validation_rows(cfg, i), reduce_x=task.reduce_x, reduce_t=task.reduce_t)
        given, stride = (0, 1) if steady else given_and_stride(task, cfg)
        u = data.u[:, ::stride]
        if not steady:
            u = u[:, :window(u.shape[1], given, validation_rollout_steps(cfg), where=f"data.tasks[{i}]")]
        # The time step as entry.evaluation.scoring computes it, so validation and test scores compare.
        dt = float(data.t[1] - data.t[0]) * stride if data.t is not None and len(data.t) > 1 else 0.0
        coef = None if data.coefficient is None else torch.from_numpy(data.coefficient)
        sets.append(ValidationSet(i, task_label(cfg, i), torch.from_numpy(np.ascontiguousarray(u)), coef, given, dt))
    return sets


def reconstruction_scores(sets: list[ValidationSet], reconstruct: Callable[[torch.Tensor, int], torch.Tensor],
                          device: torch.device) -> dict[str, float]:
    """`{task_label: nRMSE of reconstruct(u, task_index) against u}` over each set's scored frames
    (steady: the solution and the coefficient field, both of which the codec must carry)."""
    out = {}
    for s in sets:
        u = s.u_NTCS.to(device)
        frames = u if s.coefficient_NCS is None else torch.cat([u, s.coefficient_NCS.to(device)[:, None]], 1)
        sums = MetricSums.zeros(u.shape[2], frames.shape[1], s.given_steps, False, device)
        accumulate_reconstruction(sums, frames, encode=lambda x: reconstruct(x, s.task_index),  # noqa: B023
                                  decode=lambda x, grid: x)
        out[s.key] = sums.summary()["nrmse"]
    return out


def build_reconstruction_validation(cfg: Config, info: DistInfo) -> Validate | None:
    """The autoencoder stage's `validate(model) -> {task_label: reconstruction nRMSE}` of the val
    frames (every task), or None when `evaluation.val_every` is 0. Runs the model's forward, so it
    works on a sharded model too."""
    if cfg.evaluation.val_every == 0:
        return None
    sets = read_validation_sets(cfg, steady=False) + read_validation_sets(cfg, steady=True)

    def validate(model: nn.Module) -> dict[str, float]:
        # The task ids tell a field codec which fields a set holds (the other codecs ignore them).
        return reconstruction_scores(sets, lambda u, i: model(u, torch.full(u.shape[:1], i, device=u.device))[1],
                                     info.device)

    return validate


def build_validation(cfg: Config, info: DistInfo, run_dir: Path, *, steady: bool,
                     step_fn_for: StepFnFor) -> tuple[Validate | None, dict[str, float]]:
    """A stage's `validate(model) -> {task_label: nRMSE}` (None when `evaluation.val_every` is 0) and
    the fixed floor under it, `{"val_recon_nrmse/<task_label>": nRMSE}` of the frozen codec on the
    same frames.

    Reads the val rows of the stage's tasks once and loads the frozen autoencoder. Scores with `entry.evaluation.scoring.evaluate_task` as the final
    evaluation scores the test split: nRMSE over the predicted steps of `validation_rollout_steps`. Every
    rank scores every sample: FSDP2 forwards are collectives, so all ranks must run the same
    forwards (an uneven split of the samples would leave some rank short of one).
    """
    if cfg.evaluation.val_every == 0:
        return None, {}
    sets = read_validation_sets(cfg, steady=steady)
    if not sets:
        return None, {}
    ae_file = weights_file(run_dir, "autoencoder")
    if not ae_file.is_file():
        raise ConfigError(f"validation needs the autoencoder weights {ae_file}: train them first with "
                          f"`python -m entry.autoencoder --config CFG`, or set evaluation.val_every=0")
    ae = load_frozen(lambda: build_autoencoder(cfg), ae_file, info, made_by="python -m entry.autoencoder --config CFG",
                     compile=cfg.training.compile)
    size = sum(s.u_NTCS.nbytes + (0 if s.coefficient_NCS is None else s.coefficient_NCS.nbytes) for s in sets)
    if size <= VAL_ON_DEVICE_BYTES:
        sets = [replace(s, u_NTCS=s.u_NTCS.to(info.device), coefficient_NCS=None if s.coefficient_NCS is None
                        else s.coefficient_NCS.to(info.device)) for s in sets]

    def validate(model: nn.Module) -> dict[str, float]:
        out = {}
        for s in sets:
            codec = ae.for_task(s.task_index)
            summary = evaluate_task(
                cfg.data.tasks[s.task_index], s.task_index, s.u_NTCS.to(info.device), given_steps=s.given_steps,
                dt=s.dt, encode=codec.encode, step_fn=step_fn_for(model, s.task_index), decode=codec.decode,
                coefficient_NCS=None if s.coefficient_NCS is None else s.coefficient_NCS.to(info.device),
                rollout_steps=validation_rollout_steps(cfg))
            out[s.key] = summary["nrmse"]
        return out

    with torch.no_grad():
        def floor_of(u: torch.Tensor, i: int) -> torch.Tensor:
            codec = ae.for_task(i)
            return codec.decode(codec.encode(u), tuple(u.shape[2:]))

        floor = reconstruction_scores(sets, floor_of, info.device)
    return validate, {f"val_recon_nrmse/{k}": v for k, v in floor.items()}


def prediction_for(spec: StageSpec, cfg: Config, info: DistInfo) -> StepFnFor:
    """`(model, task_index) -> step_fn` for validating `spec`: its prediction at test time
    (`StageSpec.predict`), drawing from a generator seeded afresh at each call with the training
    seed plus the task's index, identically on every rank, so that successive validations differ
    only by the weights and every rank computes the same numbers."""
    def for_task(model: nn.Module, task_index: int) -> Callable:
        generator = torch.Generator(info.device).manual_seed(cfg.training.seed + task_index)
        return spec.predict(cfg, model, generator)

    return for_task


def with_validation(spec: StageSpec, cfg: Config, info: DistInfo, run_dir: Path, parts: StageParts) -> StageParts:
    """`parts` (what `spec.build` returned) with the validation `spec.validates` names, and its floor;
    unchanged when the stage validates nothing or `evaluation.val_every` is 0."""
    if spec.validates == "reconstruction":
        return replace(parts, validate=build_reconstruction_validation(cfg, info))
    if spec.validates == "rollout":
        validate, floor = build_validation(cfg, info, run_dir, steady=spec.cache_kind == "steady",
                                           step_fn_for=prediction_for(spec, cfg, info))
        return replace(parts, validate=validate, val_extras=floor)
    return parts
