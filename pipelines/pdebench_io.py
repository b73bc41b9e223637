# long file: one file format, read and written; the reader and the writer share its keys, shapes and checks
"""Read and write PDEBench HDF5 files (1D advection / Burgers, 2D Darcy).

Legend: N samples, T time steps, C channels (always 1 here), X, Y grid points, S spatial axes.

On disk (PDEBench's keys only, see `pipelines.tasks`): 1D ``tensor`` [N, T, X] float32,
``x-coordinate`` [X], ``t-coordinate`` [T + 1]; Darcy ``tensor`` [N, 1, X, Y] (solution),
``nu`` [N, X, Y] (coefficient), ``x-coordinate`` [X], ``y-coordinate`` [Y]. Our own
metadata (seed, solver, generator version) lives in HDF5 attributes only, and the reader
never needs it: a genuine PDEBench file is recognised from its keys, shapes and name.

In memory (`PDEData`): ``u`` [N, T, C, *S] for every task (Darcy: T = 1, the solution),
``coefficient`` [N, C, *S] for Darcy, ``coords`` one array per spatial axis, ``t`` [T].
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from pipelines.atomic import publish
from pipelines.layouts import describe, read_constants_each, read_windows
from pipelines.layouts.description import DataError
from pipelines.layouts.h5 import float_dataset
from pipelines.layouts.pdebench import variant as layout_variant
from pipelines.layouts.sizes import check_file
from pipelines.tasks import TASKS, TaskSpec, get_task, parse_file_name
from pipelines.writer_lock import describe_holder, record_holder, remove_dead_temps, temp_file_for, try_lock, unlock

__all__ = ["DataError", "FileLayout", "PDEData", "PDEBenchFile", "PDEBenchWriter",
           "open_pdebench", "read_pdebench", "write_pdebench", "GENERATOR_VERSION"]

GENERATOR_VERSION = "1"
"""Bumped whenever generated data would change for the same arguments."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FileLayout:
    """What a file holds, read from its metadata only."""

    path: Path
    task: TaskSpec
    param: float | None
    """From the file name, else PDEBench's or our attribute; None if neither says."""
    n_samples: int
    n_steps: int
    """Stored time steps T (1 for steady tasks)."""
    spatial_shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class PDEData:
    """Samples read from one file (see the module legend for shapes)."""

    path: Path
    task: str
    param: float | None
    indices: np.ndarray
    """[N] rows of the file, in the order requested."""
    u: np.ndarray
    """[N, T, C, *S] float32."""
    coords: tuple[np.ndarray, ...]
    """One float array per spatial axis, reduced like ``u``."""
    t: np.ndarray | None
    """[T] times of ``u`` (None for steady tasks)."""
    coefficient: np.ndarray | None
    """[N, C, *S] float32 PDE coefficient (Darcy ``nu``), else None."""


def _shape(f: h5py.File, key: str, path: Path) -> tuple[int, ...]:
    return tuple(float_dataset(f, key, path).shape)


def _attr_float(f: h5py.File, key: str) -> float | None:
    try:
        return float(f.attrs[key])
    except (KeyError, TypeError, ValueError):
        return None


def _infer_task(f: h5py.File, path: Path, task: str | None) -> tuple[TaskSpec, float | None]:
    """Task from (in order) the argument, the PDEBench file name, our attribute, PDEBench's attributes."""
    from_name = parse_file_name(path.name)
    is_2d = "nu" in f
    if task is not None:
        spec = get_task(task)
    elif from_name is not None:
        spec = from_name[0]
    elif is_2d:
        spec = TASKS["darcy2d"]
    else:
        attr_task = f.attrs.get("task")
        attr_task = attr_task.decode() if isinstance(attr_task, bytes) else attr_task
        if attr_task in TASKS:
            spec = TASKS[attr_task]
        elif "Nu" in f.attrs:
            spec = TASKS["burgers1d"]
        elif "beta" in f.attrs:
            spec = TASKS["advection1d"]
        else:
            raise DataError(f"{path}: cannot tell advection1d from burgers1d: the file name is not "
                            f"a PDEBench name ({TASKS['advection1d'].file_pattern}, "
                            f"{TASKS['burgers1d'].file_pattern}) and it has no 'beta'/'Nu' attribute")
    if (spec.spatial_dims == 2) != is_2d:
        raise DataError(f"{path}: task {spec.name} expects datasets {list(spec.keys)}, "
                        f"but the file has {sorted(f.keys())}")
    param = from_name[1] if from_name is not None and from_name[0] is spec else None
    for key in ("param", spec.pdebench_attr):
        param = param if param is not None else _attr_float(f, key)
    return spec, param


