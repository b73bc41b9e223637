"""The trivial predictions every model must beat, stepping in field space through an identity codec:
persistence (the last given frame, repeated) and the training mean (the climatology a chaotic flow's
long forecasts fall back to) for time-dependent tasks, and the mean of the training split's
solutions for steady ones. Evaluation and bench.accuracy score them beside our models."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from core.evaluation import StepFn
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.files import task_path, task_split
from pipelines.task_data import open_task, read_trajectories


class IdentityCodec:
    """The 'codec' the trivial references step in: fields are their own latents."""

    @staticmethod
    def encode(u: Tensor) -> Tensor:
        return u

    @staticmethod
    def decode(u: Tensor, grid: tuple[int, ...]) -> Tensor:
        return u


MEAN_READ_ROWS = 8
"""Rows a training mean reads at a time: whole trajectories in float64, so a few at once keep the
evaluation's memory near one batch of its own."""
TRAINING_MEAN_TRAJECTORIES = 64
"""Training trajectories a time-dependent task's training mean averages (all their steps): enough
for the mean field, and a bounded read of a large file."""


def reference_models(cfg: Config, task_index: int, steady: bool, device) -> dict[str, StepFn]:
    """The trivial predictions a model must beat, stepping in field space: for time-dependent tasks
    persistence (the last given frame, repeated) and the training mean (the mean field over the first
    `TRAINING_MEAN_TRAJECTORIES` training trajectories and all their steps, whatever the state); for
    steady ones the mean of the training split's solutions (whatever the coefficient)."""
    if not steady:
        mean = training_mean_field(cfg, task_index, max_rows=TRAINING_MEAN_TRAJECTORIES)
        return {"persistence": persistence_step, "training_mean": mean_solution_step(mean.to(device))}
    return {"mean_solution": mean_solution_step(training_mean_field(cfg, task_index).to(device))}


def persistence_step(u: Tensor, dt: Tensor, task_id: Tensor) -> Tensor:
    """The persistence reference's step in field space: the frame, unchanged."""
    return u


def mean_solution_step(mean_CS: Tensor) -> StepFn:
    """The steady reference's step in field space: ``mean_CS`` whatever the coefficient."""
    return lambda u, dt, task_id: mean_CS.expand(u.shape[0], *mean_CS.shape)


def training_mean_field(cfg: Config, task_index: int, *, max_rows: int | None = None) -> Tensor:
    """Mean of the training split's fields, read in chunks: a steady task's solutions, a
    time-dependent task's frames (every stored step of its trajectories, given ones included), over
    the first ``max_rows`` training rows (None: all). -> [C, *S]."""
    task = cfg.data.tasks[task_index]
    rows, _ = task_split(cfg, task_index, "train")
    rows = rows[:max_rows]
    total, count = None, 0
    with open_task(task_path(cfg, task), task.spec) as reader:
        for s in range(0, len(rows), MEAN_READ_ROWS):
            u = read_trajectories(reader, rows[s:s + MEAN_READ_ROWS], reduce_x=task.reduce_x).u.astype(np.float64)  # [n, T, C, *S]
            u = u.reshape(-1, *u.shape[2:])  # a steady task's T is 1: its solutions
            total = u.sum(0) if total is None else total + u.sum(0)
            count += len(u)
    if count == 0:
        raise ConfigError(f"data.tasks[{task_index}] ({task.name}): the training split is empty; "
                          f"generate more samples (data.tasks[{task_index}].samples)")
    return torch.from_numpy(total / count).float()
