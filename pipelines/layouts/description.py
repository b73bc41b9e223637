"""What a gridded PDE dataset holds, as one typed description that every reader returns.

Legend: N trajectories, T time steps, C channels, S spatial axes (1, 2 or 3), X/Y/Z grid points.

A dataset is described, not registered: a layout (`pipelines.layouts.registry`: PDEBench's, The
Well's, a user's HDF5 ...) reads a file's metadata only and
returns a `DatasetDescription`; the stack reads that and never a file name. A window of one
trajectory is read lazily by `read_window` (`[T, C, *S]` float32, channels first as the codec
takes them) so that no file is ever read whole.

Fields: a scalar field is one channel; a vector field is one channel per spatial component
(The Well's ``t1_fields``, PDEBench's ``velocity`` [..., 2] or ``Vx``/``Vy``), a tensor field one
per component pair (The Well's ``t2_fields``). Channels are the fields' components in order.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

__all__ = ["DataError", "FieldSpec", "GridSpec", "Source", "DatasetDescription", "task_identity", "SPLITS"]

SPLITS = ("train", "valid", "test")
"""The Well's split folders; a source outside them has split None (our own split applies)."""

FieldKind = Literal["scalar", "vector", "tensor"]


class DataError(ValueError):
    """A data file is missing, unreadable or not in the layout named; the message names the file
    and the key."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldSpec:
    """One physical field: its name, kind and the names of its channels."""

    name: str
    """As the file names it (``vorticity``, ``velocity``, ``density``, ``u``)."""
    kind: FieldKind
    """scalar: one channel; vector: one per spatial component; tensor: one per component pair."""
    components: tuple[str, ...]
    """Channel names in order (``("velocity_x", "velocity_y")``; a scalar: ``(name,)``)."""

    def __post_init__(self):
        if not self.components:
            raise ValueError(f"field {self.name!r} has no channels")
        if self.kind == "scalar" and len(self.components) != 1:
            raise ValueError(f"scalar field {self.name!r} must have one channel, got {self.components}")

    @property
    def channels(self) -> int:
        return len(self.components)

    @staticmethod
    def scalar(name: str) -> FieldSpec:
        return FieldSpec(name=name, kind="scalar", components=(name,))

    @staticmethod
    def vector(name: str, axes: tuple[str, ...]) -> FieldSpec:
        return FieldSpec(name=name, kind="vector", components=tuple(f"{name}_{a}" for a in axes))


@dataclass(frozen=True, kw_only=True, slots=True)
class GridSpec:
    """A uniform or rectilinear grid: one coordinate array per spatial axis."""

    axes: tuple[str, ...]
    """Axis names, e.g. ``("x", "y")``."""
    coords: tuple[np.ndarray, ...]
    """One 1D float array per axis (cell centres or nodes, as the file stores them)."""
    periodic: tuple[bool | None, ...]
    """Per axis: True/False where the file says, None where it does not."""

    def __post_init__(self):
        if not 1 <= len(self.axes) <= 3 or len(self.coords) != len(self.axes) or len(self.periodic) != len(self.axes):
            raise ValueError(f"a grid has 1 to 3 axes with one coordinate array and one periodic flag each, got "
                             f"axes {self.axes}, {len(self.coords)} coordinate arrays, periodic {self.periodic}")

    @property
    def dims(self) -> int:
        return len(self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(c) for c in self.coords)

    def __eq__(self, other) -> bool:
        return (isinstance(other, GridSpec) and self.axes == other.axes and self.periodic == other.periodic
                and all(np.array_equal(a, b) for a, b in zip(self.coords, other.coords, strict=True)))

    __hash__ = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """One file that holds trajectories of a dataset."""

    path: Path
    split: str | None
    """``train``/``valid``/``test`` when the file sits in The Well's split folder, else None."""
    trajectories: int
    size_bytes: int


@dataclass(frozen=True, kw_only=True)
class DatasetDescription:
    """Everything the stack needs to know about one task's data, read from metadata only."""

    name: str
    """The PDE or dataset (PDEBench's family, The Well's ``dataset_name``, the user's name)."""
    layout: str
    """The registered layout that made this description (`pipelines.layouts.registry`), never ``auto``."""
    fields: tuple[FieldSpec, ...]
    """Time-varying state fields, the ones a surrogate predicts."""
    constants: tuple[FieldSpec, ...]
    """Inputs only, constant in time (a coefficient field such as Darcy's ``nu``, a forcing)."""
    grid: GridSpec
    times: np.ndarray | None
    """[T] stored times; None for a steady dataset (one solution per trajectory)."""
    parameters: Mapping[str, float]
    """Scalar PDE constants fixed for the whole dataset (viscosity, Mach number ...)."""
    sources: tuple[Source, ...]
    per_trajectory: tuple[str, ...] = ()
    """Names of scalar parameters that vary per trajectory (read with the window)."""
    reader_state: Mapping[str, object] = field(default_factory=dict, compare=False, repr=False)
    """What the layout reader needs to find the data again (dataset keys, axis orders)."""

    def __post_init__(self):
        names = [c for f in (*self.fields, *self.constants) for c in f.components]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: channel names repeat: {names}")
        if not self.fields:
            raise ValueError(f"{self.name}: a dataset needs at least one state field")

    @property
    def dims(self) -> int:
        return self.grid.dims

    @property
    def steady(self) -> bool:
        return self.times is None

    @property
    def channels(self) -> tuple[str, ...]:
        """Channel names of the state, in the order `read_window` stacks them."""
        return tuple(c for f in self.fields for c in f.components)

    @property
    def constant_channels(self) -> tuple[str, ...]:
        return tuple(c for f in self.constants for c in f.components)

    @property
    def trajectories(self) -> int:
        return sum(s.trajectories for s in self.sources)

    @property
    def steps(self) -> int:
        return 1 if self.times is None else len(self.times)

    @property
    def size_bytes(self) -> int:
        return sum(s.size_bytes for s in self.sources)

    @property
    def identity(self) -> str:
        return task_identity(self.name, self.parameters)

    def locate(self, trajectory: int) -> tuple[Source, int]:
        """(the file holding global trajectory `trajectory`, its row in that file)."""
        if not 0 <= trajectory < self.trajectories:
            raise IndexError(f"{self.name}: trajectory {trajectory} out of range [0, {self.trajectories})")
        for source in self.sources:
            if trajectory < source.trajectories:
                return source, trajectory
            trajectory -= source.trajectories
        raise AssertionError("unreachable: trajectories sum over sources")

    def split_rows(self, split: str) -> list[int]:
        """Global trajectory indices of the sources in The Well split `split` (empty if none)."""
        rows, start = [], 0
        for s in self.sources:
            if s.split == split:
                rows.extend(range(start, start + s.trajectories))
            start += s.trajectories
        return rows


def format_value(value: float) -> str:
    """A parameter as a short, exact-enough string for names: ``0.001`` -> ``0.001``, ``1e4`` -> ``10000``."""
    value = float(value)
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.6g}"


def task_identity(name: str, parameters: Mapping[str, float]) -> str:
    """A task's identity from its data: the dataset name and its parameters, sorted by name
    (``burgers_nu0.001``; two files of one PDE at two parameters are two tasks of one family)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "data"
    parts = [f"{re.sub(r'[^A-Za-z0-9]+', '', k)}{format_value(v)}" for k, v in sorted(parameters.items())]
    return "_".join([stem, *parts])
