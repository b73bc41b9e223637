"""Files that are either whole or absent: write a unique temporary file beside the target,
fsync it, rename it over the target, fsync the folder. The one implementation of that write: the
data writers here (pipelines/), the run folder's files (entry.storage.atomic re-exports it) and
the checkpoints all use `atomic_write` (`atomic_write_all` for files that belong together), or
`publish` for a temporary a writer fills itself (an HDF5 file, a folder).

A reader never sees a half-written file, and a crash at any point leaves the previous version
(or nothing). Temporary names are unique per writer (`.<name>.<random>.part`), so two writers
never share one and a dead writer's leftover is recognisable: `remove_leftovers` deletes them
once the caller knows no other writer is alive (it holds the folder's lock).

The published file gets the mode an ordinary `open(path, "w")` would give it (0o666 less the
umask), not mkstemp's 0o600, so a colleague in the same group can read a shared run. A write
that fails on a full file system (ENOSPC, or any error while the folder's free space is nearly
gone: torch.save's zip writer reports a full disk as `RuntimeError: unexpected pos ...`) is
raised as an `OSError(ENOSPC)` that names the file system, the file and the bytes free.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import orjson

PART_SUFFIX = ".part"
NEARLY_FULL_BYTES = 16 << 20
"""Free space under which a failed write is reported as a full disk, whatever its error says: a
writer that ran out of room may report it in its own words, and a file system whose last 16 MiB
are left after a failure was full for practical purposes."""


def _umask_at_import() -> int:
    # os.umask can only be read by setting it; this runs once, while the module is imported
    # (before any thread of ours writes files), and restores it at once.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_IMPORT_UMASK = _umask_at_import()


def current_umask() -> int:
    """The process's umask, read without changing it (Linux: /proc/self/status); elsewhere the
    umask when this module was imported."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _IMPORT_UMASK


def published_mode() -> int:
    """The mode `open(path, "w")` gives a new file under the current umask (0o666 less it): what a
    published file should have."""
    return 0o666 & ~current_umask()


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


def _mount_point(folder: Path) -> Path:
    """The mount point of the file system that holds `folder` (`folder` itself if unknown)."""
    p = folder.resolve()
    while not os.path.ismount(p) and p.parent != p:
        p = p.parent
    return p


def no_space_error(path: Path, error: BaseException) -> OSError | None:
    """An `OSError(ENOSPC)` saying "no space left on <file system> while writing <path> (N bytes
    free)" when `error` was a full disk (ENOSPC / EDQUOT, or any error while the folder's file
    system has less than `NEARLY_FULL_BYTES` free); None when it was something else. A file system of no size
    (/proc, /sys: nothing is stored there) has no free space to speak of and is never called full."""
    try:
        usage = shutil.disk_usage(path.parent)
        free = usage.free if usage.total else None
    except OSError:
        free = None
    code = getattr(error, "errno", None)
    if code not in (errno.ENOSPC, errno.EDQUOT) and (free is None or free >= NEARLY_FULL_BYTES):
        return None
    where = f"{_mount_point(path.parent)} (folder {path.parent})"
    what = "disk quota exceeded" if code == errno.EDQUOT else "no space left"
    have = "unknown bytes free" if free is None else f"{free} bytes free"
    return OSError(errno.ENOSPC, f"{what} on {where} while writing {path} ({have}; "
                                 f"{type(error).__name__}: {error}); free space there and run the command again")


def publish(tmp: str | Path, path: str | Path) -> Path:
    """Rename the finished temporary `tmp` (a file or a folder, beside `path`) onto `path`, durably:
    a file's data reach the disk before the rename makes them visible, and the rename itself is
    made durable by syncing the folder. Returns `path`. A folder's files are the writer's to sync."""
    tmp, path = Path(tmp), Path(path)
    if not tmp.is_dir():
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def _filled_temp(path: Path, write: Callable[[Path], None]) -> Path:
    """A unique temporary file beside `path`, filled by `write(tmp)`, published mode, fsynced; on
    any failure it is removed and a full disk is raised as `no_space_error`'s `OSError(ENOSPC)`."""
    tmp = None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=PART_SUFFIX, dir=path.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        write(tmp)
        os.chmod(tmp, published_mode())  # mkstemp's 0o600 would hide the file from the group
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        return tmp
    except BaseException as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        full = no_space_error(path, e) if isinstance(e, Exception) else None
        if full is not None:
            raise full from e
        raise


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` to fill a unique temporary file beside `path`, then rename it to `path`.

    Takes the target path and a function that writes the whole content to the path it is given
    (`lambda p: torch.save(obj, p)`). Returns `path`, with mode 0o666 less the umask. On any
    failure the temporary file is removed and `path` is left as it was; a full disk is raised as
    `OSError(ENOSPC)` naming the file system, `path` and the bytes free (`no_space_error`).
    """
    path = Path(path)
    tmp = _filled_temp(path, write)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_all(writes: Sequence[tuple[str | Path, Callable[[Path], None]]], *,
                     before_renames: Callable[[], None] = lambda: None) -> list[Path]:
    """Files that belong together (weights and their description): every `write(tmp)` fills its
    temporary file first, and only when all of them are whole are they renamed onto their paths,
    in the order given; `before_renames()` runs between (e.g. removing a file the new set replaces).

    Takes (path, write) pairs as `atomic_write` does; returns the paths. A failure while filling
    (a full disk: `OSError(ENOSPC)` as `atomic_write` raises it) removes every temporary file and
    leaves every path as it was. Only a crash between the renames (microseconds) leaves a mix.
    """
    temps: list[tuple[Path, Path]] = []
    try:
        for path, write in writes:
            temps.append((_filled_temp(Path(path), write), Path(path)))
        before_renames()
        for tmp, path in temps:
            os.replace(tmp, path)
    except BaseException:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
        raise
    for folder in sorted({path.parent for _, path in temps}):
        fsync_dir(folder)
    return [path for _, path in temps]


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
