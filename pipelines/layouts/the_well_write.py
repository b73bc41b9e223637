"""Write gridded trajectories as one file of The Well's HDF5 format, for its own reader and ours.

Legend: N trajectories, T time steps, S spatial axes, D spatial components.

The file carries everything ``the_well.data.WellDataset`` (the_well 1.2.0,
``the_well/data/datasets.py``) reads and ``scripts/check_thewell_formatting.py`` checks: the root
attributes ``dataset_name``, ``grid_type``, ``n_spatial_dims``, ``n_trajectories``,
``simulation_parameters`` and one per parameter; ``dimensions`` (``spatial_dims``, ``time``, one
coordinate dataset per axis); one boundary group per axis (``<axis>_periodic`` PERIODIC or
``<axis>_wall`` WALL, its ``mask`` true at both ends, as The Well's own files mark them);
``scalars`` (the parameters, constant) and ``t0/t1/t2_fields`` with ``field_names`` and the
``dim_varying``/``sample_varying``/``time_varying`` flags of every dataset
(its docs folder's ``data_format.md``). Fields are stored float32, as the format specifies.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np

from pipelines.atomic import publish

__all__ = ["write_well", "remove_dead_temps"]

_TEMP_NAME = re.compile(r"\.(?P<target>.+)\.(?P<pid>[1-9]\d*)-[0-9a-f]{8}\.tmp")
"""``.<name>.<pid>-<8 hex>.tmp``: `write_well`'s temporary file for ``<name>``."""
_RESERVED = ("dataset_name", "grid_type", "n_spatial_dims", "n_trajectories", "simulation_parameters")


def _order(name: str, array: np.ndarray, lead: int, dims: int) -> int:
    """Tensor order of `array` ([*lead, *S] scalar, [..., D] vector, [..., D, D] tensor)."""
    order = array.ndim - lead - dims
    if order not in (0, 1, 2) or array.shape[lead + dims:] != (dims,) * order:
        raise ValueError(f"field {name!r} has shape {list(array.shape)}; expected {lead} leading axes, {dims} "
                         f"spatial axes, then nothing (scalar), [{dims}] (vector) or [{dims}, {dims}] (tensor)")
    return order


def _check(fields: Mapping[str, np.ndarray], constants: Mapping[str, np.ndarray], axes, coords, times,
           periodic, parameters, attrs) -> tuple[int, tuple[int, ...]]:
    """(N, grid shape) after checking that every argument agrees; ValueError naming the argument."""
    dims = len(axes)
    if not 1 <= dims <= 3 or len(coords) != dims or len(periodic) != dims or len(set(axes)) != dims:
        raise ValueError(f"axes {axes}: expected 1 to 3 distinct names with one coords array and one periodic "
                         f"flag each, got {len(coords)} coords and periodic {periodic}")
    if not fields:
        raise ValueError("fields: at least one time-varying field is needed")
    shape = tuple(len(c) for c in coords)
    n = next(iter(fields.values())).shape[0]
    for name, array in {**fields, **constants}.items():
        lead = (n, len(times)) if name in fields else (n,)
        if array.shape[:len(lead) + dims] != (*lead, *shape):
            raise ValueError(f"field {name!r} has shape {list(array.shape)}; expected it to start with "
                             f"{[*lead, *shape]} (N, {'T, ' if name in fields else ''}grid {list(shape)})")
        if not np.issubdtype(array.dtype, np.number):
            raise ValueError(f"field {name!r} has dtype {array.dtype}, expected numbers")
        _order(name, array, len(lead), dims)
    if set(fields) & set(constants):
        raise ValueError(f"fields and constants share names: {sorted(set(fields) & set(constants))}")
    if np.ndim(times) != 1 or any(np.ndim(c) != 1 for c in coords):
        raise ValueError("times and every coords array must be 1D")
    clash = set(_RESERVED) & (set(parameters) | set(attrs)) or set(parameters) & set(attrs)
    if clash:
        raise ValueError(f"parameters/attrs {sorted(clash)} clash with the format's root attributes or each other")
    return n, shape


def _flags(node, *, sample: bool, time: bool, dims: int | None = None) -> None:
    node.attrs["sample_varying"] = sample
    node.attrs["time_varying"] = time
    if dims is not None:
        node.attrs["dim_varying"] = np.ones(dims, dtype=bool)


