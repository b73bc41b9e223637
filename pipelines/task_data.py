"""A task's data: its file described and checked against the task, and its trajectories read as the
stack takes them.

Legend: N trajectories, T time steps (after reduce_t), C channels, S spatial axes.

Every read of a task's data goes through `pipelines.layouts`: `task_description` describes the file
with the layout the task names (a generated task's file: ``pdebench``; a declared one: its
``layout``), `open_task` opens it for reading, and `read_trajectories` reads rows as
``u`` [N, T, C, *S] float32 with a steady task's input field (Darcy's ``nu``) beside it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines.layouts import DataError, DatasetDescription, DatasetReader, describe
from pipelines.tasks import TaskSpec, get_task, parse_file_name

__all__ = ["Trajectories", "task_description", "task_name", "open_task", "read_trajectories", "read_task"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Trajectories:
    """Rows of a task read as the stack takes them (see the module legend)."""

    u: np.ndarray
    """[N, T, C, *S] float32 (a steady task: T = 1, the solution)."""
    coefficient: np.ndarray | None
    """[N, C, *S] float32: a steady task's input field (Darcy's ``nu``, the steady prior's
    condition), else None."""
    t: np.ndarray | None
    """[T] float64 times of ``u`` (None for a steady task)."""
    coords: tuple[np.ndarray, ...]
    """One float64 coordinate array per spatial axis, reduced like ``u``."""


def _one(path, descs: tuple[DatasetDescription, ...]) -> DatasetDescription:
    if len(descs) != 1:
        raise DataError(f"{path}: holds {len(descs)} tasks ({', '.join(d.identity for d in descs)}); "
                        f"name one file or folder per task")
    return descs[0]


def task_description(path: str | os.PathLike, task: str | TaskSpec | None = None) -> DatasetDescription:
    """The description of task `task`'s data at `path`, from metadata (kept per version of the file).

    Args:
        path: the task's file (a declared task's: a file, folder or glob).
        task: a generated task's name or spec (its file is read by the ``pdebench`` layout and must
            hold the task's dimension and channels), a declared task's spec (read by its layout
            and options), or None (the layout that recognises the file).
    Raises:
        DataError: the file is missing, its layout cannot read it, or it is not the task's.
    """
    spec = get_task(task) if isinstance(task, str) else task
    if spec is not None and spec.storage == "declared":
        desc = _one(path, describe(path, spec.source_layout, options=json.loads(spec.source_options or "{}")))
        if desc.channels != spec.channels:
            raise DataError(f"{path}: holds channels {list(desc.channels)}, but the config was read with "
                            f"{list(spec.channels)}: the file changed; run the command again")
        return desc
    if not Path(path).is_file():
        problem = "is a directory, not an HDF5 file" if Path(path).is_dir() else "no such file"
        raise DataError(f"{path}: {problem}")
    desc = _one(path, describe(path, "pdebench" if spec else "auto"))
    if spec is not None and (desc.dims, desc.steady, desc.channels) != (spec.spatial_dims, spec.steady, spec.channels):
        raise DataError(f"{path}: holds a {desc.dims}D {'steady ' if desc.steady else ''}field of channels "
                        f"{list(desc.channels)}, but task {spec.name} is {spec.spatial_dims}D "
                        f"{'steady ' if spec.steady else ''}with channels {list(spec.channels)}")
    return desc


def task_name(path: str | os.PathLike, task: str | TaskSpec | None, desc: DatasetDescription) -> str:
    """`task`'s name; without one, the generated task a PDEBench file name names, else the data's identity."""
    if task is not None:
        return task if isinstance(task, str) else task.name
    parsed = parse_file_name(Path(path).name)
    return parsed[0].name if parsed else desc.identity


def open_task(path: str | os.PathLike, task: str | TaskSpec | None = None) -> DatasetReader:
    """A `DatasetReader` of task `task`'s data at `path` (see `task_description`); close it (a
    context manager)."""
    return DatasetReader(task_description(path, task))


def read_trajectories(reader: DatasetReader, rows, *, reduce_x: int = 1, reduce_t: int = 1) -> Trajectories:
    """Rows `rows` (in that order, repeats allowed) of `reader`'s data, every `reduce_x`-th point
    per axis and every `reduce_t`-th step (PDEBench's reduced_resolution / reduced_resolution_t;
    a steady task keeps its one solution)."""
    if reduce_x < 1 or reduce_t < 1:
        raise ValueError(f"reduce_x and reduce_t must be >= 1, got {reduce_x}, {reduce_t}")
    desc = reader.desc
    u = reader.windows(rows, t_step=1 if desc.steady else reduce_t, x_step=reduce_x)
    coefficient = reader.constants(rows, x_step=reduce_x) if desc.steady else None
    t = None if desc.steady else np.asarray(desc.times[::reduce_t], dtype=np.float64)
    coords = tuple(np.asarray(c[::reduce_x], dtype=np.float64) for c in desc.grid.coords)
    return Trajectories(u=u, coefficient=coefficient, t=t, coords=coords)


def read_task(path: str | os.PathLike, rows=None, *, task: str | TaskSpec | None = None, reduce_x: int = 1,
              reduce_t: int = 1) -> Trajectories:
    """`read_trajectories` of rows `rows` (None: all) of task `task`'s data at `path`, its files
    opened for this read only."""
    with open_task(path, task) as reader:
        rows = np.arange(reader.desc.trajectories) if rows is None else rows
        return read_trajectories(reader, rows, reduce_x=reduce_x, reduce_t=reduce_t)
