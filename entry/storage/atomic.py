"""Files that are either whole or absent: write a unique temporary file beside the target,
fsync it, rename it over the target, fsync the folder.

A reader never sees a half-written file, and a crash at any point leaves the previous version
(or nothing). Temporary names are unique per writer (`.<name>.<random>.part`), so two writers
never share one and a dead writer's leftover is recognisable: `remove_leftovers` deletes them
once the caller knows no other writer is alive (it holds the folder's lock).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import orjson

PART_SUFFIX = ".part"


def fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename itself is still atomic
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` to fill a unique temporary file beside `path`, then rename it to `path`.

    Takes the target path and a function that writes the whole content to the path it is given
    (`lambda p: torch.save(obj, p)`). Returns `path`. On any failure the temporary file is
    removed and `path` is left as it was.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=PART_SUFFIX, dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Replace `path` with `data` atomically; returns `path`."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_json(path: str | Path, obj, *, indent: bool = False) -> Path:
    """Replace `path` with `obj` as JSON (orjson) atomically; returns `path`."""
    option = orjson.OPT_INDENT_2 if indent else 0
    return atomic_write_bytes(path, orjson.dumps(obj, option=option))


def read_json(path: str | Path) -> dict | None:
    """The JSON object in `path`; None when the file is absent. Raises `ValueError` naming the
    file when it is not a readable JSON object (truncated, garbage)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return obj


def remove_leftovers(folder: str | Path) -> list[Path]:
    """Delete the temporary files dead writers left in `folder` (not recursive); returns them.

    Only safe while the caller holds the lock that every writer into `folder` holds.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(PART_SUFFIX) and p.is_file()]
    for p in found:
        p.unlink(missing_ok=True)
    return found