def _write(f: h5py.File, fields, constants, axes, coords, times, periodic, parameters) -> None:
    dims = f.create_group("dimensions")
    dims.attrs["spatial_dims"] = list(axes)
    _flags(dims.create_dataset("time", data=np.asarray(times, dtype=np.float64)), sample=False, time=True)
    for axis, c in zip(axes, coords, strict=True):
        _flags(dims.create_dataset(axis, data=np.asarray(c, dtype=np.float64)), sample=False, time=False)

    bcs = f.create_group("boundary_conditions")
    for axis, c, is_periodic in zip(axes, coords, periodic, strict=True):
        kind = "PERIODIC" if is_periodic else "WALL"
        bc = bcs.create_group(f"{axis}_{kind.lower()}")
        bc.attrs.update(bc_type=kind, associated_dims=[axis], associated_fields=[])
        _flags(bc, sample=False, time=False)
        mask = np.zeros(len(c), dtype=bool)
        mask[[0, -1]] = True
        bc.create_dataset("mask", data=mask)
        # no field is tied to the boundary (associated_fields is empty): values on the mask's
        # points are the spec's [NumTrue(mask)] shape, zeros
        bc.create_dataset("values", data=np.zeros(int(mask.sum()), dtype=np.float32))

    scalars = f.create_group("scalars")
    scalars.attrs["field_names"] = list(parameters)
    for name, value in parameters.items():  # float64: the parameter round-trips exactly
        _flags(scalars.create_dataset(name, data=np.float64(value)), sample=False, time=False)

    groups = [f.create_group(g) for g in ("t0_fields", "t1_fields", "t2_fields")]
    names: list[list[str]] = [[], [], []]
    for name, array in {**fields, **constants}.items():
        timed = name in fields
        order = _order(name, array, 2 if timed else 1, len(axes))
        node = groups[order].create_dataset(name, data=np.asarray(array, dtype=np.float32))
        _flags(node, sample=True, time=timed, dims=len(axes))
        names[order].append(name)
    for group, listed in zip(groups, names, strict=True):
        group.attrs["field_names"] = listed


def _alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (one we may not signal exists too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_temps(path: str | os.PathLike) -> list[Path]:
    """Delete the temporary files a killed `write_well` of `path` left beside it (exactly
    ``.<name>.<pid>-<8 hex>.tmp``, a file, its pid's process gone from this host); returns them.

    A writer names its temporary file by its pid, so one whose pid is alive (a live writer, or a
    process that reused the pid) is kept: that errs on the side of leaving a file. A pid names a
    process of the host that wrote the file: two hosts writing one dataset into a shared folder at
    once are not supported (each would take the other's live writer for a dead one).
    """
    path = Path(path)
    if not path.parent.is_dir():
        return []
    removed = []
    for temp in sorted(path.parent.iterdir()):
        match = _TEMP_NAME.fullmatch(temp.name)
        if match and match["target"] == path.name and temp.is_file() and not _alive(int(match["pid"])):
            temp.unlink(missing_ok=True)
            removed.append(temp)
    return removed


def write_well(path: str | Path, *, dataset_name: str, fields: Mapping[str, np.ndarray], axes: tuple[str, ...],
               coords: tuple[np.ndarray, ...], times: np.ndarray, periodic: tuple[bool, ...],
               parameters: Mapping[str, float], attrs: Mapping[str, object] | None = None,
               constants: Mapping[str, np.ndarray] | None = None) -> Path:
    """Write one file of The Well's format (one parameter set), atomically.

    Args:
        path: the file to write (The Well's folders: ``<dataset>/data/{train,valid,test}/*.hdf5``).
        dataset_name: the root attribute ``dataset_name``.
        fields: time-varying fields by name, in channel order: a scalar [N, T, *S], a vector
            [N, T, *S, D] or a tensor [N, T, *S, D, D]; stored float32.
        axes: spatial axis names (``("x", "y")``), coords: one 1D array per axis, times: [T].
        periodic: per axis: True writes a PERIODIC boundary, False a WALL.
        parameters: constant scalars (root attributes, ``simulation_parameters`` and ``scalars``).
        attrs: further root attributes.
        constants: fields constant in time, [N, *S] (scalar), [N, *S, D] or [N, *S, D, D].
    Returns:
        `path`. The file is written under a temporary name in its folder and then renamed, so a
        reader never sees half a file.
    Raises:
        ValueError: arguments that disagree (shapes, axes, names), naming the argument.
    """
    constants, attrs = dict(constants or {}), dict(attrs or {})
    n, _ = _check(fields, constants, tuple(axes), tuple(coords), times, tuple(periodic), parameters, attrs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temps(path)
    # A fresh name, created by h5py itself: the file gets the mode an ordinary open gives (0o666
    # less the umask), not mkstemp's 0o600, so the rest of a group can read the data.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs.update(dataset_name=dataset_name, grid_type="cartesian", n_spatial_dims=np.int64(len(axes)),
                           n_trajectories=np.int64(n), simulation_parameters=list(parameters))
            f.attrs.update({k: float(v) for k, v in parameters.items()})
            f.attrs.update(attrs)
            _write(f, fields, constants, tuple(axes), tuple(coords), times, tuple(periodic), parameters)
        publish(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
