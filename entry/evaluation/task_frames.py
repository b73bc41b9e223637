"""Which frames of which trajectories a task's evaluation reads, and its name in the results:
the test rows, or the val rows for `evaluation.split: val` (an empty split is a config error
before any training), the given steps and
the time stride of the operator's horizon, the window of steps scored, the task's label. Read by
the evaluation, the stages' validation and the benchmarks."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from entry.config.load import ConfigError
from entry.config.schema import Config, TaskConfig
from entry.data.files import task_path, task_split
from pipelines.memory import available_memory


def task_label(cfg: Config, i: int) -> str:
    """The task's name in eval.json and plot files (with its parameter when two tasks share a name)."""
    task = cfg.data.tasks[i]
    same = sum(t.name == task.name for t in cfg.data.tasks)
    return task.name if same == 1 else f"{task.name}_param{task.param:g}"


EVAL_BATCH = 16
"""Trajectories rolled out together (bounds decode memory on long rollouts)."""
SMALL_EVAL_SAMPLES = 4
"""Test samples per task in the pipeline's quick evaluation (`--small`)."""
ENSEMBLE_MEMORY_SHARE = 2
"""An evaluation ensemble's predictions of one batch may take at most 1/2 of the available memory."""


def require_ensemble_fits(cfg: Config, i: int, n_rows: int, n_steps: int, spatial: tuple[int, ...],
                          log: Callable[[str], None] | None = None) -> None:
    """Estimate what `evaluation.ensemble_members` (K) costs task i (`n_rows` scored trajectories of
    `n_steps` stored steps on the `spatial` grid) and report it through `log`: K rollouts per
    trajectory and stochastic variant, and the K predicted trajectories of a batch held at once
    (twice: the members and their stack). A `ConfigError` when those exceed 1/`ENSEMBLE_MEMORY_SHARE`
    of the available memory (pipelines.memory), before any of it is allocated."""
    task, k = cfg.data.tasks[i], cfg.evaluation.ensemble_members
    if k == 1 or task.spec.steady:
        return
    values = len(task.spec.channels) * math.ceil(n_steps / task.reduce_t)
    values *= math.prod(math.ceil(n / task.reduce_x) for n in spatial)
    held = 2 * k * min(EVAL_BATCH, max(n_rows, 1)) * values * 4
    if log is not None:
        log(f"evaluate: ensemble of {k} members on {task_label(cfg, i)}: {k * n_rows} rollouts per stochastic "
            f"variant, {held / 2**30:.3g} GiB of predictions held per batch of {EVAL_BATCH}")
    available = available_memory()
    if available is not None and held > available // ENSEMBLE_MEMORY_SHARE:
        most = max(1, k * (available // ENSEMBLE_MEMORY_SHARE) // held)
        raise ConfigError(f"evaluation.ensemble_members={k}: task {task_label(cfg, i)}'s ensemble would hold "
                          f"{held / 2**30:.3g} GiB of predicted trajectories per batch of {EVAL_BATCH}, more than "
                          f"1/{ENSEMBLE_MEMORY_SHARE} of the {available / 2**30:.3g} GiB of memory available; "
                          f"use at most --set evaluation.ensemble_members={most}")


def require_scored_rows(cfg: Config, i: int, log: Callable[[str], None] | None = None) -> tuple[np.ndarray, int]:
    """Task i's rows the evaluation scores (its `evaluation.split`: test, or val) and the file's
    stored step count; a `ConfigError` naming the file and the fix when that split is empty, or
    when its ensemble does not fit in memory (`require_ensemble_fits`, whose estimate goes to
    `log`): the pipeline asks before training, not after."""
    task, split = cfg.data.tasks[i], cfg.evaluation.split
    rows, desc = task_split(cfg, i, split)
    if rows.size == 0:
        fraction = getattr(cfg.data.split, f"{split}_fraction")
        need = math.ceil(1 / fraction) if fraction > 0 else "more"
        where = "the first" if split == "test" else "a random"
        raise ConfigError(f"data.tasks[{i}] ({task.name}): {task_path(cfg, task)} has {desc.trajectories} samples, "
                          f"so its {split} split ({where} {fraction:g} of the file) is empty; "
                          f"generate at least {need} samples (data.tasks[{i}].samples) or raise "
                          f"data.split.{split}_fraction")
    n_rows = min(rows.size, cfg.evaluation.max_test_samples or rows.size)
    require_ensemble_fits(cfg, i, n_rows, desc.steps, desc.grid.shape, log)
    return rows, desc.steps


def given_and_stride(task: TaskConfig, cfg: Config) -> tuple[int, int]:
    """Given steps and time stride in the operator's own steps (horizon h: every h-th stored frame,
    keeping frame initial_step - 1 as the rollout's start)."""
    h = cfg.operator.horizon
    if h == 1:
        return task.initial_step, 1
    if (task.initial_step - 1) % h:
        raise ConfigError(f"operator.horizon={h} needs initial_step - 1 divisible by it to start the rollout "
                          f"on a stored frame; got initial_step={task.initial_step}")
    return (task.initial_step - 1) // h + 1, h


def scored_steps(cfg: Config, i: int, stored: int) -> tuple[int, int, int]:
    """(given steps, time stride, frames scored) of task i, whose trajectories store `stored` steps:
    the frames the evaluation scores every variant and reference on, and the peers beside them (a
    steady task: 0, 1, 1)."""
    task = cfg.data.tasks[i]
    if task.spec.steady:
        return 0, 1, 1
    g, stride = given_and_stride(task, cfg)
    return g, stride, window(len(range(0, stored, task.reduce_t * stride)), g, cfg.evaluation.rollout_steps,
                             where=f"data.tasks[{i}]")


def window(num_steps: int, given_steps: int, rollout_steps: int, *, where: str = "data.tasks[i]") -> int:
    """Frames scored: the given ones plus ``rollout_steps`` predictions (0: to the end of the file)."""
    if not 1 <= given_steps < num_steps:
        raise ConfigError(f"initial_step={given_steps} leaves no step to predict in a trajectory of "
                          f"{num_steps} stored steps (after reduce_t); lower {where}.initial_step")
    return num_steps if rollout_steps == 0 else min(num_steps, given_steps + rollout_steps)
