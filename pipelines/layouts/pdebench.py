# long file: one file format in its five published variants; they share the checks and the lazy reads
"""PDEBench's HDF5 layouts, recognised by their keys (file names are hints, not requirements).

Legend: N samples, T time steps, C channels, X/Y/Z grid points, S spatial axes.

What PDEBench publishes (github.com/pdebench/PDEBench; keys and shapes as its own loader reads
them, ``pdebench/models/fno/utils.py`` ``FNODatasetSingle``, and as its generators write them):

* **scalar** (1D advection, Burgers, reaction-diffusion; ``data_gen_NLE/Data_Merge.py``):
  ``tensor`` [N, T, X], ``x-coordinate`` [X], ``t-coordinate`` [T + 1].
* **darcy** (2D Darcy flow, steady): ``tensor`` [N, 1, X, Y] (the solution), ``nu`` [N, X, Y]
  (the coefficient, an input), ``x-coordinate``, ``y-coordinate``.
* **cfd** (1D/2D/3D compressible flow, ``*_CFD_*``): ``density``, ``pressure``, ``Vx``(, ``Vy``,
  ``Vz``) [N, T, *S], ``x-coordinate``(, ``y-``, ``z-coordinate``), ``t-coordinate`` [T + 1];
  channels in the loader's order: density, pressure, then velocity.
* **groups** (2D diffusion-reaction, 2D shallow water, 1D diffusion-sorption;
  ``data_gen/gen_diff_react.py``, ``sim_radial_dam_break.py``): one group per sample (``0000``,
  ``0001`` ...) holding ``data`` [T, *S, C] and ``grid/x``(, ``grid/y``), ``grid/t`` [T].
* **ns_incompressible** (``data_gen/src/sim_ns_incomp_2d.py``): ``velocity`` [N, T, X, Y, 2],
  ``particles`` [N, T, X, Y, 1] (a passive tracer), ``force`` [N, X, Y, 2] (an input), ``t`` [N, T];
  no coordinates: the unit square's cell centres.

Our generated files add, in attributes only, what PDEBench's do not say: ``channel_names`` (the
groups layout's channels), ``vorticity`` [N, T, X, Y] beside ``velocity`` for our 2D
Navier-Stokes, and the PDE parameter (``beta``, ``Nu``, ...). PDEBench's readers ignore both.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np

from pipelines.layouts.description import DataError, DatasetDescription, FieldSpec, GridSpec, Source
from pipelines.layouts.fields_from import fields_from_channels, name_and_parameters
from pipelines.layouts.h5 import float_dataset, open_h5, recogniser
from pipelines.layouts.registry import Layout, register_layout
from pipelines.layouts.sizes import check_h5

__all__ = ["recognises", "describe_files", "read_window", "read_rows", "read_constants", "read_constant_rows",
           "variant"]

_AXES = ("x", "y", "z")
_CFD_VELOCITY = ("Vx", "Vy", "Vz")
_GROUP_CHANNELS = {"diff-react": ("u", "v"), "rdb": ("h",), "diff-sorp": ("u",)}
"""PDEBench's channels of the groups layout by a file-name hint (its files do not name them)."""
_PERIODIC_HINTS = {"Advection": True, "Burgers": True, "periodic": True, "trans": False, "Darcy": False,
                   "diff-react": False, "rdb": False, "diff-sorp": False, "ns_incom": False}
_PARAM_ATTRS = ("beta", "Nu", "nu", "Rho", "M", "Eta", "Zeta")


def _is_sample_group(f: h5py.File, key: str) -> bool:
    return key.isdigit() and isinstance(f[key], h5py.Group) and "data" in f[key]


def variant(f: h5py.File) -> str | None:
    """Which of PDEBench's layouts `f` is (see the module docstring), or None."""
    keys = set(f.keys())
    if "tensor" in keys:
        return "darcy" if "nu" in keys else "scalar"
    if "density" in keys:
        return "cfd"
    if "velocity" in keys:
        return "ns_incompressible"
    if keys and _is_sample_group(f, min(keys)):
        return "groups"
    return None


def recognises(f: h5py.File) -> bool:
    """True when `f` has the keys of one of PDEBench's layouts."""
    return variant(f) is not None


