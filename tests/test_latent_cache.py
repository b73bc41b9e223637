"""Latent cache: atomic writes, deterministic bytes, refusal of stale, partial or corrupt caches."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pipelines.file_facts import file_fingerprint
from pipelines.latent_cache import (
    CacheError,
    allocate_cache,
    finalize_cache,
    load_cache,
    open_allocated,
    temp_dir_for,
    write_cache,
    write_rows,
)
from tests import tiny_run as tr

HINT = "python -m entry.cache --config CFG"
N, T, L, D = 6, 5, 4, 3
SPECS = {"z": ((N, T, L, D), torch.float32), "task_id": ((N,), torch.int64), "dt": ((N,), torch.float32)}
MANIFEST = {"config_hash": "cfg1", "encoder_hash": "enc1", "data_fingerprints": {"burgers1d": "11:sha256:aa"}}


def _chunks(scale=1.0):
    for task in range(2):
        g = torch.Generator().manual_seed(task)
        yield {"z": scale * torch.randn(3, T, L, D, generator=g),
               "task_id": torch.full((3,), task), "dt": torch.full((3,), 0.05)}


def _folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_roundtrip_and_identical_bytes_when_built_twice(tmp_path):
    a = write_cache(tmp_path / "a", _chunks, MANIFEST, specs=SPECS)
    b = write_cache(tmp_path / "b", lambda: _chunks(), MANIFEST, specs=SPECS)
    assert _folder_bytes(a) == _folder_bytes(b)  # manifest included: it holds no creation time
    td = load_cache(a, MANIFEST, HINT)
    assert td.batch_size == torch.Size([N]) and td["z"].device.type == "cpu"
    expect = torch.cat([c["z"] for c in _chunks()])
    assert torch.equal(td["z"][:], expect)
    assert td["task_id"].tolist() == [0, 0, 0, 1, 1, 1]
    assert _siblings(a) == ["a", "b"]  # no temporary folders left


@pytest.mark.parametrize("field,value", [
    ("encoder_hash", "enc2"),
    ("config_hash", "cfg2"),
    ("data_fingerprints", {"burgers1d": "11:sha256:bb"}),
    ("shapes", {"z": [N, T, L, 8], "task_id": [N], "dt": [N]}),
    ("dtypes", {"z": "torch.bfloat16", "task_id": "torch.int64", "dt": "torch.float32"}),
])
def test_changed_manifest_field_is_refused_with_rebuild_hint(tmp_path, field, value):
    out = write_cache(tmp_path / "c", _chunks, MANIFEST, specs=SPECS)
    expected = {**MANIFEST, field: value}
    with pytest.raises(CacheError, match=field) as err:
        load_cache(out, expected, HINT)
    assert HINT in str(err.value)


def test_missing_incomplete_truncated_corrupt_are_refused(tmp_path):
    with pytest.raises(CacheError, match="no manifest") as err:
        load_cache(tmp_path / "nothing", MANIFEST, HINT)
    assert HINT in str(err.value)

    out = write_cache(tmp_path / "c", _chunks, MANIFEST, specs=SPECS)
    manifest = (out / "manifest.json").read_bytes()
    (out / "manifest.json").write_bytes(manifest.replace(b'"complete": true', b'"complete": false'))
    with pytest.raises(CacheError, match="incomplete"):
        load_cache(out, MANIFEST, HINT)
    (out / "manifest.json").write_bytes(manifest)
    load_cache(out, MANIFEST, HINT)

    z = out / "z.memmap"
    data = z.read_bytes()
    z.write_bytes(data[:-4])
    with pytest.raises(CacheError, match="truncated"):
        load_cache(out, MANIFEST, HINT, verify="size")
    flipped = bytearray(data)
    flipped[100] ^= 0xFF
    z.write_bytes(bytes(flipped))
    load_cache(out, MANIFEST, HINT, verify="size")  # same size: only the hash can tell
    with pytest.raises(CacheError, match="corrupt") as err:
        load_cache(out, MANIFEST, HINT)
    assert HINT in str(err.value)


def test_replacing_a_cache_is_atomic_and_cleans_up(tmp_path):
    out = write_cache(tmp_path / "c", _chunks, MANIFEST, specs=SPECS)
    new = {**MANIFEST, "encoder_hash": "enc2"}
    write_cache(out, lambda: _chunks(2.0), new, specs=SPECS)
    td = load_cache(out, new, HINT)
    assert torch.equal(td["z"][:], 2.0 * torch.cat([c["z"] for c in _chunks()]))
    assert _siblings(out) == ["c"]


def test_write_that_raises_midway_leaves_old_cache_untouched(tmp_path):
    out = write_cache(tmp_path / "c", _chunks, MANIFEST, specs=SPECS)
    before = _folder_bytes(out)

    def failing():
        yield next(_chunks())
        raise RuntimeError("encoder crashed")

    with pytest.raises(RuntimeError, match="encoder crashed"):
        write_cache(out, failing, {**MANIFEST, "encoder_hash": "enc2"}, specs=SPECS)
    assert _folder_bytes(out) == before and _siblings(out) == ["c"]
    with pytest.raises(RuntimeError, match="encoder crashed"):
        write_cache(tmp_path / "fresh", failing, MANIFEST, specs=SPECS)
    assert not (tmp_path / "fresh").exists()
    with pytest.raises(ValueError, match="filled 3 of the 6 rows"):
        write_cache(tmp_path / "short", lambda: [next(_chunks())], MANIFEST, specs=SPECS)
    assert _siblings(out) == ["c"]


@pytest.mark.timeout(120)
def test_writer_killed_with_sigkill_is_never_loaded(tmp_path):
    out = tmp_path / "c"
    ready = tmp_path / "first_chunk_written"
    script = textwrap.dedent(f"""
        import time, torch
        from pipelines.latent_cache import write_cache
        def chunks():
            yield {{"z": torch.ones(3, {T}, {L}, {D}), "task_id": torch.zeros(3, dtype=torch.int64),
                    "dt": torch.ones(3)}}
            open({str(ready)!r}, "w").close()
            time.sleep(60)
            yield {{}}
        specs = {{"z": (({N}, {T}, {L}, {D}), torch.float32), "task_id": (({N},), torch.int64),
                 "dt": (({N},), torch.float32)}}
        write_cache({str(out)!r}, chunks, {{"config_hash": "x"}}, specs=specs)
    """)
    env = tr.env()
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, "writer exited early"
            assert time.monotonic() < deadline, "writer never wrote its first chunk"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out.exists()
    assert temp_dir_for(out, proc.pid).exists()  # the half-written folder is left aside ...
    with pytest.raises(CacheError, match="no manifest"):  # ... and never loaded
        load_cache(out, {"config_hash": "x"}, HINT)
    with pytest.raises(CacheError, match="no manifest"):
        load_cache(temp_dir_for(out, proc.pid), {"config_hash": "x"}, HINT)


def test_non_cpu_tensor_fails_at_once(tmp_path):
    consumed = []

    def chunks():
        for i, c in enumerate(_chunks()):
            consumed.append(i)
            yield {**c, "z": c["z"].to("meta")} if i == 0 else c

    with pytest.raises(ValueError, match="CPU tensors only: 'z' is on meta"):
        write_cache(tmp_path / "c", chunks, MANIFEST, specs=SPECS)
    assert consumed == [0] and not (tmp_path / "c").exists()
    assert list(tmp_path.iterdir()) == []

    td = allocate_cache(tmp_path / "t", SPECS)
    chunk = next(_chunks())
    with pytest.raises(ValueError, match="CPU tensors only"):
        write_rows(td, 0, {**chunk, "dt": torch.empty(3, device="meta")})
    assert torch.count_nonzero(td["z"]) == 0  # nothing was written


def test_rank_sliced_build_matches_single_writer(tmp_path):
    single = write_cache(tmp_path / "single", _chunks, MANIFEST, specs=SPECS)
    tmp = temp_dir_for(tmp_path / "multi", tag="run42")
    td0 = allocate_cache(tmp, SPECS)  # "rank 0"
    td1 = open_allocated(tmp)  # "rank 1", after the barrier
    c0, c1 = list(_chunks())
    write_rows(td1, 3, c1)
    write_rows(td0, 0, c0)
    del td0, td1
    multi = finalize_cache(tmp, tmp_path / "multi", MANIFEST)
    assert _folder_bytes(multi) == _folder_bytes(single)


def test_bad_specs_and_chunks_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="leading"):
        allocate_cache(tmp_path / "a", {"z": ((3, 2), torch.float32), "dt": ((4,), torch.float32)})
    td = allocate_cache(tmp_path / "b", SPECS)
    chunk = next(_chunks())
    with pytest.raises(ValueError, match="per row"):
        write_rows(td, 0, {**chunk, "z": chunk["z"].double()})
    with pytest.raises(ValueError, match="outside"):
        write_rows(td, 5, chunk)
    with pytest.raises(ValueError, match="reserved"):
        finalize_cache(tmp_path / "b", tmp_path / "out", {"complete": False})


def test_file_fingerprint_tracks_content_not_mtime(tmp_path):
    f = tmp_path / "data.h5"
    f.write_bytes(b"x" * 5000)
    fp = file_fingerprint(f)
    os.utime(f, (1, 1))
    assert file_fingerprint(f) == fp
    f.write_bytes(b"x" * 2500 + b"y" + b"x" * 2499)
    assert file_fingerprint(f) != fp
    assert fp.startswith("5000:sha256:")
