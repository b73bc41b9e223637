"""The trivial predictions every model must beat, stepping in field space through an identity codec:
persistence (the last given frame, repeated) for time-dependent tasks, and the mean of the training
split's solutions for steady ones. Evaluation and bench.accuracy score them beside our models."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from core.evaluation import StepFn
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.files import task_path, task_split
from pipelines.pdebench_io import open_pdebench


class IdentityCodec:
    """The 'codec' the trivial references step in: fields are their own latents."""

    @staticmethod
    def encode(u: Tensor) -> Tensor:
        return u

    @staticmethod
    def decode(u: Tensor, grid: tuple[int, ...]) -> Tensor:
        return u


def reference_models(cfg: Config, task_index: int, steady: bool, device) -> dict[str, StepFn]:
    """The trivial predictions a model must beat, stepping in field space: persistence (the last
    given frame, repeated) for time-dependent tasks; the mean of the training split's solutions
    for steady ones (whatever the coefficient)."""
    if not steady:
        return {"persistence": persistence_step}
    return {"mean_solution": mean_solution_step(training_mean_solution(cfg, task_index).to(device))}


def persistence_step(u: Tensor, dt: Tensor, task_id: Tensor) -> Tensor:
    """The persistence reference's step in field space: the frame, unchanged."""
    return u


def mean_solution_step(mean_CS: Tensor) -> StepFn:
    """The steady reference's step in field space: ``mean_CS`` whatever the coefficient."""
    return lambda u, dt, task_id: mean_CS.expand(u.shape[0], *mean_CS.shape)


def training_mean_solution(cfg: Config, task_index: int) -> Tensor:
    """Mean of the training split's solution fields of a steady task, read in chunks. -> [C, *S]."""
    task = cfg.data.tasks[task_index]
    rows, _ = task_split(cfg, task_index, "train")
    total, count = None, 0
    with open_pdebench(task_path(cfg, task), task=task.spec) as f:
        for s in range(0, len(rows), 256):
            u = f.read(rows[s:s + 256], reduce_x=task.reduce_x).u[:, 0].astype(np.float64)  # [n, C, *S]
            total = u.sum(0) if total is None else total + u.sum(0)
            count += len(u)
    if count == 0:
        raise ConfigError(f"data.tasks[{task_index}] ({task.name}): the training split is empty; "
                          f"generate more samples (data.tasks[{task_index}].samples)")
    return torch.from_numpy(total / count).float()
