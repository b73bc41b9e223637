"""A data file's declared sizes are checked from its metadata, before any read, by every reader (issue 47,
bug 1): a chunked dataset, compressed or not, that stores fewer chunks than it declares is a fill
value, not data; a sample larger than memory is refused. One line, exit 2, in well under 2 s for a
file declaring 262 GiB, and never a MemoryError.

Legend: N trajectories, T time steps, X grid points.
"""

from __future__ import annotations

import time

import h5py
import numpy as np
import pytest
import yaml

from pipelines.fields import FieldSnapshots
from pipelines.layouts import DataError, describe
from pipelines.task_data import open_task
from pipelines.validate import validate_dataset, validate_file
from tests import tiny_run as tr

pytestmark = pytest.mark.timeout(120)  # a regression scans 262 GiB of fill values: fail, do not hang

BURGERS = "1D_Burgers_Sols_Nu0.01.hdf5"
ONE_LINE_S = 2.0  # the issue's bound for an answer from metadata (it takes milliseconds)


def _burgers(path, shape_NTX, *, chunks=None, compression=None, written: slice | None = None, fillvalue=0.5):
    """A PDEBench 1D file whose `tensor` declares `shape_NTX`; only the rows `written` are written
    (None: none, the issue's 4 KB file of fill values)."""
    n, nt, nx = shape_NTX
    with h5py.File(path, "w") as f:
        d = f.create_dataset("tensor", shape_NTX, "f4", chunks=chunks, compression=compression, fillvalue=fillvalue)
        if written is not None:
            rows = range(n)[written]
            d[written] = np.random.default_rng(0).standard_normal((len(rows), nt, nx)).astype(np.float32)
        f["x-coordinate"] = np.linspace(0, 1, nx, dtype=np.float32)
        f["t-coordinate"] = np.linspace(0, 1, nt + 1, dtype=np.float32)
    return path


def _fill_value_file(folder):
    """The issue's file, verbatim: 4 KB declaring [200000, 41, 128] of a fill value, gzip-compressed."""
    folder.mkdir(parents=True, exist_ok=True)
    return _burgers(folder / BURGERS, (200000, 41, 128), chunks=(256, 41, 128), compression="gzip")


def _answer(main, argv, capsys) -> tuple[int, str, float]:
    """(exit code, the one stderr line, seconds) of a command's `main` run in this process."""
    start = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "MemoryError" not in err, err[-3000:]
    return code, lines[0], seconds


def test_the_issues_4_kb_fill_value_file_is_refused_by_validate_in_one_line(tmp_path, capsys):
    from pipelines.validate import main

    path = _fill_value_file(tmp_path / "x")
    assert path.stat().st_size < 8192
    code, line, seconds = _answer(main, [str(path)], capsys)
    assert code == 2 and seconds < ONE_LINE_S, (code, seconds)
    assert line.startswith(f"error: {path}: dataset 'tensor' declares [200000, 41, 128] float32"), line
    assert "stores 0 of its 782 chunks" in line and "fill value" in line, line


_GIB_262 = (1_000_000, 256, 275)  # float32: 262.3 GiB, 281.6 KB per sample


@pytest.mark.parametrize("compression", [None, "gzip"])
@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_a_file_declaring_262_gib_is_answered_in_one_line_from_metadata(tmp_path, capsys, command, compression):
    """Uncompressed (contiguous, never allocated) or compressed (no chunk written): inspect and
    validate exit 2 with one line naming the dataset, within `ONE_LINE_S`: they never scan it."""
    import importlib

    main = importlib.import_module(f"pipelines.{command}").main
    chunks = (64, 256, 275) if compression else None
    path = _burgers(tmp_path / BURGERS, _GIB_262, chunks=chunks, compression=compression)
    assert path.stat().st_size < 1 << 20
    code, line, seconds = _answer(main, [str(path)], capsys)
    assert code == 2 and seconds < ONE_LINE_S, (code, seconds, line)
    assert "dataset 'tensor' declares [1000000, 256, 275] float32 = 262.3 GiB, but the file stores 0" in line, line


def test_a_compressed_sample_larger_than_memory_is_one_line_for_inspect_and_validate(tmp_path, capsys, monkeypatch):
    """The issue's 65.6 GiB samples (gzip): inspect read one trajectory into a MemoryError. The bound
    is half the memory available; set here so the test does not depend on this machine's."""
    from pipelines.inspect import main as inspect_main
    from pipelines.validate import main as validate_main

    monkeypatch.setenv("US_MAX_SAMPLE_BYTES", str(8 << 30))
    path = _burgers(tmp_path / BURGERS, (4, 4096, 4_300_000), chunks=(1, 64, 65536), compression="gzip")
    for main in (inspect_main, validate_main):
        code, line, _ = _answer(main, [str(path)], capsys)
        assert code == 2 and "dataset 'tensor' declares [4, 4096, 4300000] float32 = 65.6 GiB per sample, " \
                              "more than 8.0 GiB (US_MAX_SAMPLE_BYTES=8589934592)" in line, line


