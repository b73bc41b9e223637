"""Advisory locks that keep two jobs out of one run folder (or one cache build).

A lock is the project's one lock (pipelines.flock: an `flock` on a lock file), held by one
process (rank 0 of a job) until it exits; the kernel drops it when the process dies, however it
dies, so a crashed job never leaves a lock behind. The holder records its pid, host, start time
and command line in the file, and a job that finds the lock taken stops with a `FolderInUse`
naming them. flock is exclusive between processes on one host and, on Linux NFS clients, across
hosts (it is mapped to POSIX locks).

Taking a lock does not change the lock file's content; only `record_holder` writes it, so a
command can take the lock first and still leave the folder byte-identical if it then stops on
a user error.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from pathlib import Path

import orjson

# Defined with the other user errors (exit 2); imported here, where it is raised, so
# `from entry.storage.folder_lock import FolderInUse` names the same class.
from entry.config.errors import FolderInUse
from pipelines.flock import read_holder, try_flock, write_holder

_held: dict[str, int] = {}  # resolved lock-file path -> open descriptor, for this process's lifetime


def _key(lock_file: Path) -> str:
    return str(lock_file.resolve())


def holds(lock_file: str | Path) -> bool:
    """Whether this process holds the lock on `lock_file`."""
    return _key(Path(lock_file)) in _held


def describe_holder(lock_file: str | Path) -> str:
    """'pid P on host H since T (command C)' from the lock file, or a note that it names nobody."""
    try:
        rec = orjson.loads(read_holder(lock_file))
        return (f"pid {rec['pid']} on host {rec['host']} since {rec['since']} "
                f"({' '.join(rec.get('command', []))[:200]})")
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
        return "a process that has not recorded itself yet"


def acquire(lock_file: str | Path, *, create: bool, what: str) -> bool:
    """Take the lock on `lock_file` without waiting.

    Takes the lock file, whether to create it when absent, and what it protects (for the
    message). Returns True when this process holds the lock (already, or now), False when the
    file is absent and `create` is False. Raises `FolderInUse` naming the holder when another
    process has it.
    """
    lock_file = Path(lock_file)
    key = _key(lock_file)
    if key in _held:
        return True
    try:
        fd = try_flock(lock_file, create=create, mode=0o644)
    except FileNotFoundError:
        if create:
            raise
        return False
    if fd is None:
        raise FolderInUse(f"{what} is in use by {describe_holder(lock_file)}; wait for that job to end, "
                          f"or give this one another folder (logging.run_name / training.cache_dir)")
    _held[key] = fd
    return True


def acquire_waiting(lock_file: str | Path, *, what: str, wait_s: float, poll_s: float = 0.2) -> bool:
    """Take the lock on `lock_file` (created when absent), waiting up to `wait_s` seconds while
    another process holds it (for a job that makes what this one would make, e.g. a cache keyed by
    its content). Returns whether it had to wait. Raises `FolderInUse` naming the holder when the
    lock is still held after `wait_s`."""
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            acquire(lock_file, create=True, what=what)
            return waited
        except FolderInUse as e:
            if time.monotonic() >= deadline:
                raise FolderInUse(f"{e} (waited {wait_s:g} s for it)") from None
            waited = True
            time.sleep(poll_s)


def record_holder(lock_file: str | Path) -> None:
    """Write this process's pid, host, time and command into a lock file it holds."""
    fd = _held[_key(Path(lock_file))]
    rec = {"pid": os.getpid(), "host": socket.gethostname(),
           "since": datetime.datetime.now().isoformat(timespec="seconds"), "command": sys.argv}
    write_holder(fd, orjson.dumps(rec) + b"\n")


def release(lock_file: str | Path) -> None:
    """Drop a lock this process holds (process exit drops it too)."""
    fd = _held.pop(_key(Path(lock_file)), None)
    if fd is not None:
        os.close(fd)
