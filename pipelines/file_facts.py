"""Facts about one version of a file (its content fingerprint, its validation), cached beside it.

``<dir>/.<name>.facts.json`` holds ``{"version": {...}, "facts": {key: value}}``. A fact is
returned only while the file is the same version: the same absolute path, size, modification
and status-change times (ns) and inode. Writing the file in place changes its mtime and ctime,
replacing it (a rename) changes its inode and ctime, and neither time can be set back by a
copy that preserves mtimes (ctime cannot be set at all), so a fact never outlives the bytes it
was computed from; reading one costs a `stat` and a few hundred bytes instead of the file.

Two guards keep it honest. A fact is cached only if the file did not change while it was being
computed, and only if the file was last changed more than `RACY_S` before the computation
began: a second write within the same tick of a coarse filesystem clock would otherwise leave
the same times behind (git's "racy clean" problem). A folder that cannot be written (a
read-only dataset mount) only means the facts are computed every time.

Facts about files in a run folder are kept in this process only (`beside=False`): a command that
stops on a user's mistake must leave the run folder byte-identical, and a facts file written
there by a read would break that on any machine slow enough to pass the racy window.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson

from pipelines.atomic import atomic_write_bytes

__all__ = ["RACY_S", "SETTLE_MIN_BYTES", "facts_file", "file_version", "cached_fact", "settle", "file_sha256",
           "file_fingerprint", "data_fingerprint"]

RACY_S = 2.0
"""A file changed less than this many seconds before a fact about it was computed is not cached
(covers filesystems with 1-2 s timestamps, and modest clock skew between a client and its NFS server)."""

SETTLE_MIN_BYTES = 64 * 2**20
"""`settle` waits only for a file at least this large: computing a smaller file's facts again, once, in the
next process that asks costs less than the wait on any disk that reads 32 MB/s (each test's freshly made
file used to wait its 2 s)."""

T = TypeVar("T")

_IN_MEMORY: dict[tuple[str, str], tuple[dict[str, Any], Any]] = {}
"""Facts kept in this process: (absolute path, key) -> (the file version, the value)."""


def facts_file(path: str | os.PathLike) -> Path:
    """``<dir>/.<name>.facts.json``, the cache beside `path`."""
    p = Path(path)
    return p.with_name(f".{p.name}.facts.json")


def file_version(path: str | os.PathLike, st: os.stat_result | None = None) -> dict[str, Any]:
    """What identifies this version of the file: path, size, mtime_ns, ctime_ns, inode."""
    st = os.stat(path) if st is None else st
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def _read(path: Path) -> dict[str, Any]:
    try:
        data = orjson.loads(facts_file(path).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, version: dict[str, Any], key: str, value: Any) -> None:
    data = _read(path)
    facts = data.get("facts", {}) if data.get("version") == version else {}
    facts[key] = value
    # atomic_write's temporary is unique per writer: ranks that cache the same fact at once never share one.
    try:
        atomic_write_bytes(facts_file(path), orjson.dumps({"version": version, "facts": facts},
                                                          option=orjson.OPT_SORT_KEYS))
    except OSError:
        pass  # a read-only folder (its temporary removed): the fact is recomputed next time


def cached_fact(path: str | os.PathLike, key: str, compute: Callable[[], T], *, refresh: bool = False,
                beside: bool = True) -> T:
    """The fact `key` about this version of `path`: cached, or `compute()` (then cached).

    With `refresh` the cache is not read (the fact is recomputed and the cache updated). With
    `beside=False` the cache is this process's memory instead of a file beside `path` (nothing is
    written). `compute` must return a JSON value; an exception from it propagates and nothing is
    cached.
    """
    p = Path(path)
    st = os.stat(p)
    version = file_version(p, st)
    memory_key = (version["path"], key)
    if not refresh:
        if beside:
            data = _read(p)
            if data.get("version") == version and key in data.get("facts", {}):
                return data["facts"][key]
        elif memory_key in _IN_MEMORY and _IN_MEMORY[memory_key][0] == version:
            return _IN_MEMORY[memory_key][1]
    started_ns = time.time_ns()
    value = compute()
    settled = started_ns - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_S * 1e9
    if settled and file_version(p) == version:
        if beside:
            _write(p, version, key, value)
        else:
            _IN_MEMORY[memory_key] = (version, value)
    return value


def settle(path: str | os.PathLike) -> None:
    """Wait until `path` was last changed more than `RACY_S` ago (at most that long), so that
    facts computed next are cached: a file just written would otherwise be hashed again later.
    A file smaller than `SETTLE_MIN_BYTES` returns at once: hashing it again is cheaper than waiting."""
    st = os.stat(path)
    if st.st_size < SETTLE_MIN_BYTES:
        return
    age_s = (time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns)) / 1e9
    if age_s <= RACY_S:
        time.sleep(RACY_S - max(age_s, 0.0) + 0.05)


_HASH_BLOCK = 8 << 20


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of every byte of the file at ``path`` (hex), read in 8 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def file_fingerprint(path: str | os.PathLike, *, full: bool = False) -> str:
    """Content fingerprint of a data file: ``"<size>:sha256:<hex of all bytes>"``.

    Independent of mtime, path and host; changes whenever any byte changes. Computed once per
    version of the file and cached beside it (`cached_fact`: a new version, written in place or
    replaced, is hashed again), so a stage start reads no file in full; ``full=True``
    re-reads every byte and refreshes the cache. Hashing reads the file in 8 MiB blocks (about
    1-2 s per GB); a sampled hash (first/last MiB plus HDF5 shapes) was rejected because an edit
    in the middle of a dataset would go unnoticed.
    """
    p = Path(path)
    return cached_fact(p, "fingerprint/sha256", lambda: f"{p.stat().st_size}:sha256:{file_sha256(p)}", refresh=full)


def data_fingerprint(path: str | os.PathLike) -> str:
    """Content fingerprint of a task's data: `file_fingerprint` of a file; of a folder or a glob
    (a dataset of several files, e.g. The Well's split folders), one hash over each file's name
    relative to the folder and its fingerprint, so adding, removing, renaming or changing a file
    changes it."""
    from pipelines.layouts import expand_path  # here: pipelines.layouts caches its facts through this module

    p = Path(path)
    if p.is_file():
        return file_fingerprint(p)
    files = expand_path(p)
    base = p if p.is_dir() else Path(os.path.commonpath([f.parent for f in files]))
    lines = "\n".join(f"{f.relative_to(base)}={file_fingerprint(f)}" for f in files)
    return f"{len(files)} files:sha256:{hashlib.sha256(lines.encode()).hexdigest()}"
