"""The dataset layouts we read, by name: each layout module registers one `Layout` when imported.

Legend: R rows (trajectories of one source file), T time steps, C channels, S spatial axes.

A layout is a file format of gridded PDE data (PDEBench's HDF5 files, The Well's, a user's HDF5
read by the keys a config names, or any format a module here reads). Adding one is a new module
``pipelines/layouts/<name>.py`` that ends in ``register_layout(Layout(name="<name>", ...))`` and its
module name in `BUILT_IN`; the config's ``layout:`` choices, ``pipelines.inspect --layout`` and
``auto`` read the registry (`layout_names`, `get_layout`, `guessable`), never a list of their own.
A layout opens its own sources (`Layout.open`), so it need not be HDF5: the handle it returns is
what its read functions take.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipelines.layouts.description import DataError, DatasetDescription

__all__ = ["Layout", "BUILT_IN", "register_layout", "unregister_layout", "get_layout", "layout_names", "guessable"]

BUILT_IN = ("pipelines.layouts.pdebench", "pipelines.layouts.the_well", "pipelines.layouts.user_hdf5")
"""Modules imported on the registry's first use; each registers its layout(s)."""

@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """What the stack needs of one layout. ``h`` below is what `open` returned for the source
    holding the trajectory, ``row`` the trajectory's index in it."""

    name: str
    """What a config's ``data.tasks[i].layout`` and ``pipelines.inspect --layout`` call it."""
    open: Callable[[Path], AbstractContextManager[Any]]
    """``open(path) -> h``: one source opened for reading (a context manager that closes it);
    `DataError` naming the file when it cannot be read."""
    describe_files: Callable[[list[Path], Mapping[str, object]], list[DatasetDescription]]
    """``describe_files(paths, options) -> descriptions``, from metadata only; the descriptions'
    ``layout`` is `name`."""
    read_window: Callable[[DatasetDescription, Any, int, slice, int], np.ndarray]
    """``read_window(desc, h, row, t: slice, x_step) -> [T, C, *S] float32`` (steady: T = 1)."""
    read_constants: Callable[[DatasetDescription, Any, int, int], np.ndarray] | None = None
    """``read_constants(desc, h, row, x_step) -> [C, *S] float32``: the inputs constant in time;
    None when no description of this layout has ``constants``."""
    recognises: Callable[[Path], bool] | None = None
    """``recognises(path) -> bool`` from the file's keys (`DataError` if it cannot open it); None:
    never guessed by ``auto`` (its options must be named)."""
    check: Callable[[Path], None] | None = None
    """``check(path)``: refuse a source before any value of it is read (`pipelines.layouts.sizes`)."""
    suffixes: tuple[str, ...] = (".h5", ".hdf5", ".hdf")
    """The file names a folder is searched for."""
    read_rows: Callable[[DatasetDescription, Any, Any, slice, int], np.ndarray] | None = None
    """Optional block read: ``read_rows(desc, h, rows, t, x_step) -> [R, T, C, *S] float32`` of the
    sorted, unique `rows` of one source (a slice when contiguous, else an int array): one read where
    `read_window` per row would make R; equal to stacking `read_window`."""
    read_constant_rows: Callable[[DatasetDescription, Any, Any, int], np.ndarray] | None = None
    """Optional block read of `read_constants`: ``-> [R, C, *S] float32``."""


_REGISTRY: dict[str, Layout] = {}
_loaded = False


def register_layout(layout: Layout) -> Layout:
    """Make `layout` known by its name (a layout module's last line); returns it.

    Raises:
        ValueError: the name is ``auto``, empty, or taken by another layout.
    """
    if not layout.name or layout.name == "auto":
        raise ValueError(f"a layout's name must be non-empty and not 'auto', got {layout.name!r}")
    if _REGISTRY.get(layout.name, layout) is not layout:
        raise ValueError(f"layout {layout.name!r} is registered already")
    _REGISTRY[layout.name] = layout
    return layout


def unregister_layout(name: str) -> None:
    """Forget layout `name` (a test's temporary layout); nothing when it is not registered."""
    _REGISTRY.pop(name, None)


def _registry() -> dict[str, Layout]:
    """Every layout: the built-in ones in `BUILT_IN`'s order (whichever module was imported first),
    then the others in the order they registered."""
    global _loaded
    if not _loaded:  # imported here, not at the top: each layout module imports this one
        _loaded = True
        for module in BUILT_IN:
            importlib.import_module(module)
    order = {name: i for i, name in enumerate(_REGISTRY)}
    rank = lambda lay: (BUILT_IN.index(lay.describe_files.__module__)  # noqa: E731
                        if lay.describe_files.__module__ in BUILT_IN else len(BUILT_IN) + order[lay.name])
    return {lay.name: lay for lay in sorted(_REGISTRY.values(), key=rank)}


def layout_names() -> tuple[str, ...]:
    """``auto`` and every registered layout's name (the built-in ones first): what a task may name."""
    return ("auto", *_registry())


def guessable() -> tuple[Layout, ...]:
    """The layouts ``auto`` tries, in `layout_names` order (those with `Layout.recognises`)."""
    return tuple(lay for lay in _registry().values() if lay.recognises is not None)


def get_layout(name: str) -> Layout:
    """The layout registered as `name`; a `DataError` listing the known ones otherwise."""
    try:
        return _registry()[name]
    except KeyError:
        raise DataError(f"unknown layout {name!r}; known layouts: {', '.join(layout_names())}") from None
