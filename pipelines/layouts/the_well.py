# long file: one reader of one format; the checks, the description and the lazy reads share its helpers
"""The Well's HDF5 format (PolymathicAI/the_well), read from metadata and sliced lazily.

Legend: N trajectories, T time steps, C channels, S spatial axes, D spatial components.

What we follow, as the_well 1.2.0 defines and reads it (commit 215f55d8 of github.com/PolymathicAI/the_well):
the specification ``data_format.md`` in its docs folder, ``scripts/check_thewell_formatting.py`` (the expected
shape of every dataset: [N] if ``sample_varying``, [T] if ``time_varying``, the axes whose
``dim_varying`` is true, then D per tensor order) and ``the_well/data/datasets.py``, ``WellDataset``:

* ``_build_metadata``: channel names are ``<field>`` (t0), ``<field>_<axis>`` (t1) and
  ``<field>_<axis><axis>`` (t2, ``itertools.product`` order); state channels are t0, t1, t2 fields
  in ``field_names`` order, fields with ``time_varying`` false are constant inputs; T is
  ``dimensions/time.shape[-1]``; scalars that are not time-varying are the ``constant_scalars``.
* ``_reconstruct_fields``: a field's leading index is the row only if ``sample_varying``, the time
  slice only if ``time_varying``; ``_pad_axes`` tiles the axes whose ``dim_varying`` is false.
  The spec and the format check omit such an axis from the dataset's shape, but ``_pad_axes``
  tiles without re-inserting it, so the_well reads those fields only where the file keeps the
  axis with size 1; we read both forms.
  ``_postprocess_data`` flattens a t2 field's [D, D] row-major, as our component names are.
* ``_reconstruct_grids``: a ``sample_varying`` time (or coordinate) is read per trajectory.
* ``_padding_bcs``: an axis is open unless a boundary group names it in ``associated_dims``; a
  PERIODIC group counts where its ``mask`` is true at that axis's ends.

Not carried into the description (it has no slot for them): time-varying scalars (skipped with a
warning), ``grid_type`` (kept in ``reader_state``; a spherical grid is read as its index grid),
boundary ``values`` and WALL/OPEN beyond "not periodic". Files of one task (one
``dataset_name`` and one set of constant scalars) must share fields, grid and step count.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np

from pipelines.layouts.description import SPLITS, DataError, DatasetDescription, FieldSpec, GridSpec, Source
from pipelines.layouts.h5 import open_h5, recogniser
from pipelines.layouts.registry import Layout, register_layout
from pipelines.layouts.sizes import check_h5

__all__ = ["recognises", "describe_files", "read_window", "read_constants", "FIELD_GROUPS"]

FIELD_GROUPS = ("t0_fields", "t1_fields", "t2_fields")
"""Field groups by tensor order: scalars [N, T, *S], vectors [..., D], tensors [..., D, D]."""


def _names(value) -> tuple[str, ...]:
    """A list-of-names attribute as strings (h5py gives str, bytes, an object array, or an empty
    float array for ``[]``); one bare string is one name."""
    if isinstance(value, (str, bytes)):
        value = [value]
    return tuple(v.decode() if isinstance(v, bytes) else str(v) for v in np.asarray(value).ravel())


def _attr(node, key: str, path: Path):
    if key not in node.attrs:
        raise DataError(f"{path}: {node.name!r} lacks the attribute {key!r} that The Well's format requires")
    return node.attrs[key]


def _flag(node, key: str, path: Path) -> bool:
    return bool(_attr(node, key, path))


def _node(parent, key: str, path: Path, kind: type):
    node = parent.get(key)
    if not isinstance(node, kind):
        what = "missing" if node is None else f"a {type(node).__name__}"
        raise DataError(f"{path}: '{parent.name.rstrip('/')}/{key}' is {what}, expected a {kind.__name__}")
    return node


def recognises(f: h5py.File) -> bool:
    """True when `f` has The Well's ``t0_fields`` and ``dimensions`` groups and ``dataset_name``."""
    return (isinstance(f.get("t0_fields"), h5py.Group) and isinstance(f.get("dimensions"), h5py.Group)
            and "dataset_name" in f.attrs)


