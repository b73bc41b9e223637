"""Gridded PDE data in any of the layouts we read, described by one type and read lazily.

Legend: N trajectories, T time steps, C channels, S spatial axes.

``describe(path, layout)`` expands `path` (a file, a folder or a glob) into the layout's files, picks
the layout (``auto``: the registered one that recognises a file's keys) and returns one
`DatasetDescription` per task the files hold, after the layout's check (HDF5:
`pipelines.layouts.sizes`) has refused, from metadata, a file that does not store what it declares
or whose trajectory would not fit in memory. ``read_window(s)`` and ``read_constants(_each)`` read
trajectories' slices through the layout named in the description, never a whole file;
`DatasetReader` keeps the sources open across many reads (a loader's worker).

The layouts are registered by name (`pipelines.layouts.registry`): a layout module opens its own
sources and reads them; see `Layout` for what it provides (``open``, ``describe_files``,
``read_window``; ``read_constants``, ``recognises``, ``check`` and block reads where it has them)
and docs/extending.md.

Three things were called layout; one word each now:
  *layout* is a dataset's file format (`Layout`, ``data.tasks[i].layout``, ``--layout``);
  a generated task's on-disk variant is its *storage* (`pipelines.tasks.TaskSpec.storage`:
  ``tensor``, ``groups``, ``ns_incompressible``, ``declared``; it was ``TaskSpec.layout``); the
  codecs' *token layout* (`core/models/grid_codec.py`, `conv_codec.py`: how tokens tile the grid)
  keeps its name inside `core/`, which never reads a file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from pipelines.file_facts import cached_fact
from pipelines.layouts.description import DataError, DatasetDescription, FieldSpec, GridSpec, Source
from pipelines.layouts.h5 import keys_present
from pipelines.layouts.read import DatasetReader
from pipelines.layouts.registry import Layout, get_layout, guessable, layout_names, register_layout
from pipelines.layouts.sizes import check_trajectory

__all__ = ["DataError", "DatasetDescription", "FieldSpec", "GridSpec", "Source", "Layout", "DatasetReader",
           "register_layout", "get_layout", "layout_names", "describe", "expand_path", "glob_files", "is_glob",
           "detect_layout", "read_window", "read_windows", "read_constants", "read_constants_each"]


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


def _suffixes(layout: str) -> tuple[str, ...]:
    """The file suffixes a folder is searched for: the layout's, or (``auto``: also a data
    fingerprint's folder) every registered one's."""
    names = layout_names()[1:] if layout == "auto" else (layout,)
    return tuple(dict.fromkeys(s for name in names for s in get_layout(name).suffixes))


def expand_path(path: str | Path, layout: str = "auto") -> list[Path]:
    """The files `path` names, sorted: the file itself, every file of `layout`'s suffixes under a
    folder (recursively; ``auto``: every registered layout's suffixes), or a glob's matches.
    `DataError` when there are none."""
    text = str(path)
    if is_glob(text):
        files = glob_files(text)
        what = "no file matches the glob"
    elif Path(text).is_dir():
        suffixes = _suffixes(layout)
        files = sorted(p for p in Path(text).rglob("*") if p.is_file() and p.suffix in suffixes)
        kind = "HDF5 file" if set(suffixes) <= {".h5", ".hdf5", ".hdf"} else "data file"
        what = f"the folder holds no {kind} ({', '.join(suffixes)})"
    elif Path(text).is_file():
        return [Path(text)]
    else:
        raise DataError(f"{text}: no such file or folder")
    if not files:
        raise DataError(f"{text}: {what}")
    return files


def detect_layout(path: Path) -> str:
    """The first registered layout that recognises `path` (`guessable`: ``the_well``, ``pdebench``
    ...); `DataError` listing the file's keys when none does."""
    unreadable = None
    for lay in guessable():
        try:
            if lay.recognises(path):
                return lay.name
        except DataError as err:  # not this layout's format (a layout cannot open another's file)
            unreadable = unreadable or err
    tried = ", ".join(lay.name for lay in guessable())
    keys = keys_present(path)
    if keys is None and unreadable is not None:
        raise unreadable
    raise DataError(f"{path}: not a file of a layout auto recognises ({tried}; keys present: {keys}); "
                    f"name its layout, e.g. layout: hdf5 with the key and axes of each field")


def describe(path: str | Path, layout: str = "auto", *,
             options: Mapping[str, object] | None = None) -> tuple[DatasetDescription, ...]:
    """One description per task that the files under `path` hold.

    Args:
        path: a file, a folder (searched recursively) or a glob.
        layout: one of `layout_names()`; ``auto`` detects each file's layout, and all must agree.
        options: layout options (the ``hdf5`` layout's field keys and axes).
    Raises:
        DataError: no file, an unknown layout, or a file the layout cannot read (the message names
            the file and the key).
    """
    if layout not in layout_names():
        raise DataError(f"{path}: unknown layout {layout!r}; known layouts: {', '.join(layout_names())}")
    files = expand_path(path, layout)
    options_text = json.dumps(dict(options or {}), sort_keys=True)
    read = lambda: _describe_files(path, files, layout, options_text)  # noqa: E731
    if len(files) > 1:
        return read()
    # A task's file is described in many places (splits, loaders, cache, evaluation), and a file of
    # per-sample groups costs a metadata read per sample: one description per version of the file.
    return cached_fact(files[0], f"description/{layout}/{options_text}", read, beside=False)


def _describe_files(path, files: list[Path], layout: str, options: str) -> tuple[DatasetDescription, ...]:
    if layout == "auto":
        found = {p: detect_layout(p) for p in files}  # from keys only: no value is read yet
        kinds = sorted(set(found.values()))
        if len(kinds) > 1:
            raise DataError(f"{path}: files of several layouts ({', '.join(kinds)}); name one folder per layout")
        layout = kinds[0]
    lay = get_layout(layout)
    for p in files:  # before the layout reads a value (a coordinate, a time, a sample)
        if lay.check is not None:
            lay.check(p)
    descriptions = tuple(lay.describe_files(files, json.loads(options)))
    for desc in descriptions:
        check_trajectory(desc)
    return descriptions


def read_windows(desc: DatasetDescription, trajectories, *, t_start: int = 0, t_stop: int | None = None,
                 t_step: int = 1, x_step: int = 1) -> list[np.ndarray]:
    """Steps ``t_start:t_stop:t_step`` of each of `trajectories` (global indices over the
    description's sources), every `x_step`-th point per axis: one [T, C, *S] float32 array each (a
    steady dataset: T = 1). Each file is opened once for all of them (`DatasetReader.windows`
    returns them as one [N, T, C, *S] array)."""
    with DatasetReader(desc) as reader:
        return list(reader.windows(trajectories, t_start=t_start, t_stop=t_stop, t_step=t_step, x_step=x_step))


def read_window(desc: DatasetDescription, trajectory: int, **window) -> np.ndarray:
    """`read_windows` of one trajectory."""
    return read_windows(desc, [trajectory], **window)[0]


def read_constants_each(desc: DatasetDescription, trajectories, *, x_step: int = 1) -> list[np.ndarray] | None:
    """The constant input fields of each of `trajectories`, [C, *S] float32 each (each file opened
    once), or None when the dataset has none."""
    with DatasetReader(desc) as reader:
        each = reader.constants(trajectories, x_step=x_step)
    return None if each is None else list(each)


def read_constants(desc: DatasetDescription, trajectory: int, *, x_step: int = 1) -> np.ndarray | None:
    """`read_constants_each` of one trajectory."""
    each = read_constants_each(desc, [trajectory], x_step=x_step)
    return None if each is None else each[0]
