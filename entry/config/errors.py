"""What a user can fix: the error types every command turns into exit code 2, in one place.

A command stops on one of these before it writes anything, with one line naming the key or file
(`entry.config.cli.exits_on_user_error`). The types that entry/ owns are defined here; those a
lower layer raises (`pipelines` for data files and latent caches, `entry.config` for configs) are
imported from where they are defined, so this module is the one list and depends on nothing
above entry.config. The modules that raise them import them from here (or from their defining
module, which names the same class), so `except CheckpointError` catches the same type wherever
it was imported from.
"""

from __future__ import annotations

# ConfigError is defined where config files are read (entry/config/base.py), the lowest entry/
# module that raises it; importing it from there keeps this module at the bottom.
from entry.config.base import ConfigError
from pipelines.cache_error import CacheError
from pipelines.pdebench_io import DataError

__all__ = ["ConfigError", "DataError", "CacheError", "CheckpointError", "UntrustedCheckpointError",
           "FolderInUse", "InputError", "USER_ERRORS", "error_label"]


class CheckpointError(ValueError):
    """A checkpoint or weights file that cannot be used (truncated, garbage, or written for another
    model); the message names the file and what to do."""


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint file holds objects a checkpoint may not contain (entry.training.checkpoint_trust):
    refused unread and, unlike an unreadable file, never fallen back from: the folder was altered."""


class InputError(DataError):
    """Fields given to a trained run that it cannot roll out (`entry.inference`): other field names,
    a shape, dimension or grid other than the run's, an unknown task or variant; the message names
    what the run expects. A data error: the line a command prints starts `data error`."""


class FolderInUse(ValueError):
    """Another process holds the lock on a run folder or cache build; the message names it and what
    to do."""


_LABELS = ((ConfigError, "config error"), (DataError, "data error"), (CacheError, "cache error"),
           (CheckpointError, "checkpoint error"), (FolderInUse, "folder in use"))

USER_ERRORS = tuple(kind for kind, _ in _LABELS)
"""What a user can fix: a config, a data file, a cache, a checkpoint or weights file, a run folder
another job holds. Each is raised before the command writes anything."""


def error_label(error: BaseException) -> str:
    """The kind a user error line starts with (`config error`, `checkpoint error`, ...).

    Takes an instance of one of `USER_ERRORS` (a subclass gets its base's label); raises
    `TypeError` for anything else, which is our bug, not the user's.
    """
    for kind, text in _LABELS:
        if isinstance(error, kind):
            return text
    raise TypeError(f"{type(error).__name__} is not a user error (entry.config.errors.USER_ERRORS)")