def _layout(f: h5py.File, path: Path, task: str | None) -> FileLayout:
    spec, param = _infer_task(f, path, task)
    tensor = _shape(f, "tensor", path)
    check_file(f, path)  # every dataset: a sample fits in memory, every chunk is stored
    if spec.spatial_dims == 1:
        if len(tensor) != 3:
            raise DataError(f"{path}: 'tensor' must be [N, T, X], got shape {tensor}")
        n, nt, nx = tensor
        spatial = (nx,)
        if (xs := _shape(f, "x-coordinate", path)) != (nx,):
            raise DataError(f"{path}: 'x-coordinate' has shape {xs}, expected ({nx},) to match 'tensor' {tensor}")
        if (ts := _shape(f, "t-coordinate", path)) != (nt + 1,):
            raise DataError(f"{path}: 't-coordinate' has shape {ts}, expected ({nt + 1},) "
                            f"(PDEBench stores T + 1 times for 'tensor' {tensor})")
    else:
        if len(tensor) != 4 or tensor[1] != 1:
            raise DataError(f"{path}: 'tensor' must be [N, 1, X, Y], got shape {tensor}")
        n, nt, nx, ny = tensor
        spatial = (nx, ny)
        if (nus := _shape(f, "nu", path)) != (n, nx, ny):
            raise DataError(f"{path}: 'nu' has shape {nus}, expected {(n, nx, ny)} to match 'tensor' {tensor}")
        for key, size in (("x-coordinate", nx), ("y-coordinate", ny)):
            if (cs := _shape(f, key, path)) != (size,):
                raise DataError(f"{path}: {key!r} has shape {cs}, expected ({size},) to match 'tensor' {tensor}")
    if n == 0 or nt == 0 or 0 in spatial:
        raise DataError(f"{path}: 'tensor' is empty, shape {tensor}")
    return FileLayout(path=path, task=spec, param=param, n_samples=n, n_steps=nt, spatial_shape=spatial)


def _sorted_rows(indices, n: int, path: Path) -> tuple[np.ndarray, np.ndarray | slice, np.ndarray | None]:
    """(requested [k], what to pass to h5py, how to reorder its result back or None).

    h5py fancy indexing needs increasing, unique indices; a contiguous run becomes a slice
    (one hyperslab read)."""
    rows = np.arange(n) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= n):
        raise DataError(f"{path}: sample indices must lie in [0, {n}), got min {rows.min()} max {rows.max()}")
    uniq = np.unique(rows)
    back = None if np.array_equal(uniq, rows) else np.searchsorted(uniq, rows)
    if uniq.size == 0:
        return rows, slice(0, 0), None
    if uniq[-1] - uniq[0] + 1 == uniq.size:
        return rows, slice(int(uniq[0]), int(uniq[-1]) + 1), back
    return rows, uniq, back