def _coords(f, keys: tuple[str, ...], shape: tuple[int, ...], path: Path) -> tuple[np.ndarray, ...]:
    """One coordinate array per axis from `keys` where present, else the cell centres of [0, 1]."""
    out = []
    for key, n in zip(keys, shape, strict=True):
        if key in f:
            c = np.asarray(float_dataset(f, key, path, 1)[()], dtype=np.float64)
            if len(c) != n:
                raise DataError(f"{path}: {key!r} has {len(c)} points but the field has {n} on that axis")
            out.append(c)
        else:
            out.append((np.arange(n) + 0.5) / n)
    return tuple(out)


def _times(f, key: str, n_steps: int, path: Path) -> np.ndarray:
    """The [T] stored times: `key` holds T or T + 1 values (PDEBench: one past the last step)."""
    if key not in f:
        return np.arange(n_steps, dtype=np.float64)
    node = float_dataset(f, key, path, (1, 2))
    t = np.asarray(node[0] if node.ndim == 2 else node[()], dtype=np.float64)  # [N, T]: sample 0's
    if len(t) not in (n_steps, n_steps + 1):
        raise DataError(f"{path}: {key!r} has {len(t)} times but the field has {n_steps} steps")
    return t[:n_steps]


def _periodic(stem: str, dims: int, f: h5py.File) -> tuple[bool | None, ...]:
    if "periodic" in f.attrs:
        return (bool(f.attrs["periodic"]),) * dims
    for hint, periodic in _PERIODIC_HINTS.items():
        if hint in stem:
            return (periodic,) * dims
    return (None,) * dims


def _parameters(f: h5py.File, stem: str) -> tuple[str, dict[str, float]]:
    name, params = name_and_parameters(stem)
    for key in _PARAM_ATTRS:  # PDEBench's own attributes, and ours, win over the name
        if key in f.attrs:
            try:
                params[key] = float(f.attrs[key])
            except (TypeError, ValueError):
                pass
    return name, params


def _layout_of(f: h5py.File, path: Path) -> dict:
    """What `_describe` needs of each variant: state keys, fields, spatial shape, times key."""
    kind = variant(f)
    if kind == "scalar":
        u = float_dataset(f, "tensor", path, (3, 4, 5))
        dims = u.ndim - 2
        return dict(kind=kind, keys=("tensor",), fields=(FieldSpec.scalar("u"),), n=u.shape[0], steps=u.shape[1],
                    spatial=u.shape[2:], dims=dims)
    if kind == "darcy":
        u, nu = float_dataset(f, "tensor", path, 4), float_dataset(f, "nu", path, 3)
        if nu.shape != (u.shape[0], *u.shape[2:]):
            raise DataError(f"{path}: 'nu' has shape {list(nu.shape)} but 'tensor' {list(u.shape)}; expected "
                            f"nu [N, X, Y] and tensor [N, 1, X, Y]")
        return dict(kind=kind, keys=("tensor",), fields=(FieldSpec.scalar("u"),), n=u.shape[0], steps=None,
                    spatial=u.shape[2:], dims=2, constants=(FieldSpec.scalar("nu"),), constant_keys=("nu",))
    if kind == "cfd":
        return _cfd_layout(f, path)
    if kind == "ns_incompressible":
        return _ns_layout(f, path)
    return _groups_layout(f, path)


def _cfd_layout(f: h5py.File, path: Path) -> dict:
    rho = float_dataset(f, "density", path, (3, 4, 5))
    dims = rho.ndim - 2
    keys = ("density", "pressure", *_CFD_VELOCITY[:dims])
    for key in keys:
        if float_dataset(f, key, path, rho.ndim).shape != rho.shape:
            raise DataError(f"{path}: {key!r} has shape {list(f[key].shape)} but 'density' {list(rho.shape)}")
    fields = (FieldSpec.scalar("density"), FieldSpec.scalar("pressure"), FieldSpec.vector("velocity", _AXES[:dims]))
    return dict(kind="cfd", keys=keys, fields=fields, n=rho.shape[0], steps=rho.shape[1], spatial=rho.shape[2:],
                dims=dims)