def _grid(f: h5py.File, path: Path) -> tuple[tuple[str, ...], tuple[np.ndarray, ...], np.ndarray]:
    """(axis names, one coordinate array per axis, the [T] times) from ``dimensions``."""
    dims = _node(f, "dimensions", path, h5py.Group)
    axes = _names(_attr(dims, "spatial_dims", path))
    n_dims = int(_attr(f, "n_spatial_dims", path))
    if not 1 <= len(axes) <= 3 or len(axes) != n_dims:
        raise DataError(f"{path}: 'dimensions' attribute 'spatial_dims' is {list(axes)} but 'n_spatial_dims' is "
                        f"{n_dims}; expected 1 to 3 axes, one per spatial dimension")
    coords = []
    for key in (*axes, "time"):
        node = _node(dims, key, path, h5py.Dataset)
        if not np.issubdtype(node.dtype, np.number) or node.ndim not in (1, 2):
            raise DataError(f"{path}: 'dimensions/{key}' has dtype {node.dtype} and shape {list(node.shape)}, "
                            f"expected numbers [n] or [N, n]")
        if key != "time" and node.attrs.get("time_varying", False):
            raise DataError(f"{path}: 'dimensions/{key}' is time-varying; a moving grid is not supported "
                            f"(The Well's own reader does not support it either)")
        # sample-varying: one row per trajectory; we take sample 0's (the description holds one
        # grid), as the PDEBench reader does with its [N, T] times
        values = node[0] if node.ndim == 2 else node[()]
        coords.append(np.asarray(values, dtype=np.float64))
    return axes, tuple(coords[:-1]), coords[-1]


def _ends(mask: h5py.Dataset, axis: int) -> bool:
    """True where `mask` is set at both ends of `axis` (any point of the other axes, as the_well)."""
    first = (slice(None),) * axis + (0,)
    last = (slice(None),) * axis + (-1,)
    return bool(np.any(mask[first]) and np.any(mask[last]))


def _periodic(f: h5py.File, axes: tuple[str, ...], path: Path) -> tuple[bool, ...]:
    """Per axis: a PERIODIC boundary group covers both its ends. An axis no group names is open in
    The Well's convention (``_padding_bcs``: "Open unless otherwise specified"), so False."""
    flags, bcs = [False] * len(axes), f.get("boundary_conditions")
    for name, bc in (bcs.items() if bcs is not None else ()):
        if str(_attr(bc, "bc_type", path)).upper() != "PERIODIC":
            continue
        dims = _names(_attr(bc, "associated_dims", path))
        mask = _node(bc, "mask", path, h5py.Dataset)
        if mask.ndim < len(dims):
            raise DataError(f"{path}: 'boundary_conditions/{name}/mask' has shape {list(mask.shape)}, fewer axes "
                            f"than its associated_dims {list(dims)}")
        for k, dim in enumerate(dims):
            if dim not in axes:
                raise DataError(f"{path}: 'boundary_conditions/{name}' names axis {dim!r}, not one of {list(axes)}")
            # the mask's spatial axes come last, after [N] and [T] where it varies in them
            flags[axes.index(dim)] |= _ends(mask, mask.ndim - len(dims) + k)
    return tuple(flags)


def _spec(name: str, order: int, axes: tuple[str, ...]) -> FieldSpec:
    if order == 0:
        return FieldSpec.scalar(name)
    if order == 1:
        return FieldSpec.vector(name, axes)
    return FieldSpec(name=name, kind="tensor", components=tuple(f"{name}_{a}{b}" for a in axes for b in axes))


def _group_names(group: h5py.Group, path: Path) -> tuple[str, ...]:
    """`field_names` of `group`, checked to list exactly the datasets the group holds."""
    names, present = _names(_attr(group, "field_names", path)), set(group.keys())
    missing, extra = [n for n in names if n not in present], sorted(present - set(names))
    if missing or extra or len(set(names)) != len(names):
        raise DataError(f"{path}: {group.name!r} attribute 'field_names' lists {list(names)} but the group holds "
                        f"{sorted(present)} (listed, absent: {missing}; present, unlisted: {extra})")
    return names