def test_a_complete_compressed_file_is_read_and_one_missing_chunk_is_refused(tmp_path, capsys):
    """No false alarm: every chunk written (gzip) validates and inspects; the same file with the
    last chunk of samples never written is refused, naming the count."""
    from pipelines.inspect import main as inspect_main

    for name in ("whole", "cut"):
        (tmp_path / name).mkdir()
    whole = _burgers(tmp_path / "whole" / BURGERS, (12, 9, 16), chunks=(4, 9, 16), compression="gzip",
                     written=slice(None))
    assert "N=12" in str(validate_file(whole))
    assert inspect_main([str(whole)]) == 0
    capsys.readouterr()
    cut = _burgers(tmp_path / "cut" / BURGERS, (12, 9, 16), chunks=(4, 9, 16), compression="gzip",
                   written=slice(0, 8))
    with pytest.raises(DataError, match=r"declares \[12, 9, 16\] float32 = .*, but the file stores 2 of its 3 chunks"):
        validate_file(cut)


def _user_hdf5(path):
    """A user's HDF5 file (layout hdf5) of one compressed, never written field."""
    with h5py.File(path, "w") as f:
        f.create_dataset("u", (100000, 20, 64, 64), "f4", chunks=(16, 20, 64, 64), compression="gzip")
    return path


READERS = {
    "describe (auto)": lambda p: describe(p),
    "describe (hdf5)": lambda p: describe(_user_hdf5(p.with_name("user.h5")), "hdf5",
                                          options={"fields": [{"key": "u", "axes": "n t x y"}]}),
    "validate_file": lambda p: validate_file(p),
    "validate_dataset": lambda p: validate_dataset(p),
    "open_task": lambda p: open_task(p).close(),
    "training's FieldSnapshots": lambda p: FieldSnapshots(p, range(4)),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_every_reader_refuses_a_fill_value_file_before_reading(tmp_path, reader):
    path = _fill_value_file(tmp_path)
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"but the file stores 0 of its \d+ chunks"):
        READERS[reader](path)
    assert time.perf_counter() - start < ONE_LINE_S


def test_a_per_sample_group_trajectory_larger_than_memory_is_refused(tmp_path, monkeypatch):
    """PDEBench's per-sample groups declare a trajectory as one dataset [T, X, Y, C], whose rows are
    time steps: the description's whole trajectory is what is checked against memory."""
    path = tmp_path / "2D_diff-react_NA_NA.h5"
    with h5py.File(path, "w") as f:
        for i in range(2):
            f[f"{i:04d}/data"] = np.zeros((10, 8, 8, 2), np.float32)  # 5 KiB per trajectory
            f[f"{i:04d}/grid/x"] = np.linspace(0, 1, 8)
            f[f"{i:04d}/grid/y"] = np.linspace(0, 1, 8)
            f[f"{i:04d}/grid/t"] = np.linspace(0, 1, 10)
    assert describe(path)[0].trajectories == 2
    monkeypatch.setenv("US_MAX_SAMPLE_BYTES", "4096")  # above a step's 512 bytes, below a trajectory
    with pytest.raises(DataError, match=r"one trajectory of .* is \[10, 2, 8, 8\] \(T, C, \*S\) float32 = 0.0 GiB "
                                        r"per sample, more than 0.0 GiB \(US_MAX_SAMPLE_BYTES=4096\)"):
        describe(path)


@pytest.mark.parametrize("declared", [False, True])
def test_entry_cache_refuses_in_one_data_error_line_and_writes_nothing(tmp_path, capfd, declared):
    """The issue's fill-value file as a generated task's file, and as a declared dataset: exit 2, one line, no
    MemoryError, no run folder or cache."""
    from entry.cache import main

    path = _fill_value_file(tmp_path / "data")
    tree = tr.tiny_tree(tmp_path)
    tree["data"]["tasks"] = [{"path": str(path), "layout": "pdebench"} if declared else
                             {"name": "burgers1d", "param": 0.01, "samples": 200000, "path": str(path)}]
    cfg = tmp_path / "fill.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["--config", str(cfg)]) == 2
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err and "MemoryError" not in err, err[-3000:]
    assert "stores 0 of its 782 chunks" in lines[0], lines[0]
    assert lines[0].startswith("config error" if declared else "data error"), lines[0]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
