"""Trajectories written as The Well's dataset folder: ``<out>/<name>/data/{train,valid,test}/<file>.hdf5``.

Legend: N trajectories, T time steps, C channels, S spatial axes, D spatial components.

PDEBench's convention picks the split: the first 10% of the trajectories are the test set, the
next 10% validation, the rest training (`well_splits`). `to_the_well` converts any time-dependent
dataset a layout reader describes (a generated 1D task's PDEBench file, a user's file); the 2D
flows write their solved arrays through `write_well_dataset` directly. Both hold the whole
dataset in memory while they write: a converter for generated and moderate files, not for
PDEBench's largest.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from pipelines.layouts import read_windows
from pipelines.layouts.description import DataError, DatasetDescription, FieldSpec
from pipelines.layouts.the_well_write import write_well

__all__ = ["well_splits", "well_fields", "write_well_dataset", "to_the_well"]


def well_splits(n: int) -> dict[str, slice]:
    """PDEBench's convention: the first 10% test, the next 10% validation, the rest training (no
    test or validation set below 3 trajectories)."""
    k = max(1, n // 10) if n >= 3 else 0
    return {"test": slice(0, k), "valid": slice(k, 2 * k), "train": slice(2 * k, n)}


def well_fields(fields: tuple[FieldSpec, ...], u_NTSC: np.ndarray, *, where: str) -> dict[str, np.ndarray]:
    """The Well's arrays of `fields` from channels-last data: a scalar [N, T, *S], a vector
    [N, T, *S, D]; a `DataError` naming `where` for a vector with other than one component per axis."""
    dims, out, c = u_NTSC.ndim - 3, {}, 0
    for f in fields:
        part = u_NTSC[..., c:c + f.channels]
        if f.kind == "scalar":
            out[f.name] = part[..., 0]
        elif f.kind == "vector" and f.channels == dims:
            out[f.name] = part
        else:
            raise DataError(f"{where}: field {f.name!r} has {f.channels} components on a {dims}D grid; "
                            f"The Well's vectors have one per axis")
        c += f.channels
    return out


def write_well_dataset(out_dir: Path, name: str, file_stem: str, fields: Mapping[str, np.ndarray], *,
                       axes: tuple[str, ...], coords: tuple[np.ndarray, ...], times: np.ndarray,
                       periodic: tuple[bool, ...], parameters: Mapping[str, float],
                       attrs: Mapping[str, object] | None = None) -> Path:
    """Split `fields` (by name: scalar [N, T, *S], vector [N, T, *S, D]) into The Well's three folders
    under ``out_dir/name``; returns that dataset folder."""
    n = next(iter(fields.values())).shape[0]
    root = Path(out_dir) / name / "data"
    for split, rows in well_splits(n).items():
        if rows.stop > rows.start:
            write_well(root / split / f"{file_stem}.hdf5", dataset_name=name,
                       fields={k: v[rows] for k, v in fields.items()}, axes=axes, coords=coords, times=times,
                       periodic=periodic, parameters=parameters, attrs=attrs)
    return Path(out_dir) / name


def to_the_well(desc: DatasetDescription, out_dir: Path, *, name: str | None = None, file_stem: str | None = None,
                attrs: Mapping[str, object] | None = None) -> Path:
    """Write every trajectory of `desc` (time-dependent) as The Well's dataset folder; returns it.

    Raises:
        DataError: a steady dataset (The Well's format holds time series) or a vector field whose
            components are not one per spatial axis.
    """
    if desc.steady:
        raise DataError(f"{desc.sources[0].path}: a steady dataset; The Well's format holds time series: "
                        f"keep it in PDEBench's layout")
    u_NTSC = np.moveaxis(np.stack(read_windows(desc, range(desc.trajectories))), 2, -1)
    fields = well_fields(desc.fields, u_NTSC, where=str(desc.sources[0].path))
    periodic = tuple(bool(p) for p in desc.grid.periodic)
    return write_well_dataset(Path(out_dir), name or desc.name, file_stem or desc.identity, fields,
                              axes=desc.grid.axes, coords=desc.grid.coords, times=desc.times, periodic=periodic,
                              parameters=dict(desc.parameters), attrs=attrs)