class PDEBenchFile:
    """An open PDEBench file for lazy per-sample reads; use as a context manager."""

    def __init__(self, path: str | os.PathLike, *, task: str | TaskSpec | None = None):
        self.path = Path(path)
        self._f, self._desc = None, None
        declared = isinstance(task, TaskSpec) and task.layout == "declared"
        if declared and not self.path.is_file():
            # A declared dataset of several files (a folder, a glob: The Well's split folders) is
            # read through its description, which opens each file as it reads it.
            self.layout, self._desc = _declared_layout(self.path, task)
            return
        if not self.path.is_file():
            problem = "is a directory, not an HDF5 file" if self.path.is_dir() else "no such file"
            raise DataError(f"{self.path}: {problem}")
        try:
            self._f = h5py.File(self.path, "r")
        except OSError as err:
            raise DataError(f"{self.path}: cannot open as HDF5 (truncated or corrupt file?): {err}") from None
        try:
            if declared:  # a user's file, any layout
                self.layout, self._desc = _declared_layout(self.path, task)
            elif layout_variant(self._f) in ("scalar", "darcy", None):
                task = task.name if isinstance(task, TaskSpec) else task
                self.layout = _layout(self._f, self.path, task)
            else:  # a 2D flow's file (groups or incompressible NS): read through pipelines.layouts
                self.layout, self._desc = _flow_layout(self._f, self.path,
                                                       task.name if isinstance(task, TaskSpec) else task)
        except BaseException:
            self._f.close()
            raise

    def __enter__(self) -> PDEBenchFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()

    @property
    def description(self):
        """The `pipelines.layouts` description of a 2D flow's file (None for the scalar tasks' files,
        whose datasets `dataset` returns)."""
        return self._desc

    def times(self) -> np.ndarray | None:
        """[T] float64 stored times (None for a steady task)."""
        if self.layout.task.steady:
            return None
        if self._desc is not None:
            return np.asarray(self._desc.times, dtype=np.float64)
        return np.asarray(self._f["t-coordinate"][: self.layout.n_steps], dtype=np.float64)

    def dataset(self, key: str) -> h5py.Dataset:
        """The raw h5py dataset `key` (for chunked scans)."""
        return self._f[key]

    def read(self, indices=None, *, reduce_x: int = 1, reduce_t: int = 1) -> PDEData:
        """Samples `indices` (default all), keeping every `reduce_x`-th grid point per axis and
        every `reduce_t`-th time step (PDEBench's reduced_resolution / reduced_resolution_t)."""
        if reduce_x < 1 or reduce_t < 1:
            raise ValueError(f"reduce_x and reduce_t must be >= 1, got {reduce_x}, {reduce_t}")
        if self._desc is not None:
            return _read_flow(self, indices, reduce_x, reduce_t)
        lay, f = self.layout, self._f
        rows, sel, back = _sorted_rows(indices, lay.n_samples, self.path)
        sx = slice(None, None, reduce_x)
        try:
            if lay.task.spatial_dims == 1:
                u = f["tensor"][sel, ::reduce_t, sx][:, :, None, :]
                t = np.asarray(f["t-coordinate"][: lay.n_steps][::reduce_t], dtype=np.float64)
                coords = (np.asarray(f["x-coordinate"][sx]),)
                coefficient = None
            else:
                u = f["tensor"][sel, :, sx, sx][:, :, None]
                coefficient = f["nu"][sel, sx, sx][:, None]
                coords = (np.asarray(f["x-coordinate"][sx]), np.asarray(f["y-coordinate"][sx]))
                t = None
        except OSError as err:  # a truncated file can open but fail on read
            raise DataError(f"{self.path}: cannot read data (truncated or corrupt file?): {err}") from None
        if back is not None:
            u = u[back]
            coefficient = None if coefficient is None else coefficient[back]
        return PDEData(path=self.path, task=lay.task.name, param=lay.param, indices=rows,
                       u=np.ascontiguousarray(u, dtype=np.float32), coords=coords, t=t,
                       coefficient=None if coefficient is None
                       else np.ascontiguousarray(coefficient, dtype=np.float32))


def _flow_layout(f: h5py.File, path: Path, task: str | None) -> tuple[FileLayout, object]:
    """(layout, description) of a 2D flow's file: the task from the argument, our ``task``
    attribute or the file name; its channels must be the task's."""
    attr = f.attrs.get("task")
    attr = attr.decode() if isinstance(attr, bytes) else attr
    from_name = parse_file_name(path.name)
    name = task or (attr if attr in TASKS else None) or (from_name[0].name if from_name else None)
    if name is None:
        raise DataError(f"{path}: a PDEBench 2D file of no task we train by name; declare it with "
                        f"data.tasks[i].layout instead")
    spec = get_task(name)
    (desc,) = describe(path, "pdebench")
    if desc.channels != spec.channels or spec.layout == "tensor":
        raise DataError(f"{path}: holds channels {list(desc.channels)}, but task {spec.name} has "
                        f"{list(spec.channels)}")
    param = from_name[1] if from_name is not None and from_name[0] is spec else _attr_float(f, spec.pdebench_attr)
    return FileLayout(path=path, task=spec, param=param, n_samples=desc.trajectories, n_steps=desc.steps,
                      spatial_shape=desc.grid.shape), desc