def _ns_layout(f: h5py.File, path: Path) -> dict:
    vel = float_dataset(f, "velocity", path, 5)
    n, steps, spatial = vel.shape[0], vel.shape[1], vel.shape[2:4]
    keys, fields = [], []
    if "vorticity" in f:
        keys.append("vorticity")
        fields.append(FieldSpec.scalar("vorticity"))
        if float_dataset(f, "vorticity", path, 4).shape != vel.shape[:4]:
            raise DataError(f"{path}: 'vorticity' has shape {list(f['vorticity'].shape)}, expected {list(vel.shape[:4])}")
    keys.append("velocity")
    fields.append(FieldSpec.vector("velocity", ("x", "y")))
    if "particles" in f:
        if float_dataset(f, "particles", path, 5).shape != (*vel.shape[:4], 1):
            raise DataError(f"{path}: 'particles' has shape {list(f['particles'].shape)}, expected "
                            f"{[*vel.shape[:4], 1]}")
        keys.append("particles")
        fields.append(FieldSpec.scalar("particles"))
    layout = dict(kind="ns_incompressible", keys=tuple(keys), fields=tuple(fields), n=n, steps=steps,
                  spatial=spatial, dims=2, times_key="t")
    if "force" in f:
        if float_dataset(f, "force", path, 4).shape != (n, *spatial, 2):
            raise DataError(f"{path}: 'force' has shape {list(f['force'].shape)}, expected {[n, *spatial, 2]}")
        layout.update(constants=(FieldSpec.vector("force", ("x", "y")),), constant_keys=("force",))
    return layout


def _groups_layout(f: h5py.File, path: Path) -> dict:
    groups = sorted(k for k in f.keys() if _is_sample_group(f, k))
    first = float_dataset(f[groups[0]], "data", path, (3, 4, 5))
    for g in groups:
        shape = float_dataset(f[g], "data", path, first.ndim).shape
        if shape != first.shape:
            raise DataError(f"{path}: ragged samples: '{g}/data' has shape {list(shape)} but "
                            f"'{groups[0]}/data' {list(first.shape)}")
    dims, channels = first.ndim - 2, first.shape[-1]
    if "channel_names" in f.attrs:
        names = tuple(str(c) for c in f.attrs["channel_names"])
    else:
        names = next((v for k, v in _GROUP_CHANNELS.items() if k in path.stem), None)
        names = names or (("u",) if channels == 1 else tuple(f"u{i}" for i in range(channels)))
    if len(names) != channels:
        raise DataError(f"{path}: 'channel_names' lists {len(names)} channels but '{groups[0]}/data' has {channels}")
    return dict(kind="groups", keys=tuple(groups), fields=fields_from_channels(names, _AXES[:dims]), n=len(groups),
                steps=first.shape[0], spatial=first.shape[1:-1], dims=dims)


def _describe(path: Path) -> DatasetDescription:
    with open_h5(path) as f:
        if variant(f) is None:
            raise DataError(f"{path}: not one of PDEBench's layouts (keys present: {sorted(f.keys())[:20]}); "
                            f"expected 'tensor', 'density', 'velocity' or per-sample groups '0000/data'")
        lay = _layout_of(f, path)
        dims, groups = lay["dims"], lay["kind"] == "groups"
        grid_f = f[lay["keys"][0]]["grid"] if groups else f
        coord_keys = _AXES[:dims] if groups else tuple(f"{a}-coordinate" for a in _AXES[:dims])
        coords = _coords(grid_f, coord_keys, tuple(lay["spatial"]), path)
        times = None
        if lay["steps"] is not None:
            times = _times(grid_f, "t" if groups else lay.get("times_key", "t-coordinate"), lay["steps"], path)
        name, params = _parameters(f, path.stem)
        grid = GridSpec(axes=_AXES[:dims], coords=coords, periodic=_periodic(path.stem, dims, f))
    return DatasetDescription(
        name=name, layout="pdebench", fields=lay["fields"], constants=lay.get("constants", ()), grid=grid,
        times=times, parameters=params,
        sources=(Source(path=path, split=None, trajectories=lay["n"], size_bytes=path.stat().st_size),),
        reader_state={"variant": lay["kind"], "keys": lay["keys"], "constant_keys": lay.get("constant_keys", ())})


