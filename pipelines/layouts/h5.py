"""What the HDF5 layouts share: opening a file (and the check that it opens), recognising it by its
keys, and the check that a dataset is a float array."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

from pipelines.layouts.description import DataError

__all__ = ["open_h5", "float_dataset", "recogniser", "keys_present"]


def open_h5(path: Path) -> h5py.File:
    """`path` opened for reading; a `DataError` naming it when it is no readable HDF5 file."""
    try:
        return h5py.File(path, "r")
    except OSError as err:
        raise DataError(f"{path}: cannot open as HDF5 (truncated or corrupt file?): {err}") from None


def recogniser(test: Callable[[h5py.File], bool]) -> Callable[[Path], bool]:
    """A layout's `Layout.recognises`: `path` opened (`DataError` when it is no HDF5 file) and `test`
    applied to it."""
    def recognises(path: Path) -> bool:
        with open_h5(path) as f:
            return test(f)
    return recognises


def keys_present(path: Path) -> list[str] | None:
    """The first 20 top-level keys of `path`, sorted (for a message), or None when it is no HDF5 file."""
    try:
        with h5py.File(path, "r") as f:
            return sorted(f.keys())[:20]
    except OSError:
        return None


def float_dataset(f: h5py.Group, key: str, path: Path, ndim: int | tuple[int, ...] | None = None) -> h5py.Dataset:
    """Dataset `key` of `f`, checked to exist, to be floating point and (when given) to have `ndim`
    axes (one count or several allowed); a `DataError` naming the file, the key and the keys present."""
    if key not in f:
        raise DataError(f"{path}: missing dataset {key!r}; keys present: {sorted(f.keys())[:20]}")
    node = f[key]
    if not isinstance(node, h5py.Dataset):
        raise DataError(f"{path}: {key!r} is a group, expected a dataset")
    if not np.issubdtype(node.dtype, np.floating):
        raise DataError(f"{path}: dataset {key!r} has dtype {node.dtype}, expected floating point")
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    if allowed is not None and node.ndim not in allowed:
        raise DataError(f"{path}: dataset {key!r} has shape {list(node.shape)}, expected "
                        f"{' or '.join(str(n) for n in allowed)} axes")
    return node
