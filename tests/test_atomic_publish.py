"""One atomic write and one lock (pipelines.atomic, pipelines.flock): a published file's data and
its folder's entry are synced before a reader can rely on them, whichever writer publishes it; and
the run-folder lock and the data writers' lock are the same lock, so each refuses the other's."""

from __future__ import annotations

import os

import pytest

from entry.storage import atomic as entry_atomic
from entry.storage.folder_lock import acquire, release
from pipelines import atomic, file_facts
from pipelines.file_facts import cached_fact, facts_file, settle
from pipelines.flock import try_flock
from pipelines.writer_lock import lock_file_for, try_lock, unlock, writing


@pytest.fixture
def synced(monkeypatch):
    """The (device, inode) of everything os.fsync is called on, while the test runs."""
    seen = []
    real = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        seen.append((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def _ino(path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def test_publish_syncs_the_file_before_the_rename_and_the_folder_after(tmp_path, synced):
    tmp = tmp_path / ".x.tmp"
    tmp.write_bytes(b"data")
    target = atomic.publish(tmp, tmp_path / "x")
    assert target.read_bytes() == b"data" and not tmp.exists()
    assert synced == [_ino(target), _ino(tmp_path)]


@pytest.mark.parametrize("write", ["atomic_write_bytes", "writing", "file_facts"])
def test_every_writer_publishes_through_the_one_primitive(tmp_path, synced, write, monkeypatch):
    monkeypatch.setattr(file_facts, "SETTLE_MIN_BYTES", 0)  # settle this small file too, so its facts are cached
    target = tmp_path / "sub" / "f.bin"
    target.parent.mkdir()
    if write == "atomic_write_bytes":
        entry_atomic.atomic_write_bytes(target, b"abc")
    elif write == "writing":
        with writing(target) as temp:
            temp.write_bytes(b"abc")
    else:
        target.write_bytes(b"abc")
        settle(target)  # a file changed just now has no cached facts
        synced.clear()
        assert cached_fact(target, "size", lambda: 3) == 3
        target = facts_file(target)
    assert target.is_file() and (write == "file_facts" or target.read_bytes() == b"abc")
    assert _ino(target) in synced and _ino(target.parent) in synced
    assert sorted(p.name for p in target.parent.iterdir() if p.name.endswith((".part", ".tmp"))) == []


def test_entry_storage_writes_with_the_pipelines_primitive():
    assert entry_atomic.atomic_write is atomic.atomic_write and entry_atomic.publish is atomic.publish


def test_the_folder_lock_and_the_writer_lock_are_one_lock(tmp_path):
    lock = tmp_path / "run.lock"
    assert acquire(lock, create=True, what="the run folder")
    try:
        assert try_flock(lock) is None  # another open file description: refused, as another process is
    finally:
        release(lock)
    fd = try_flock(lock)
    assert fd is not None
    os.close(fd)

    data = tmp_path / "data.h5"
    fd = try_lock(data)
    try:
        assert try_lock(data) is None and try_flock(lock_file_for(data)) is None
    finally:
        unlock(data, fd)
    assert not lock_file_for(data).exists()