def _declared_layout(path: Path, spec: TaskSpec) -> tuple[FileLayout, object]:
    """(layout, description) of a declared task's file, read by the layout its spec names."""
    (desc,) = describe(path, spec.source_layout, options=json.loads(spec.source_options or "{}"))
    if desc.channels != spec.channels:
        raise DataError(f"{path}: holds channels {list(desc.channels)}, but the config was read with "
                        f"{list(spec.channels)}: the file changed; run the command again")
    return FileLayout(path=path, task=spec, param=None, n_samples=desc.trajectories, n_steps=desc.steps,
                      spatial_shape=desc.grid.shape), desc


def _read_flow(handle: PDEBenchFile, indices, reduce_x: int, reduce_t: int) -> PDEData:
    """`PDEBenchFile.read` of a described file: the rows' windows, the file opened once (never read whole)."""
    desc, lay = handle.description, handle.layout
    rows, _, _ = _sorted_rows(indices, lay.n_samples, handle.path)
    try:
        u = read_windows(desc, rows, t_step=reduce_t if not desc.steady else 1, x_step=reduce_x)
    except OSError as err:
        raise DataError(f"{handle.path}: cannot read data (truncated or corrupt file?): {err}") from None
    shape = (1 if desc.steady else len(range(0, lay.n_steps, reduce_t)), len(desc.channels),
             *(len(range(0, n, reduce_x)) for n in lay.spatial_shape))
    coefficient = None
    if desc.steady and desc.constants:  # a steady task's input field (Darcy's nu): the prior's condition
        coefficient = np.stack(read_constants_each(desc, rows, x_step=reduce_x)) if len(rows) else \
            np.zeros((0, len(desc.constant_channels), *shape[2:]), np.float32)
    return PDEData(path=handle.path, task=lay.task.name, param=lay.param, indices=rows,
                   u=np.stack(u) if u else np.zeros((0, *shape), np.float32),
                   coords=tuple(np.asarray(c[::reduce_x]) for c in desc.grid.coords),
                   t=None if desc.steady else np.asarray(desc.times[::reduce_t], dtype=np.float64),
                   coefficient=coefficient)


def open_pdebench(path: str | os.PathLike, *, task: str | None = None) -> PDEBenchFile:
    """Open `path` for lazy reads; the task is inferred unless given (`DataError` if it cannot be)."""
    return PDEBenchFile(path, task=task)


def read_pdebench(path: str | os.PathLike, indices=None, *, reduce_x: int = 1, reduce_t: int = 1,
                  task: str | None = None) -> PDEData:
    """Read samples `indices` (default all) of a PDEBench file; see `PDEBenchFile.read`."""
    with PDEBenchFile(path, task=task) as handle:
        return handle.read(indices, reduce_x=reduce_x, reduce_t=reduce_t)


