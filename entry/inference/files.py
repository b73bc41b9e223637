"""A surrogate's initial frames read from a data file in any layout the stack reads, and its rollout
written back beside them (`entry.predict`).

Legend: N trajectories, T time steps (T0 given), C channels, S spatial axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from entry.config.errors import InputError
from entry.config.schema import TaskConfig
from entry.inference.surrogate import TaskInfo
from entry.storage.atomic import atomic_write
from entry.storage.probe import write_refusal
from pipelines.layouts import DatasetDescription, describe, read_windows
from pipelines.layouts.write_rollout import OUT_LAYOUTS, write_rollout


def require_out(out: Path, written: list[Path], *, force: bool) -> None:
    """An `InputError` of one line unless a command may write `written` (its ``--out``, or the files
    it names beside it): none exists unless `force` replaces it, and the folder of `out` exists and takes a file.
    Checked before anything is computed (entry.predict, entry.export)."""
    for path in written:
        if path.exists() and not force:
            raise InputError(f"--out {path} exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise InputError(f"--out {out}: no folder {out.parent}")
    if (why := write_refusal(out.parent)) is not None:
        raise InputError(f"--out {out}: cannot write in {out.parent} ({why}); choose a folder this user can write")


@dataclass(frozen=True, kw_only=True, slots=True)
class InitialFrames:
    """The frames a rollout starts from, and what the file says of them."""

    u_NTCS: np.ndarray
    """[N, T0, C, *S] float32 at the run's grid, one frame per operator step."""
    rows: np.ndarray
    """The trajectories' indices in the file (their noise ids)."""
    desc: DatasetDescription
    x_step: int
    """Grid points kept per axis (the task's ``reduce_x`` for a file at its stored resolution, else 1)."""
    time_step: float | None
    """The file's time between two of those frames, None when it stores no times."""
    t0: float
    """The time of the first frame."""


def parse_rows(text: str | None, n: int, path) -> np.ndarray:
    """Trajectories ``A:B`` (Python's slice, either end optional) of a file of `n`; None: all."""
    if text is None:
        return np.arange(n)
    try:
        start, stop = (int(p) if p else None for p in text.split(":"))
    except ValueError:
        raise InputError(f"--rows {text!r}: expected START:STOP, e.g. 0:8") from None
    rows = np.arange(n)[slice(start, stop)]
    if rows.size == 0:
        raise InputError(f"--rows {text}: selects none of the {n} trajectories of {path}")
    return rows


def read_initial(path: str | Path, info: TaskInfo, task: TaskConfig, *, layout: str = "auto",
                 rows: str | None = None) -> InitialFrames:
    """The first `info.given_steps` frames (one per operator step) of each trajectory in the file at
    `path`, read by `layout` (``auto`` recognises PDEBench's and The Well's files; the run's task
    decides a declared layout's options) at the run's grid. Raises `DataError` for a file no layout
    reads and `InputError` for one that does not fit the task (its channels, grid, steps)."""
    options = task.hdf5.options() if layout == "hdf5" and task.hdf5 is not None else None
    descs = describe(path, layout, options=options)
    if len(descs) != 1:
        raise InputError(f"{path} holds {len(descs)} datasets; name one file")
    (desc,) = descs
    if desc.steady:
        raise InputError(f"{path} holds steady data; entry.predict rolls out time-dependent tasks "
                         f"(map a coefficient with load_run(...).solve)")
    if tuple(desc.channels) != info.channels:
        raise InputError(f"{path} holds fields {list(desc.channels)}; the run's task {info.name} has "
                         f"{list(info.channels)}")
    stored = tuple(desc.grid.shape)
    x_step = 1 if stored == info.grid else task.reduce_x
    if tuple(len(range(0, n, x_step)) for n in stored) != info.grid:
        raise InputError(f"{path} has a grid of {list(stored)} points; the run's task {info.name} takes "
                         f"{list(info.grid)} (or its stored grid, every {task.reduce_x}th point kept)")
    g, stride = info.given_steps, info.frame_stride
    if desc.steps < (g - 1) * stride + 1:
        raise InputError(f"{path} stores {desc.steps} steps; the run starts from frame {(g - 1) * stride} "
                         f"(given_steps {g}, every {stride}th frame)")
    picked = parse_rows(rows, desc.trajectories, path)
    u = np.stack(read_windows(desc, picked, t_stop=(g - 1) * stride + 1, t_step=stride, x_step=x_step))
    # The evaluation's time step: the kept frames' spacing times operator.horizon (entry.evaluation.scoring).
    t = None if desc.times is None else desc.times[::task.reduce_t]
    dt = None if t is None or len(t) < 2 else float(t[1] - t[0]) * (stride // task.reduce_t)
    return InitialFrames(u_NTCS=u, rows=picked, desc=desc, x_step=x_step, time_step=dt,
                         t0=0.0 if desc.times is None else float(desc.times[0]))


def write_predictions(out: str | Path, layout: str, frames: InitialFrames, u_NTCS: np.ndarray, time_step: float,
                      attrs: dict) -> Path:
    """Write the rollout `u_NTCS` (given frames first) of `frames` to `out` in `layout`
    (`OUT_LAYOUTS`), atomically: `out` is the whole file or as it was."""
    if layout not in OUT_LAYOUTS:
        raise InputError(f"--out-layout {layout!r}: one of {', '.join(OUT_LAYOUTS)}")
    d = frames.desc
    coords = tuple(np.asarray(c)[::frames.x_step] for c in d.grid.coords)
    times = frames.t0 + time_step * np.arange(u_NTCS.shape[1])
    return atomic_write(out, lambda tmp: write_rollout(
        tmp, layout, u_NTCS=u_NTCS, fields=d.fields, axes=d.grid.axes, coords=coords, times=times,
        periodic=tuple(d.grid.periodic), name=d.name, parameters=dict(d.parameters), attrs=attrs))
