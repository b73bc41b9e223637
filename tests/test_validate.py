"""`pipelines.validate`: one line per good file; every bad file is exit 2 naming file and problem."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipelines import validate
from pipelines.pdebench_io import DataError
from tests.test_pdebench_io import write_raw_1d, write_raw_darcy

ROOT = Path(__file__).resolve().parents[1]


def run_validate_process(*paths) -> subprocess.CompletedProcess:
    """`python -m pipelines.validate PATH...` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "pipelines.validate", *map(str, paths)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def run_validate(*paths) -> subprocess.CompletedProcess:
    """The same command in this process (`main` is what the module runs; a process start costs
    ~5 s of imports): exit code and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = validate.main([str(p) for p in paths])
        except SystemExit as e:  # argparse's usage error
            code = e.code
    return subprocess.CompletedProcess(["pipelines.validate", *map(str, paths)], code, out.getvalue(), err.getvalue())


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_validate_file_report(tmp_path):
    path = tmp_path / "2D_DarcyFlow_beta0.1_Train.hdf5"
    write_raw_darcy(path)
    report = validate.validate_file(path)
    assert report.task == "darcy2d" and report.n_samples == 3 and report.param == 0.1
    stats = {s.key: s for s in report.fields}
    assert stats["nu"].min == pytest.approx(0.1) and stats["nu"].max == pytest.approx(1.0)
    line = str(report)
    assert "\n" not in line and str(path) in line and "darcy2d" in line and "nan=0 inf=0" in line


def test_cli_good_files_one_line_each(tmp_path):
    a, b = tmp_path / "1D_Burgers_Sols_Nu0.01.hdf5", tmp_path / "1D_Advection_Sols_beta1.0.hdf5"
    write_raw_1d(a)
    write_raw_1d(b)
    before = snapshot(tmp_path)
    result = run_validate_process(a, b)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and "burgers1d" in lines[0] and "advection1d" in lines[1]
    assert "tensor[5, 11, 32] float32" in lines[0]
    assert snapshot(tmp_path) == before


def _nan(data):
    data = data.copy()
    data[1, 2, 3] = np.nan
    return data


def _inf(data):
    data = data.copy()
    data[0, 0, 0] = -np.inf
    return data


BAD_1D = {
    "wrong_key": ({"tensor": None, "data": np.zeros((5, 11, 32), np.float32)}, "missing dataset 'tensor'"),
    "t_length": ({"t-coordinate": np.arange(11, dtype=np.float32)}, "'t-coordinate' has shape (11,), expected (12,)"),
    "x_length": ({"x-coordinate": np.arange(33, dtype=np.float32)}, "'x-coordinate' has shape (33,), expected (32,)"),
    "nan": ("nan", "dataset 'tensor' has 1 NaN and 0 Inf values"),
    "inf": ("inf", "dataset 'tensor' has 0 NaN and 1 Inf values"),
    "coords": ({"x-coordinate": np.zeros(32, np.float32)}, "'x-coordinate' is not strictly increasing"),
}


@pytest.mark.parametrize("case", sorted(BAD_1D))
def test_cli_bad_1d_file(tmp_path, case):
    overrides, message = BAD_1D[case]
    path = tmp_path / "1D_Burgers_Sols_Nu0.001.hdf5"
    if isinstance(overrides, str):
        tensor = np.random.default_rng(0).standard_normal((5, 11, 32)).astype(np.float32)
        overrides = {"tensor": _nan(tensor) if overrides == "nan" else _inf(tensor)}
    write_raw_1d(path, **overrides)
    good = tmp_path / "1D_Advection_Sols_beta0.1.hdf5"
    write_raw_1d(good)
    before = snapshot(tmp_path)
    result = run_validate(good, path)
    assert result.returncode == 2
    assert f"error: {path}: {message}" in result.stderr
    assert "advection1d" in result.stdout  # the good file is still reported
    assert snapshot(tmp_path) == before


def test_cli_darcy_shape_disagreement(tmp_path):
    path = tmp_path / "2D_DarcyFlow_beta1.0_Train.hdf5"
    write_raw_darcy(path, n=3, tensor=np.zeros((4, 1, 16, 16), np.float32))
    before = snapshot(tmp_path)
    result = run_validate(path)
    assert result.returncode == 2
    assert f"error: {path}: 'nu' has shape (3, 16, 16), expected (4, 16, 16)" in result.stderr
    assert snapshot(tmp_path) == before


def test_cli_missing_and_truncated(tmp_path):
    missing = tmp_path / "1D_Burgers_Sols_Nu0.1.hdf5"
    truncated = tmp_path / "1D_Burgers_Sols_Nu0.2.hdf5"
    write_raw_1d(truncated, n=20, nx=256)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) * 2 // 3])
    before = snapshot(tmp_path)
    result = run_validate(missing, truncated)
    assert result.returncode == 2
    assert f"error: {missing}: no such file" in result.stderr
    assert f"error: {truncated}: cannot" in result.stderr and "truncated or corrupt" in result.stderr
    assert snapshot(tmp_path) == before


def test_cli_needs_a_path():
    assert run_validate().returncode == 2


def test_scan_is_chunked(tmp_path, monkeypatch):
    """NaN/Inf found and counted across many small blocks (big files are never loaded whole)."""
    monkeypatch.setattr(validate, "_SCAN_BYTES", 11 * 32 * 4)  # one sample per block
    tensor = np.random.default_rng(0).standard_normal((5, 11, 32)).astype(np.float32)
    tensor[0, 0, 0] = tensor[4, 10, 31] = np.nan
    tensor[2, 5, 5] = np.inf
    path = tmp_path / "1D_Burgers_Sols_Nu0.001.hdf5"
    write_raw_1d(path, tensor=tensor)
    with pytest.raises(DataError, match="has 2 NaN and 1 Inf values"):
        validate.validate_file(path)
    clean = tmp_path / "1D_Burgers_Sols_Nu0.002.hdf5"
    raw = write_raw_1d(clean)
    stats = validate.validate_file(clean).fields[0]
    assert stats.min == raw["tensor"].min() and stats.max == raw["tensor"].max()
