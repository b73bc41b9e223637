"""Write predicted trajectories as an HDF5 file that our readers (and PDEBench's or The Well's) read.

Legend: N trajectories, T time steps, C channels, S spatial axes.

Two layouts: ``pdebench`` (one channel: ``tensor`` [N, T, *S] with ``<axis>-coordinate`` and
``t-coordinate``, as PDEBench's scalar files; several: PDEBench's per-sample groups ``0000/data``
[T, *S, C] with ``grid/<axis>`` and ``grid/t``, the channels named in ``channel_names``) and
``the_well`` (one file of The Well's format, `pipelines.layouts.the_well_write`). Either reads back
through `pipelines.layouts.describe` with the same channel names, grid and times.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np

from pipelines.layouts.description import FieldSpec
from pipelines.layouts.the_well_write import write_well
from pipelines.layouts.to_the_well import well_fields

__all__ = ["OUT_LAYOUTS", "write_rollout"]

OUT_LAYOUTS = ("pdebench", "the_well")
"""The layouts a rollout is written in."""


def write_rollout(path: str | Path, layout: str, *, u_NTCS: np.ndarray, fields: tuple[FieldSpec, ...],
                  axes: tuple[str, ...], coords: tuple[np.ndarray, ...], times: np.ndarray,
                  periodic: tuple[bool, ...], name: str, parameters: Mapping[str, float],
                  attrs: Mapping[str, object] | None = None) -> Path:
    """Write trajectories `u_NTCS` (the channels of `fields`, in order) on the grid `axes`/`coords` at
    `times` [T] to `path` in `layout` (`OUT_LAYOUTS`); returns `path`. The caller makes the write
    atomic (a temporary `path` renamed into place). `periodic` (per axis: True, False or None for
    unknown), `name` and `parameters` describe the data (The Well's boundary groups, ``dataset_name``
    and scalars); `attrs` are further root attributes. Raises ValueError for an unknown layout or
    arrays that disagree."""
    u_NTCS = np.asarray(u_NTCS, dtype=np.float32)
    if u_NTCS.shape[2] != sum(f.channels for f in fields) or len(times) != u_NTCS.shape[1]:
        raise ValueError(f"trajectories of shape {list(u_NTCS.shape)} do not fit {sum(f.channels for f in fields)} "
                         f"channels and {len(times)} times")
    if layout == "the_well":
        return write_well(path, dataset_name=name, fields=well_fields(fields, np.moveaxis(u_NTCS, 2, -1), where=name),
                          axes=axes, coords=coords, times=np.asarray(times, dtype=np.float64),
                          periodic=tuple(bool(p) for p in periodic),
                          parameters=parameters, attrs=attrs)
    if layout != "pdebench":
        raise ValueError(f"layout must be one of {OUT_LAYOUTS}, got {layout!r}")
    with h5py.File(path, "w") as f:
        f.attrs.update(dict(attrs or {}))
        f.attrs.update({k: float(v) for k, v in parameters.items()})
        if len(set(periodic)) == 1 and periodic[0] is not None:  # PDEBench's reader takes one flag for all axes
            f.attrs["periodic"] = bool(periodic[0])
        if u_NTCS.shape[2] == 1:
            f.create_dataset("tensor", data=u_NTCS[:, :, 0])
            for axis, c in zip(axes, coords, strict=True):
                f.create_dataset(f"{axis}-coordinate", data=np.asarray(c, dtype=np.float64))
            f.create_dataset("t-coordinate", data=np.asarray(times, dtype=np.float64))
            return Path(path)
        f.attrs["channel_names"] = [c for field in fields for c in field.components]
        for i, u_TCS in enumerate(u_NTCS):
            g = f.create_group(f"{i:04d}")
            g.create_dataset("data", data=np.moveaxis(u_TCS, 1, -1))
            for axis, c in zip(axes, coords, strict=True):
                g.create_dataset(f"grid/{axis}", data=np.asarray(c, dtype=np.float64))
            g.create_dataset("grid/t", data=np.asarray(times, dtype=np.float64))
    return Path(path)
