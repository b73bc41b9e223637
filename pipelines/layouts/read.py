"""Reading trajectories of a described dataset: its sources opened once, a block of rows per read.

Legend: N trajectories asked for, R rows of one source, T time steps, C channels, S spatial axes.

`DatasetReader` keeps each source of a description open (through its layout's `Layout.open`)
until closed; ``windows`` and ``constants`` group the trajectories asked for by source, read each
source's sorted, unique rows at once where the layout has a block read (`Layout.read_rows`: one
h5py read of a slice or an index list) and return them in the order asked, repeats included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack

import numpy as np

from pipelines.layouts.description import DataError, DatasetDescription
from pipelines.layouts.registry import get_layout

__all__ = ["DatasetReader"]


def _block(rows: np.ndarray) -> np.ndarray | slice:
    """Sorted unique `rows` as a layout's block read takes them: a slice when contiguous."""
    return slice(int(rows[0]), int(rows[-1]) + 1) if rows[-1] - rows[0] + 1 == rows.size else rows


class DatasetReader:
    """The sources of `desc`, each opened on first use and kept open until `close` (a context
    manager). Not shared between processes: a handle (h5py's) does not survive a fork."""

    def __init__(self, desc: DatasetDescription):
        self.desc, self.layout = desc, get_layout(desc.layout)
        self._stack, self._open = ExitStack(), {}

    def __enter__(self) -> DatasetReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def _handle(self, path):
        if path not in self._open:
            self._open[path] = self._stack.enter_context(self.layout.open(path))
        return self._open[path]

    def _read(self, trajectories, shape: tuple[int, ...], one: Callable, block: Callable | None) -> np.ndarray:
        """[N, *shape] float32: ``one(h, row)`` per row, or ``block(h, rows)`` per source."""
        want = np.asarray(trajectories, dtype=np.int64).reshape(-1)
        if want.size and (want.min() < 0 or want.max() >= self.desc.trajectories):
            raise DataError(f"{self.desc.sources[0].path}: trajectories must lie in [0, {self.desc.trajectories}), "
                            f"got min {want.min()} max {want.max()}")
        rows, back = np.unique(want, return_inverse=True)
        out, start = None, 0
        for source in self.desc.sources:
            lo, hi = np.searchsorted(rows, [start, start + source.trajectories])  # rows[lo:hi] are here
            if hi > lo:
                local = rows[lo:hi] - start
                try:
                    h = self._handle(source.path)
                    data = block(h, _block(local)) if block else np.stack([one(h, int(r)) for r in local])
                except OSError as err:  # a truncated file can open but fail on read
                    raise DataError(f"{source.path}: cannot read data (truncated or corrupt file?): {err}") from None
                if hi - lo == rows.size:  # one source holds them all: no second copy of a block
                    return data if np.array_equal(back, np.arange(rows.size)) else data[back]
                out = np.empty((want.size, *shape), dtype=np.float32) if out is None else out
                at = np.flatnonzero((back >= lo) & (back < hi))
                out[at] = data[back[at] - lo]
                del data
            start += source.trajectories
        return np.empty((0, *shape), dtype=np.float32) if out is None else out

    def _space(self, x_step: int) -> tuple[int, ...]:
        return tuple(math.ceil(n / x_step) for n in self.desc.grid.shape)

    def windows(self, trajectories, *, t_start: int = 0, t_stop: int | None = None, t_step: int = 1,
                x_step: int = 1) -> np.ndarray:
        """[N, T, C, *S] float32: steps ``t_start:t_stop:t_step`` of each of `trajectories` (global
        indices over the description's sources), every `x_step`-th point per axis (steady: T = 1)."""
        if t_step < 1 or x_step < 1:
            raise ValueError(f"t_step and x_step must be >= 1, got {t_step}, {x_step}")
        desc, lay, t = self.desc, self.layout, slice(t_start, t_stop, t_step)
        steps = 1 if desc.steady else len(range(desc.steps)[t])
        block = None if lay.read_rows is None else lambda h, rows: lay.read_rows(desc, h, rows, t, x_step)
        return self._read(trajectories, (steps, len(desc.channels), *self._space(x_step)),
                          lambda h, row: lay.read_window(desc, h, row, t, x_step), block)

    def constants(self, trajectories, *, x_step: int = 1) -> np.ndarray | None:
        """[N, C, *S] float32: the constant input fields of each of `trajectories`, or None when the
        dataset has none."""
        desc, lay = self.desc, self.layout
        if not desc.constants:
            return None
        if x_step < 1:
            raise ValueError(f"x_step must be >= 1, got {x_step}")
        block = (None if lay.read_constant_rows is None
                 else lambda h, rows: lay.read_constant_rows(desc, h, rows, x_step))
        return self._read(trajectories, (len(desc.constant_channels), *self._space(x_step)),
                          lambda h, row: lay.read_constants(desc, h, row, x_step), block)