def describe_files(paths: list[Path], options: Mapping[str, object]) -> list[DatasetDescription]:
    """One description per file (a PDEBench file holds one task: one PDE at one parameter set)."""
    if options:
        raise DataError(f"{paths[0]}: the pdebench layout takes no options, got {sorted(options)}; "
                        f"field keys and axes are options of layout: hdf5")
    return [_describe(p) for p in paths]


def _sel(x_step: int, dims: int) -> tuple[slice, ...]:
    return (slice(None, None, x_step),) * dims


def _join(parts, channels: int, axis: int) -> np.ndarray:
    """The parts (one per dataset, their channels on `axis`) in one float32 array allocated once: a
    block of rows is held once, plus the part being read (a part holding every channel is returned)."""
    out, c = None, 0
    for part in parts:
        if out is None and part.shape[axis] == channels:  # one dataset holds every channel
            return np.ascontiguousarray(part, dtype=np.float32)
        if out is None:
            out = np.empty((*part.shape[:axis], channels, *part.shape[axis + 1:]), dtype=np.float32)
        out[(slice(None),) * axis + (slice(c, c + part.shape[axis]),)] = part
        c += part.shape[axis]
        del part  # before the next dataset is read
    return out


def read_rows(desc: DatasetDescription, f: h5py.File, rows, t: slice, x_step: int) -> np.ndarray:
    """[R, T, C, *S] float32 of the sorted, unique samples `rows` (a slice or an index list), steps
    `t`, every `x_step`-th point: one h5py read per dataset (per sample for the groups variant)."""
    state, space = desc.reader_state, _sel(x_step, desc.dims)
    kind = state["variant"]
    if kind == "groups":
        rows = range(rows.start, rows.stop) if isinstance(rows, slice) else rows
        out = None
        for i, r in enumerate(rows):
            w = np.moveaxis(f[state["keys"][int(r)]]["data"][(t, *space, slice(None))], -1, 1)
            out = np.empty((len(rows), *w.shape), dtype=np.float32) if out is None else out
            out[i] = w
        return out
    if kind == "darcy":  # steady: the one stored solution, T = 1
        return np.asarray(f["tensor"][(rows, slice(0, 1), *space)], dtype=np.float32)[:, :, None]
    parts = (f[key][(rows, t, *space)][:, :, None] if f[key].ndim == 2 + desc.dims  # [N, T, *S]: one channel
             else np.moveaxis(f[key][(rows, t, *space, slice(None))], -1, 2)  # [N, T, *S, C]
             for key in state["keys"])
    return _join(parts, len(desc.channels), 2)


def read_window(desc: DatasetDescription, f: h5py.File, row: int, t: slice, x_step: int) -> np.ndarray:
    """[T, C, *S] float32 of sample `row`, steps `t`, every `x_step`-th point (reads that slice only)."""
    return read_rows(desc, f, slice(row, row + 1), t, x_step)[0]


def read_constant_rows(desc: DatasetDescription, f: h5py.File, rows, x_step: int) -> np.ndarray:
    """[R, C, *S] float32 of the sorted, unique samples `rows`' constant inputs (Darcy's ``nu``, NS's
    ``force``): one h5py read per dataset."""
    space = _sel(x_step, desc.dims)
    parts = (f[key][(rows, *space)][:, None] if f[key].ndim == 1 + desc.dims
             else np.moveaxis(f[key][(rows, *space, slice(None))], -1, 1)
             for key in desc.reader_state["constant_keys"])
    return _join(parts, len(desc.constant_channels), 1)


def read_constants(desc: DatasetDescription, f: h5py.File, row: int, x_step: int) -> np.ndarray:
    """[C, *S] float32 of sample `row`'s constant inputs."""
    return read_constant_rows(desc, f, slice(row, row + 1), x_step)[0]


register_layout(Layout(name="pdebench", open=open_h5, recognises=recogniser(recognises), check=check_h5,
                       describe_files=describe_files, read_window=read_window, read_constants=read_constants,
                       read_rows=read_rows, read_constant_rows=read_constant_rows))
