"""What a file's datasets declare against what memory holds and what the file stores, from metadata only.

Legend: T time steps, C channels, S spatial axes.

An HDF5 dataset's shape is a promise the file need not keep: a few kilobytes can declare terabytes
(chunks never written read as the fill value, compressed or not), and a sample can declare more
than the machine's memory. Every reader reads at least one whole sample, so such a file ends in a
MemoryError, in minutes of scanning fill values, or in training on constants. Both checks here cost
the file's metadata (shapes, layouts, the chunk index), never its data, and run before any read:
`pipelines.layouts.describe` calls the HDF5 layouts' check, `check_h5`, on every file it describes and
`check_trajectory` on every description (all layouts: ``inspect``, ``validate``, every task's data).
"""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np

from pipelines.layouts.description import DataError, DatasetDescription
from pipelines.layouts.h5 import open_h5
from pipelines.memory import sample_limit

__all__ = ["check_file", "check_h5", "check_trajectory"]

_REFUSE = "this is not a file to train on: regenerate it or name another file"


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{int(n)} bytes"


def _declares(key: str, node: h5py.Dataset) -> str:
    return f"dataset {key!r} declares {list(node.shape)} {node.dtype}"


def _check_fits(path: Path, key: str, node: h5py.Dataset, limit: int | None, why: str) -> None:
    """A sample (one row of the leading axis) of `node` takes at most `limit` bytes."""
    if limit is None or node.ndim < 2:  # 1-D: coordinates and times, never a sample
        return
    per_sample = math.prod(node.shape[1:]) * node.dtype.itemsize
    if per_sample > limit:
        raise DataError(f"{path}: {_declares(key, node)} = {per_sample / 2**30:.1f} GiB per sample, more than "
                        f"{limit / 2**30:.1f} GiB ({why}); {_REFUSE}")


def _check_stored(path: Path, key: str, node: h5py.Dataset) -> None:
    """The file stores every byte (contiguous) or every chunk (chunked, compressed or not) `node`
    declares. External and virtual datasets keep their data elsewhere and are not checked."""
    if node.external or node.is_virtual:
        return
    declared = math.prod(node.shape) * node.dtype.itemsize
    if declared == 0:
        return
    stored = node.id.get_storage_size()
    if node.chunks is None:  # contiguous (or compact: always stored whole)
        if stored < declared:
            raise DataError(f"{path}: {_declares(key, node)} = {_size(declared)}, but the file stores "
                            f"{_size(stored)} of it (samples never written, or a cut file); {_REFUSE}")
        return
    # A chunk is allocated when it is first written: a missing one reads as the fill value. The
    # chunk index says how many exist, in time proportional to the chunks stored, not declared.
    expected = math.prod(math.ceil(n / c) for n, c in zip(node.shape, node.chunks, strict=True))
    allocated = node.id.get_num_chunks()
    if allocated < expected:
        raise DataError(f"{path}: {_declares(key, node)} = {_size(declared)}, but the file stores {allocated} of "
                        f"its {expected} chunks ({_size(stored)}): the rest were never written and read as the "
                        f"fill value, not data; {_REFUSE}")


def check_file(f: h5py.File, path: Path) -> None:
    """Refuse the open file `f` (any layout, any group) when a sample of one of its datasets of
    numbers would not fit in memory (`pipelines.memory.sample_limit`), or when it does not store all
    a dataset declares; before anything in it is read.

    Raises:
        DataError: naming the file, the key, the declared shape and what is wrong; memory first
            (a file can declare both), the largest dataset first (the data, not a coordinate).
    """
    found: list[tuple[str, h5py.Dataset]] = []
    f.visititems(lambda key, node: found.append((key, node))
                 if isinstance(node, h5py.Dataset) and node.dtype.kind in "biufc" else None)
    found.sort(key=lambda item: -math.prod(item[1].shape) * item[1].dtype.itemsize)
    limit, why = sample_limit()
    for key, node in found:
        _check_fits(path, key, node, limit, why)
    for key, node in found:
        _check_stored(path, key, node)


def check_h5(path: Path) -> None:
    """`check_file` of the HDF5 file at `path` (an HDF5 layout's `Layout.check`)."""
    with open_h5(path) as f:
        check_file(f, path)


def check_trajectory(desc: DatasetDescription) -> None:
    """Refuse a description whose one trajectory, as a reader returns it ([T, C, *S] float32 and its
    inputs), would not fit in memory: a layout that stores one dataset per step or per sample (PDEBench's
    per-sample groups) declares its sample size in no single dataset's rows.

    Raises:
        DataError: naming the first source file and the trajectory's shape.
    """
    limit, why = sample_limit()
    channels = len(desc.channels) + len(desc.constant_channels)
    per_trajectory = desc.steps * channels * math.prod(desc.grid.shape) * np.dtype(np.float32).itemsize
    if limit is not None and per_trajectory > limit:
        shape = [desc.steps, channels, *desc.grid.shape]
        raise DataError(f"{desc.sources[0].path}: one trajectory of {desc.identity} is {shape} (T, C, *S) float32 = "
                        f"{per_trajectory / 2**30:.1f} GiB per sample, more than {limit / 2**30:.1f} GiB ({why}); "
                        f"{_REFUSE}")
