"""Who is writing a data file, and removing what dead writers left (`PDEBenchWriter`'s temporaries).

A writer of ``<folder>/<name>`` holds an ``flock`` on ``<folder>/.<name>.lock`` from before it
creates its temporary file ``.<name>.tmp-<pid>`` until it has renamed or removed it. The kernel
drops the lock when the process dies, however it dies, so a temporary file whose lock nobody
holds belongs to a dead writer (a killed `pipelines.generate` or `entry.prepare_data`) and is
garbage: `remove_dead_temps` deletes those while holding their lock. The holder removes its lock
file before it lets go; a process that locked a lock file which was removed meanwhile sees that
the path no longer names its file and takes the new one, so two processes never both hold one.

The lock is the project's one lock (pipelines.flock, also entry/storage/folder_lock.py's), and
the rename onto the target is the one atomic publish (pipelines.atomic.publish: the file and its
folder synced).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipelines.atomic import publish
from pipelines.flock import read_holder, still_names, try_flock, write_holder

TEMP_MARK = ".tmp-"
_TEMP_NAME = re.compile(r"\.(?P<target>.+)\.tmp-\d+")
"""``.<name>.tmp-<pid>`` exactly: atomic_write's temporaries (``.<name>.<random>.part``, the cached
file facts' among them) follow another protocol and are never touched here."""


def lock_file_for(path: str | os.PathLike) -> Path:
    """``.<name>.lock`` beside `path`: the lock every writer of `path` holds."""
    p = Path(path)
    return p.with_name(f".{p.name}.lock")


def temp_file_for(path: str | os.PathLike) -> Path:
    """``.<name>.tmp-<pid>`` beside `path`: this process's temporary file for `path`."""
    p = Path(path)
    return p.with_name(f".{p.name}{TEMP_MARK}{os.getpid()}")


def try_lock(path: str | os.PathLike) -> int | None:
    """Take the writer lock of `path` without waiting; returns its descriptor, or None when a live
    process holds it. Release it with `unlock`."""
    lock = lock_file_for(path)
    while True:
        fd = try_flock(lock)
        if fd is None:
            return None
        if still_names(lock, fd):
            return fd
        os.close(fd)  # its holder removed it between our open and our lock: take the new one


def unlock(path: str | os.PathLike, fd: int) -> None:
    """Remove the lock file of `path` and drop the lock `fd` (from `try_lock`)."""
    lock_file_for(path).unlink(missing_ok=True)
    os.close(fd)


def record_holder(fd: int) -> None:
    """Write this process's pid and host into a lock it holds (for `describe_holder`)."""
    write_holder(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())


def describe_holder(path: str | os.PathLike) -> str:
    """'pid P on host H' from the lock file of `path`, or a note that it names nobody."""
    text = read_holder(lock_file_for(path)).decode(errors="replace").strip()
    return text or "a process that has not recorded itself yet"


def remove_dead_temps(folder: str | os.PathLike, *, held: str | os.PathLike | None = None) -> list[Path]:
    """Delete the ``.<name>.tmp-*`` files in `folder` whose writer is dead (nobody holds the lock of
    ``<name>``); returns them. Safe beside live writers: each is checked and removed under its lock.
    `held`: a file whose lock this process holds (its temporaries are all dead writers' but ours,
    which the caller has not created yet)."""
    folder = Path(folder)
    held = None if held is None else Path(held).name
    if not folder.is_dir():
        return []
    removed = []
    for temp in sorted(folder.iterdir()):
        match = _TEMP_NAME.fullmatch(temp.name)
        if match is None or not temp.is_file():
            continue
        target = folder / match["target"]
        if target.name == held:
            temp.unlink(missing_ok=True)
            removed.append(temp)
            continue
        fd = try_lock(target)
        if fd is None:
            continue  # its writer is alive
        try:
            temp.unlink(missing_ok=True)
            removed.append(temp)
        finally:
            unlock(target, fd)
    return removed


class WriterBusy(RuntimeError):
    """Another live process writes the same file; the message names it."""


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[Path]:
    """Write `path` whole or not at all: hold its writer lock, remove dead writers' temporaries,
    yield this process's temporary file, and rename it onto `path` when the block ends cleanly
    (removed on any exception). `WriterBusy` names the live process that holds the lock."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = try_lock(path)
    if fd is None:
        raise WriterBusy(f"{path} is being written by {describe_holder(path)}; wait for that process to finish "
                         f"(or stop it), then run this command again")
    temp = temp_file_for(path)
    try:
        record_holder(fd)
        remove_dead_temps(path.parent, held=path)
        yield temp
        publish(temp, path)
    finally:
        temp.unlink(missing_ok=True)
        unlock(path, fd)
