"""How an error message shows a user's value or path: short, whatever its size or depth.

A value from a user can be huge (a YAML alias bomb of a few hundred bytes unfolds to gigabytes, a
key can be 40,000 characters long); every message that shows one goes through `shown` or `cut`.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = ["SHOWN_CHARS", "PATH_CHARS", "cut", "shown", "shown_path"]

SHOWN_CHARS = 80
"""The most characters of a value an error message shows."""

_REPR = reprlib.Repr()
# Few items per level and few levels: repr never walks more of a (shared, nested) value than it shows.
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 4, 4, 4, 4
_REPR.maxstring, _REPR.maxlong, _REPR.maxother = SHOWN_CHARS, SHOWN_CHARS, SHOWN_CHARS


PATH_CHARS = 320
"""The most characters of a file's path an error message shows: whole for any path a user would
type or a temporary folder would make (macOS's are over 100 characters), so the message names a
file that can be opened; only a path of hundreds of characters is cut."""


def cut(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` itself when at most `limit` characters, else its start, '...' and its length."""
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text)} characters)"


def shown_path(path) -> str:
    """A file's path as an error message shows it: whole up to `PATH_CHARS` characters, else `cut`."""
    return cut(str(path), PATH_CHARS)


def shown(value: Any) -> str:
    """The repr of `value` as an error message shows it: at most about `SHOWN_CHARS` characters,
    nested lists and mappings elided (`[[[...], ...], ...]`), whatever their size or depth."""
    try:
        text = _REPR.repr(value)
    except (ValueError, RecursionError):  # an int beyond Python's digit limit for str()
        text = f"<a {type(value).__name__} too large to show>"
    return cut(text)
