"""Gridded PDE data in any of the layouts we read, described by one type and read lazily.

Legend: T time steps, C channels, S spatial axes.

``describe(path, layout)`` expands `path` (a file, a folder or a glob) into HDF5 files, picks the
layout reader (``auto``: the one that recognises a file's keys) and returns one
`DatasetDescription` per task the files hold, after `pipelines.layouts.sizes` has checked from
metadata that every file stores what it declares and that a trajectory fits in memory.
``read_window(s)`` and ``read_constants(_each)`` read trajectories' slices through the reader named
in the description, never a whole file.

A layout module provides four functions:
  ``recognises(f: h5py.File) -> bool``: the file's keys are this layout's;
  ``describe_files(paths: list[Path], options: Mapping) -> list[DatasetDescription]``;
  ``read_window(desc, f, row, t: slice, x_step: int) -> np.ndarray [T, C, *S] float32``;
  ``read_constants(desc, f, row, x_step: int) -> np.ndarray [C, *S] float32``,
where ``f`` is the source's file, opened by the caller (`read_windows` opens each file once for many
trajectories) and ``row`` the trajectory's index in it.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from pipelines.file_facts import cached_fact
from pipelines.layouts.description import LAYOUTS, DataError, DatasetDescription, FieldSpec, GridSpec, Source
from pipelines.layouts.h5 import open_h5
from pipelines.layouts.sizes import check_file, check_trajectory

__all__ = ["DataError", "DatasetDescription", "FieldSpec", "GridSpec", "Source", "LAYOUTS", "describe",
           "expand_path", "glob_files", "is_glob", "detect_layout", "read_window", "read_windows", "read_constants",
           "read_constants_each"]

_READERS = {"pdebench": "pipelines.layouts.pdebench", "the_well": "pipelines.layouts.the_well",
            "hdf5": "pipelines.layouts.user_hdf5"}
_SUFFIXES = (".h5", ".hdf5", ".hdf")
_AUTO_ORDER = ("the_well", "pdebench")
"""``auto`` tries these; the ``hdf5`` layout needs the config's field keys and is never guessed."""


def _reader(layout: str):
    if layout not in _READERS:
        raise DataError(f"unknown layout {layout!r}; known layouts: {', '.join(LAYOUTS)}")
    return importlib.import_module(_READERS[layout])


def is_glob(path: str | Path) -> bool:
    """Whether `path` is a glob pattern (holds ``*``, ``?`` or ``[``) rather than a file or folder name."""
    return any(ch in str(path) for ch in "*?[")


def glob_files(pattern: str) -> list[Path]:
    """The files `pattern` matches, sorted, as `glob.glob(pattern, recursive=True)` finds them (a
    wildcard skips names starting with "."), except that ``**`` follows no symbolic link to a
    folder: glob's does, so a folder holding links to itself was walked without end (issue 47).
    pathlib's ``glob`` (Python 3.11, 3.12) descends into no linked folder under ``**``."""
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if is_glob(part))
    root = Path(*parts[:first]) if first else Path(".")
    dotted = any(part.startswith(".") for part in parts[first:])
    found = []
    for p in root.glob(str(Path(*parts[first:]))):
        if not dotted and any(part.startswith(".") for part in p.relative_to(root).parts):
            continue  # glob.glob's rule: a hidden name is matched only by a pattern that names it
        if p.is_file():
            found.append(p)
    return sorted(found)


def expand_path(path: str | Path) -> list[Path]:
    """The HDF5 files `path` names, sorted: the file itself, every HDF5 file under a folder
    (recursively), or a glob's matches. `DataError` when there are none."""
    text = str(path)
    if is_glob(text):
        files = glob_files(text)
        what = "no file matches the glob"
    elif Path(text).is_dir():
        files = sorted(p for p in Path(text).rglob("*") if p.is_file() and p.suffix in _SUFFIXES)
        what = f"the folder holds no HDF5 file ({', '.join(_SUFFIXES)})"
    elif Path(text).is_file():
        return [Path(text)]
    else:
        raise DataError(f"{text}: no such file or folder")
    if not files:
        raise DataError(f"{text}: {what}")
    return files


