"""Write PDEBench HDF5 files (1D advection / Burgers, 2D Darcy) as PDEBench's generators do.

Legend: N samples, T time steps, X, Y grid points.

On disk (PDEBench's keys only, see `pipelines.tasks`): 1D ``tensor`` [N, T, X] float32,
``x-coordinate`` [X], ``t-coordinate`` [T + 1]; Darcy ``tensor`` [N, 1, X, Y] (solution),
``nu`` [N, X, Y] (coefficient), ``x-coordinate`` [X], ``y-coordinate`` [Y]. Our own
metadata (seed, solver, generator version) lives in HDF5 attributes only, and no reader
needs it. Reading is `pipelines.layouts` (the ``pdebench`` layout) for every file, ours and
PDEBench's; a task's data is read through `pipelines.task_data`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np

from pipelines.atomic import publish
from pipelines.layouts.description import DataError
from pipelines.tasks import get_task
from pipelines.writer_lock import describe_holder, record_holder, remove_dead_temps, temp_file_for, try_lock, unlock

__all__ = ["DataError", "PDEBenchWriter", "write_pdebench", "GENERATOR", "GENERATOR_VERSION"]

GENERATOR = "pipelines.generate"
"""The ``generator`` attribute of every file our solvers write: how a reader knows a file's other attributes
(its ``seed``) are ours."""
GENERATOR_VERSION = "1"
"""Bumped whenever generated data would change for the same arguments."""


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