def _fields(f: h5py.File, path: Path, n: int, steps: int, axes, shape) -> list[dict]:
    """Every field of ``t0/t1/t2_fields``, checked, as reader entries: key, FieldSpec, flags."""
    out, first = [], None
    for order, group_key in enumerate(FIELD_GROUPS):
        if group_key not in f:  # the format writes all three, some files may omit an empty one
            continue
        group = _node(f, group_key, path, h5py.Group)
        for name in _group_names(group, path):
            key = f"{group_key}/{name}"
            node = _node(group, name, path, h5py.Dataset)
            if not np.issubdtype(node.dtype, np.floating):
                raise DataError(f"{path}: {key!r} has dtype {node.dtype}, expected floating point")
            sample, timed = _flag(node, "sample_varying", path), _flag(node, "time_varying", path)
            dim_varying = tuple(bool(v) for v in np.asarray(_attr(node, "dim_varying", path)).ravel())
            if len(dim_varying) != len(axes):
                raise DataError(f"{path}: {key!r} attribute 'dim_varying' is {list(dim_varying)}, expected one flag "
                                f"per axis of {list(axes)}")
            lead, tail = ((n,) if sample else ()) + ((steps,) if timed else ()), (len(axes),) * order
            expected = (*lead, *(s for s, v in zip(shape, dim_varying) if v), *tail)  # the spec's form
            if node.shape == expected:
                stored = dim_varying
            elif node.shape == (*lead, *(s if v else 1 for s, v in zip(shape, dim_varying)), *tail):
                stored = (True,) * len(axes)  # size 1 where constant: the form WellDataset's tiling reads
            else:
                seen = f"; {first[0]!r} has {list(first[1])}" if first else ""
                raise DataError(f"{path}: {key!r} has shape {list(node.shape)} but the file's N={n}, T={steps} and "
                                f"grid {list(shape)} give {list(expected)}{seen}")
            first = first or (key, node.shape)
            out.append(dict(key=key, spec=_spec(name, order, axes), sample_varying=sample, time_varying=timed,
                            dim_varying=dim_varying, stored_axes=stored))
    return out


def _scalars(f: h5py.File, path: Path) -> tuple[dict[str, float], list[str], list[str]]:
    """(constant scalars: the parameters, names of the per-trajectory ones, their keys)."""
    params, per_traj, keys = {}, [], []
    group = f.get("scalars")
    if group is None:
        return params, per_traj, keys
    for name in _group_names(_node(f, "scalars", path, h5py.Group), path):
        node = _node(group, name, path, h5py.Dataset)
        sample, timed = _flag(node, "sample_varying", path), _flag(node, "time_varying", path)
        if timed:
            warnings.warn(f"{path}: 'scalars/{name}' varies in time; time-varying scalars are not read",
                          stacklevel=3)
        elif sample:
            per_traj.append(name)
            keys.append(f"scalars/{name}")
        else:
            value = node[()]
            if not np.issubdtype(node.dtype, np.number) or np.size(value) != 1:
                raise DataError(f"{path}: 'scalars/{name}' has dtype {node.dtype} and shape {list(node.shape)}, "
                                f"expected one number (a constant scalar)")
            params[name] = float(np.asarray(value).ravel()[0])
    return params, per_traj, keys


def _split(path: Path) -> str | None:
    return path.parent.name if path.parent.name in SPLITS else None


def _describe_file(path: Path) -> DatasetDescription:
    """One file as a one-source description (`describe_files` merges those of one task)."""
    with open_h5(path) as f:
        if not recognises(f):
            raise DataError(f"{path}: not The Well's format: needs groups 't0_fields' and 'dimensions' and the "
                            f"root attribute 'dataset_name' (keys present: {sorted(f.keys())[:20]})")
        axes, coords, times = _grid(f, path)
        n = int(_attr(f, "n_trajectories", path))
        shape = tuple(len(c) for c in coords)
        entries = _fields(f, path, n, len(times), axes, shape)
        params, per_traj, scalar_keys = _scalars(f, path)
        name = _names(f.attrs["dataset_name"])[0]
        grid = GridSpec(axes=axes, coords=coords, periodic=_periodic(f, axes, path))
        grid_type = str(f.attrs.get("grid_type", "cartesian"))
    state = tuple({k: v for k, v in e.items() if k != "spec"} for e in entries if e["time_varying"])
    constant = tuple({k: v for k, v in e.items() if k != "spec"} for e in entries if not e["time_varying"])
    try:
        return DatasetDescription(
            name=name, layout="the_well", fields=tuple(e["spec"] for e in entries if e["time_varying"]),
            constants=tuple(e["spec"] for e in entries if not e["time_varying"]), grid=grid, times=times,
            parameters=params, per_trajectory=tuple(per_traj),
            sources=(Source(path=path, split=_split(path), trajectories=n, size_bytes=path.stat().st_size),),
            reader_state={"fields": state, "constants": constant, "per_trajectory_keys": tuple(scalar_keys),
                          "grid_type": grid_type})
    except ValueError as err:  # no time-varying field, or channel names that repeat
        raise DataError(f"{path}: {', '.join(FIELD_GROUPS)}: {err}") from None


