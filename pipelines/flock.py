"""The one advisory lock of the project: an exclusive, non-blocking `flock` on a lock file. The
kernel drops it when its process dies, however it dies, so a crashed holder never leaves a lock
behind; it is exclusive between processes on one host and, on Linux NFS clients, across hosts
(mapped to POSIX locks). A holder records who it is in the lock file for the message of whoever
finds it taken. Used by the data writers (pipelines.writer_lock) and the run-folder and cache
locks (entry.storage.folder_lock), which differ only in how long they hold it."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

HELD_ELSEWHERE = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
"""What `flock` reports when another process holds the lock."""


def try_flock(lock_file: str | os.PathLike, *, create: bool = True, mode: int = 0o666) -> int | None:
    """Take the lock on `lock_file` without waiting; returns its open descriptor (close it to let
    go), or None when another process holds it. Creates the file with `mode` (less the umask) when
    `create`; otherwise a missing file raises `FileNotFoundError`."""
    fd = os.open(lock_file, os.O_RDWR | (os.O_CREAT if create else 0), mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in HELD_ELSEWHERE:
            return None
        raise
    return fd


def still_names(lock_file: str | os.PathLike, fd: int) -> bool:
    """Whether `lock_file` is still the file `fd` locked (a holder that removes its lock file
    before letting go leaves a later locker holding a file no path names)."""
    try:
        st, mine = os.stat(lock_file), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def write_holder(fd: int, record: bytes) -> None:
    """Replace the content of a lock file this process holds (descriptor `fd`) with `record`."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)


def read_holder(lock_file: str | os.PathLike) -> bytes:
    """What the holder of `lock_file` recorded (b"" when nothing, or the file is gone)."""
    try:
        return Path(lock_file).read_bytes()
    except OSError:
        return b""