class PDEBenchWriter:
    """Write a PDEBench file sample-chunk by sample-chunk, atomically.

    The data go to a hidden temporary file in the destination folder, renamed onto `path`
    (``os.replace``) only when every sample was written and the writer exits cleanly; on
    any exception the temporary file is removed, so `path` is either absent, the old file,
    or complete. While it writes, it holds `path`'s writer lock (`pipelines.writer_lock`); on
    entering, it removes the temporary files that dead writers (killed processes) left in the
    folder, and a second live writer of `path` is refused with a `DataError` naming the first.

    Args:
        path: destination file.
        task: task name; decides the datasets.
        n_samples: N.
        x_coordinate: [X]; y_coordinate: [Y] (Darcy only); t_coordinate: [T + 1] (1D only).
        attrs: extra HDF5 attributes (scalars or strings).
    """

    def __init__(self, path, task: str, *, n_samples: int, x_coordinate, t_coordinate=None,
                 y_coordinate=None, attrs: Mapping[str, object] | None = None):
        self.path, self.spec, self.n = Path(path), get_task(task), int(n_samples)
        if self.n < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        self._x = np.asarray(x_coordinate, dtype=np.float32).reshape(-1)
        if self.spec.spatial_dims == 1:
            if t_coordinate is None or y_coordinate is not None:
                raise ValueError(f"{task} needs t_coordinate and no y_coordinate")
            self._t = np.asarray(t_coordinate, dtype=np.float32).reshape(-1)
            self.sample_shape = (self._t.size - 1, self._x.size)
        else:
            if y_coordinate is None or t_coordinate is not None:
                raise ValueError(f"{task} needs y_coordinate and no t_coordinate")
            self._y = np.asarray(y_coordinate, dtype=np.float32).reshape(-1)
            self.sample_shape = (1, self._x.size, self._y.size)
        self.attrs = dict(attrs or {})
        self._tmp = temp_file_for(self.path)
        self._lock: int | None = None
        self._f: h5py.File | None = None
        self._done = np.zeros(self.n, dtype=bool)

    def _take_lock(self) -> None:
        """Hold `path`'s writer lock and remove the folder's dead writers' temporary files."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = try_lock(self.path)
        if self._lock is None:
            raise DataError(f"{self.path} is being written by {describe_holder(self.path)}; wait for that "
                            f"process to finish (or stop it), then run this command again")
        record_holder(self._lock)
        remove_dead_temps(self.path.parent, held=self.path)

    def _drop_lock(self) -> None:
        if self._lock is not None:
            unlock(self.path, self._lock)
            self._lock = None

    def __enter__(self) -> PDEBenchWriter:
        self._take_lock()
        try:
            self._create()
        except BaseException:
            if self._f is not None:
                self._f.close()
            self._tmp.unlink(missing_ok=True)
            self._drop_lock()
            raise
        return self

    def _create(self) -> None:
        """Create the temporary file with every dataset declared and the attributes set."""
        f = self._f = h5py.File(self._tmp, "w")
        # One sample per HDF5 chunk: a per-sample read touches only that sample's bytes.
        f.create_dataset("tensor", shape=(self.n, *self.sample_shape), dtype=np.float32,
                         chunks=(1, *self.sample_shape))
        f.create_dataset("x-coordinate", data=self._x)
        if self.spec.spatial_dims == 1:
            f.create_dataset("t-coordinate", data=self._t)
        else:
            f.create_dataset("nu", shape=(self.n, *self.sample_shape[1:]), dtype=np.float32,
                             chunks=(1, *self.sample_shape[1:]))
            f.create_dataset("y-coordinate", data=self._y)
        for key, value in self.attrs.items():
            f.attrs[key] = value

    def write(self, start: int, tensor, nu=None) -> None:
        """Write samples ``start .. start + len(tensor)``: `tensor` [k, *sample shape], `nu` [k, X, Y] (Darcy)."""
        assert self._f is not None, "use PDEBenchWriter as a context manager"
        tensor = np.asarray(tensor, dtype=np.float32)
        k = tensor.shape[0]
        if tensor.shape[1:] != self.sample_shape or not 0 <= start <= self.n - k:
            raise ValueError(f"{self.path}: samples [{start}, {start + k}) of shape {tensor.shape[1:]} do not fit "
                             f"N={self.n} samples of shape {self.sample_shape}")
        self._f["tensor"][start:start + k] = tensor
        if self.spec.spatial_dims == 2:
            nu = np.asarray(nu, dtype=np.float32)
            if nu.shape != (k, *self.sample_shape[1:]):
                raise ValueError(f"{self.path}: nu has shape {nu.shape}, expected {(k, *self.sample_shape[1:])}")
            self._f["nu"][start:start + k] = nu
        self._done[start:start + k] = True

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._f is not None
        try:
            self._f.close()
            if exc_type is None:
                if not self._done.all():
                    raise RuntimeError(f"{self.path}: samples {np.flatnonzero(~self._done)[:10].tolist()}... "
                                       f"were never written")
                publish(self._tmp, self.path)  # data on disk before the rename makes them visible
        finally:
            self._tmp.unlink(missing_ok=True)
            self._drop_lock()


def write_pdebench(path, task: str, *, tensor, x_coordinate, t_coordinate=None, y_coordinate=None,
                   nu=None, attrs: Mapping[str, object] | None = None) -> Path:
    """Write a whole PDEBench file at once (atomically, see `PDEBenchWriter`); returns `path`.

    Shapes: 1D ``tensor`` [N, T, X], ``t_coordinate`` [T + 1]; Darcy ``tensor`` [N, 1, X, Y]
    (or [N, X, Y]), ``nu`` [N, X, Y], ``y_coordinate`` [Y]."""
    tensor = np.asarray(tensor, dtype=np.float32)
    if get_task(task).spatial_dims == 2 and tensor.ndim == 3:
        tensor = tensor[:, None]
    with PDEBenchWriter(path, task, n_samples=tensor.shape[0], x_coordinate=x_coordinate,
                        t_coordinate=t_coordinate, y_coordinate=y_coordinate, attrs=attrs) as writer:
        writer.write(0, tensor, nu)
    return Path(path)