def _merge(descs: list[DatasetDescription]) -> DatasetDescription:
    """One description of one task's files: the first's metadata, every file as a source."""
    head = descs[0]
    for d in descs[1:]:
        ours, theirs = head.sources[0].path, d.sources[0].path
        for key, a, b in (("t0/t1/t2_fields", head.reader_state["fields"], d.reader_state["fields"]),
                          ("t0/t1/t2_fields", head.reader_state["constants"], d.reader_state["constants"]),
                          ("dimensions", head.grid, d.grid), ("dimensions/time", head.steps, d.steps),
                          ("scalars", head.per_trajectory, d.per_trajectory)):
            if a != b:
                raise DataError(f"{theirs}: {key!r} differs from {ours}'s, a file of the same dataset and "
                                f"parameters ({head.identity}); one task's files must agree")
    order = {s: i for i, s in enumerate(SPLITS)}
    sources = sorted((d.sources[0] for d in descs), key=lambda s: (order.get(s.split, len(SPLITS)), str(s.path)))
    return DatasetDescription(
        name=head.name, layout="the_well", fields=head.fields, constants=head.constants, grid=head.grid,
        times=head.times, parameters=head.parameters, per_trajectory=head.per_trajectory, sources=tuple(sources),
        reader_state=head.reader_state)


def describe_files(paths: list[Path], options: Mapping[str, object]) -> list[DatasetDescription]:
    """One description per task: files grouped by (``dataset_name``, constant scalars), each file
    (one parameter set in The Well) a source whose split is its ``train``/``valid``/``test`` folder.

    Raises:
        DataError: no file, options given, or a file that breaks the format (names file and key).
    """
    if not paths:
        raise DataError("the_well: no HDF5 file to describe (an empty folder or split?)")
    if options:
        raise DataError(f"{paths[0]}: the the_well layout takes no options, got {sorted(options)}")
    tasks: dict[tuple, list[DatasetDescription]] = {}
    for path in paths:
        d = _describe_file(Path(path))
        tasks.setdefault((d.name, tuple(sorted(d.parameters.items()))), []).append(d)
    return [_merge(group) for group in tasks.values()]


def _read(f: h5py.File, entry: Mapping, row: int, t: slice | None, x_step: int, shape) -> np.ndarray:
    """One field's [T, C, *S] (or [C, *S] when `t` is None), reading only that slice. An axis the
    field does not vary in (``dim_varying`` false) is broadcast, as ``WellDataset._pad_axes`` tiles
    it, whether the file omits it (the spec) or stores it with size 1."""
    node = f[entry["key"]]
    index = ((row,) if entry["sample_varying"] else ()) + ((t,) if t is not None else ())
    index += tuple(slice(None, None, x_step if varying else None)
                   for varying, stored in zip(entry["dim_varying"], entry["stored_axes"]) if stored)
    lead = 1 if t is not None else 0
    order = node.ndim - len(index)  # the row index drops its axis, so what is left is D^order
    data = node[index + (slice(None),) * order]  # [T?, *S', D^order]: the window only
    space = data.shape[:data.ndim - order]
    data = data.reshape(*space, int(np.prod(data.shape[data.ndim - order:])))  # components last, t2 row-major
    data = np.moveaxis(data, -1, lead)  # [T?, C, *S']
    for axis, stored in enumerate(entry["stored_axes"]):
        if not stored:
            data = np.expand_dims(data, lead + 1 + axis)
    sub = tuple(len(range(0, s, x_step)) for s in shape)
    return np.broadcast_to(data, (*data.shape[:lead + 1], *sub))


def read_window(desc: DatasetDescription, f: h5py.File, row: int, t: slice, x_step: int) -> np.ndarray:
    """[T, C, *S] float32 of trajectory `row` of the open file `f`, steps `t`, every `x_step`-th point."""
    parts = [_read(f, e, row, t, x_step, desc.grid.shape) for e in desc.reader_state["fields"]]
    return np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.float32)


def read_constants(desc: DatasetDescription, f: h5py.File, row: int, x_step: int) -> np.ndarray:
    """[C, *S] float32 of trajectory `row`'s constant (not time-varying) fields."""
    parts = [_read(f, e, row, None, x_step, desc.grid.shape) for e in desc.reader_state["constants"]]
    return np.ascontiguousarray(np.concatenate(parts, axis=0), dtype=np.float32)


register_layout(Layout(name="the_well", open=open_h5, recognises=recogniser(recognises), check=check_h5, describe_files=describe_files,
                       read_window=read_window, read_constants=read_constants))
