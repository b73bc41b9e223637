"""Which frames of which trajectories a task's evaluation reads, and its name in the results:
the test rows, or the val rows for `evaluation.split: val` (an empty split is a config error
before any training), the given steps and
the time stride of the operator's horizon, the window of steps scored, the task's label. Read by
the evaluation, the stages' validation and the benchmarks."""

from __future__ import annotations

import math

import numpy as np

from entry.config.load import ConfigError
from entry.config.schema import Config, TaskConfig
from entry.data.files import task_path, task_split


def task_label(cfg: Config, i: int) -> str:
    """The task's name in eval.json and plot files (with its parameter when two tasks share a name)."""
    task = cfg.data.tasks[i]
    same = sum(t.name == task.name for t in cfg.data.tasks)
    return task.name if same == 1 else f"{task.name}_param{task.param:g}"


def require_scored_rows(cfg: Config, i: int) -> tuple[np.ndarray, int]:
    """Task i's rows the evaluation scores (its `evaluation.split`: test, or val) and the file's
    stored step count; a `ConfigError` naming the file and the fix when that split is empty (the
    pipeline asks before training, not after)."""
    task, split = cfg.data.tasks[i], cfg.evaluation.split
    rows, layout = task_split(cfg, i, split)
    if rows.size == 0:
        fraction = getattr(cfg.data.split, f"{split}_fraction")
        need = math.ceil(1 / fraction) if fraction > 0 else "more"
        where = "the first" if split == "test" else "a random"
        raise ConfigError(f"data.tasks[{i}] ({task.name}): {task_path(cfg, task)} has {layout.n_samples} samples, "
                          f"so its {split} split ({where} {fraction:g} of the file) is empty; "
                          f"generate at least {need} samples (data.tasks[{i}].samples) or raise "
                          f"data.split.{split}_fraction")
    return rows, layout.n_steps


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


def window(num_steps: int, given_steps: int, rollout_steps: int, *, where: str = "data.tasks[i]") -> int:
    """Frames scored: the given ones plus ``rollout_steps`` predictions (0: to the end of the file)."""
    if not 1 <= given_steps < num_steps:
        raise ConfigError(f"initial_step={given_steps} leaves no step to predict in a trajectory of "
                          f"{num_steps} stored steps (after reduce_t); lower {where}.initial_step")
    return num_steps if rollout_steps == 0 else min(num_steps, given_steps + rollout_steps)
