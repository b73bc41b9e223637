"""A user's own HDF5 file: the config names each field's dataset key and its axis order.

Legend: N trajectories, T time steps, C channels, S spatial axes.

Options (``data.tasks[i].hdf5`` in a config, or ``--option`` of ``pipelines.inspect``)::

    name: my_flow                           # the dataset's name (default: the file's stem)
    fields:                                 # state fields, in channel order
      - {key: u, axes: n t x y}             # a scalar field [N, T, X, Y]
      - {key: vel, axes: n t x y c, name: velocity, kind: vector}
      - {key: nu, axes: n x y, input: true} # an input only, constant in time
    coords: {x: xc, y: yc}                  # optional 1D coordinate datasets per axis
    times: t                                # optional [T] (or [N, T]: sample 0's) times
    periodic: [true, true]                  # optional, per spatial axis
    parameters: {nu: 0.01}                  # optional scalar PDE constants

Axis letters: ``n`` trajectory (required), ``t`` time (absent: a steady field), ``x``, ``y``, ``z``
space in that order, ``c`` channel (absent: one channel).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np

from pipelines.layouts.description import DataError, DatasetDescription, FieldSpec, GridSpec, Source
from pipelines.layouts.h5 import open_h5
from pipelines.layouts.registry import Layout, register_layout
from pipelines.layouts.sizes import check_h5

__all__ = ["describe_files", "read_window", "read_constants", "OPTION_KEYS"]

OPTION_KEYS = ("name", "fields", "coords", "times", "periodic", "parameters")
_FIELD_KEYS = ("key", "axes", "name", "kind", "input")
_SPACE = ("x", "y", "z")


def _field_option(path: Path, i: int, spec) -> dict:
    if not isinstance(spec, Mapping) or "key" not in spec or "axes" not in spec:
        raise DataError(f"{path}: hdf5 option fields[{i}] must be a mapping with 'key' and 'axes', got {spec!r}")
    unknown = sorted(set(spec) - set(_FIELD_KEYS))
    if unknown:
        raise DataError(f"{path}: hdf5 option fields[{i}] has unknown keys {unknown}; known: {', '.join(_FIELD_KEYS)}")
    axes = tuple(str(spec["axes"]).split())
    letters = [a for a in axes if a not in ("n", "t", "c")]
    if (len(set(axes)) != len(axes) or "n" not in axes or any(a not in _SPACE for a in letters)
            or tuple(letters) != _SPACE[:len(letters)] or not letters):
        raise DataError(f"{path}: field {spec['key']!r} has axes {' '.join(axes)!r}; use the letters n, t, x, y, z, c "
                        f"once each, with n and the spatial axes in order x, y, z (e.g. 'n t x y c')")
    kind = spec.get("kind", "vector" if "c" in axes else "scalar")
    if kind not in ("scalar", "vector", "tensor"):
        raise DataError(f"{path}: field {spec['key']!r} has kind {kind!r}; use scalar, vector or tensor")
    return {"key": str(spec["key"]), "axes": axes, "name": str(spec.get("name", spec["key"])), "kind": kind,
            "input": bool(spec.get("input", False))}


def _field_spec(opt: dict, node: h5py.Dataset, dims: int) -> FieldSpec:
    if "c" not in opt["axes"]:
        return FieldSpec.scalar(opt["name"])
    n = node.shape[opt["axes"].index("c")]
    if opt["kind"] == "vector" and n == dims:
        return FieldSpec.vector(opt["name"], _SPACE[:dims])
    return FieldSpec(name=opt["name"], kind=opt["kind"], components=tuple(f"{opt['name']}_{i}" for i in range(n)))


def _checked(f: h5py.File, path: Path, opt: dict) -> h5py.Dataset:
    key = opt["key"]
    if key not in f or not isinstance(f[key], h5py.Dataset):
        raise DataError(f"{path}: no dataset {key!r}; datasets present: {sorted(f.keys())[:20]}")
    node = f[key]
    if not np.issubdtype(node.dtype, np.floating):
        raise DataError(f"{path}: dataset {key!r} has dtype {node.dtype}, expected floating point")
    if node.ndim != len(opt["axes"]):
        raise DataError(f"{path}: dataset {key!r} has shape {list(node.shape)} ({node.ndim} axes) but its axes are "
                        f"{' '.join(opt['axes'])!r} ({len(opt['axes'])})")
    return node


def _sizes(node: h5py.Dataset, axes: tuple[str, ...]) -> dict[str, int]:
    return dict(zip(axes, node.shape, strict=True))


def _describe(path: Path, options: Mapping) -> DatasetDescription:
    raw = options.get("fields") or []
    if not raw:
        raise DataError(f"{path}: layout hdf5 needs 'fields': the dataset key and axes of each field")
    opts = [_field_option(path, i, spec) for i, spec in enumerate(raw)]
    with h5py.File(path, "r") as f:
        nodes = [_checked(f, path, o) for o in opts]
        sizes = [_sizes(node, o["axes"]) for node, o in zip(nodes, opts, strict=True)]
        state = [s for s, o in zip(sizes, opts, strict=True) if not o["input"]]
        if not state:
            raise DataError(f"{path}: every field is an input; at least one must be a state field (input: false)")
        ref = state[0]
        for s, o in zip(sizes, opts, strict=True):
            common = {a: s[a] for a in s if a in ("n", *_SPACE) or (a == "t" and not o["input"])}
            if any(ref.get(a) != n for a, n in common.items()):
                raise DataError(f"{path}: field {o['key']!r} has sizes {s} but {opts[0]['key']!r} has {ref}")
        dims = sum(a in ref for a in _SPACE)
        axes, shape = _SPACE[:dims], tuple(ref[a] for a in _SPACE[:dims])
        coords = tuple(_coord(f, path, options.get("coords", {}).get(a), n) for a, n in zip(axes, shape, strict=True))
        times = _times(f, path, options.get("times"), ref.get("t"))
        fields = [_field_spec(o, node, dims) for o, node in zip(opts, nodes, strict=True)]
    periodic = tuple(options.get("periodic") or (None,) * dims)
    if len(periodic) != dims:
        raise DataError(f"{path}: option periodic lists {len(periodic)} axes but the fields have {dims}")
    return DatasetDescription(
        name=str(options.get("name") or path.stem), layout="hdf5",
        fields=tuple(fs for fs, o in zip(fields, opts, strict=True) if not o["input"]),
        constants=tuple(fs for fs, o in zip(fields, opts, strict=True) if o["input"]),
        grid=GridSpec(axes=axes, coords=coords, periodic=periodic), times=times,
        parameters={str(k): float(v) for k, v in (options.get("parameters") or {}).items()},
        sources=(Source(path=path, split=None, trajectories=ref["n"], size_bytes=path.stat().st_size),),
        reader_state={"fields": tuple(o for o in opts if not o["input"]), "inputs": tuple(o for o in opts if o["input"])})


def _coord(f, path: Path, key, n: int) -> np.ndarray:
    if key is None:
        return (np.arange(n) + 0.5) / n
    if key not in f or f[key].ndim != 1 or len(f[key]) != n:
        raise DataError(f"{path}: coordinate {key!r} must be a 1D dataset of {n} points")
    return np.asarray(f[key][()], dtype=np.float64)


def _times(f, path: Path, key, steps: int | None) -> np.ndarray | None:
    if steps is None:
        return None
    if key is None:
        return np.arange(steps, dtype=np.float64)
    if key not in f or f[key].ndim not in (1, 2) or f[key].shape[-1] != steps:
        raise DataError(f"{path}: times {key!r} must be a [T] or [N, T] dataset with T = {steps}")
    return np.asarray(f[key][0] if f[key].ndim == 2 else f[key][()], dtype=np.float64)


def describe_files(paths: list[Path], options: Mapping[str, object]) -> list[DatasetDescription]:
    """One description per file, each read with the same options."""
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise DataError(f"{paths[0]}: unknown hdf5 options {unknown}; known: {', '.join(OPTION_KEYS)}")
    return [_describe(p, options) for p in paths]


def _read(node: h5py.Dataset, axes: tuple[str, ...], row: int, t: slice | None, x_step: int) -> np.ndarray:
    """One field's slice in the canonical order [T?, C, *S] (T only when the field has it)."""
    index = tuple(row if a == "n" else t if a == "t" else slice(None) if a == "c" else slice(None, None, x_step)
                  for a in axes)
    kept = [a for a in axes if a != "n"]
    data = node[index]
    if "c" not in kept:
        data, kept = data[..., None], [*kept, "c"]
    order = (["t"] if "t" in kept else []) + ["c"] + [a for a in _SPACE if a in kept]
    return np.transpose(data, [kept.index(a) for a in order])


def read_window(desc: DatasetDescription, f: h5py.File, row: int, t: slice, x_step: int) -> np.ndarray:
    """[T, C, *S] float32 of trajectory `row` (a steady dataset: T = 1)."""
    parts = []
    for o in desc.reader_state["fields"]:
        part = _read(f[o["key"]], o["axes"], row, t if desc.times is not None else None, x_step)
        parts.append(part if desc.times is not None else part[None])
    return np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.float32)


def read_constants(desc: DatasetDescription, f: h5py.File, row: int, x_step: int) -> np.ndarray:
    """[C, *S] float32 of trajectory `row`'s input fields."""
    parts = [_read(f[o["key"]], o["axes"], row, slice(0, 1), x_step) for o in desc.reader_state["inputs"]]
    parts = [p[0] if "t" in o["axes"] else p for p, o in zip(parts, desc.reader_state["inputs"], strict=True)]
    return np.ascontiguousarray(np.concatenate(parts, axis=0), dtype=np.float32)


# No `recognises`: a user's layout is named in the config (with its keys), never guessed.
register_layout(Layout(name="hdf5", open=open_h5, check=check_h5, describe_files=describe_files,
                       read_window=read_window, read_constants=read_constants))