def detect_layout(path: Path) -> str:
    """The layout whose keys `path` has (``the_well`` or ``pdebench``); `DataError` listing the
    keys present when neither recognises it."""
    with open_h5(path) as f:
        for layout in _AUTO_ORDER:
            if _reader(layout).recognises(f):
                return layout
        keys = sorted(f.keys())[:20]
    raise DataError(f"{path}: not a PDEBench or The Well file (keys present: {keys}); "
                    f"name its layout, e.g. layout: hdf5 with the key and axes of each field")


def describe(path: str | Path, layout: str = "auto", *,
             options: Mapping[str, object] | None = None) -> tuple[DatasetDescription, ...]:
    """One description per task that the files under `path` hold.

    Args:
        path: a file, a folder (searched recursively) or a glob.
        layout: one of `LAYOUTS`; ``auto`` detects each file's layout, and all must agree.
        options: layout options (the ``hdf5`` layout's field keys and axes).
    Raises:
        DataError: no file, an unknown layout, or a file the layout cannot read (the message names
            the file and the key).
    """
    if layout not in LAYOUTS:
        raise DataError(f"{path}: unknown layout {layout!r}; known layouts: {', '.join(LAYOUTS)}")
    files = expand_path(path)
    options_text = json.dumps(dict(options or {}), sort_keys=True)
    read = lambda: _describe_files(path, files, layout, options_text)  # noqa: E731
    if len(files) > 1:
        return read()
    # A task's file is described in many places (splits, loaders, cache, evaluation), and a file of
    # per-sample groups costs a metadata read per sample: one description per version of the file.
    return cached_fact(files[0], f"description/{layout}/{options_text}", read, beside=False)


def _describe_files(path, files: list[Path], layout: str, options: str) -> tuple[DatasetDescription, ...]:
    for p in files:  # before any reader reads a value (a coordinate, a time, a sample)
        with open_h5(p) as f:
            check_file(f, p)
    if layout == "auto":
        found = {p: detect_layout(p) for p in files}
        kinds = sorted(set(found.values()))
        if len(kinds) > 1:
            raise DataError(f"{path}: files of several layouts ({', '.join(kinds)}); name one folder per layout")
        layout = kinds[0]
    descriptions = tuple(_reader(layout).describe_files(files, json.loads(options)))
    for desc in descriptions:
        check_trajectory(desc)
    return descriptions


def _read_each(desc: DatasetDescription, trajectories, read) -> list[np.ndarray]:
    """``read(f, row)`` for every trajectory (global indices), each source file opened once."""
    handles = {}
    try:
        out = []
        for trajectory in trajectories:
            source, row = desc.locate(int(trajectory))
            if source.path not in handles:
                handles[source.path] = open_h5(source.path)
            out.append(read(handles[source.path], row))
        return out
    finally:
        for f in handles.values():
            f.close()


def read_windows(desc: DatasetDescription, trajectories, *, t_start: int = 0, t_stop: int | None = None,
                 t_step: int = 1, x_step: int = 1) -> list[np.ndarray]:
    """Steps ``t_start:t_stop:t_step`` of each of `trajectories` (global indices over the
    description's sources), every `x_step`-th point per axis: one [T, C, *S] float32 array each (a
    steady dataset: T = 1). Each file is opened once for all of them."""
    if t_step < 1 or x_step < 1:
        raise ValueError(f"t_step and x_step must be >= 1, got {t_step}, {x_step}")
    reader, t = _reader(desc.layout), slice(t_start, t_stop, t_step)
    return _read_each(desc, trajectories, lambda f, row: reader.read_window(desc, f, row, t, x_step))


def read_window(desc: DatasetDescription, trajectory: int, **window) -> np.ndarray:
    """`read_windows` of one trajectory."""
    return read_windows(desc, [trajectory], **window)[0]


def read_constants_each(desc: DatasetDescription, trajectories, *, x_step: int = 1) -> list[np.ndarray] | None:
    """The constant input fields of each of `trajectories`, [C, *S] float32 each (each file opened
    once), or None when the dataset has none."""
    if not desc.constants:
        return None
    reader = _reader(desc.layout)
    return _read_each(desc, trajectories, lambda f, row: reader.read_constants(desc, f, row, x_step))


def read_constants(desc: DatasetDescription, trajectory: int, *, x_step: int = 1) -> np.ndarray | None:
    """`read_constants_each` of one trajectory."""
    each = read_constants_each(desc, [trajectory], x_step=x_step)
    return None if each is None else each[0]
