"""`pipelines.generate`: PDEBench layout, determinism across workers/chunks, refusal of bad arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from pipelines.generate import generate_task
from pipelines.task_data import read_task
from pipelines.validate import validate_file

ROOT = Path(__file__).resolve().parents[1]


def run_generate(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "pipelines.generate", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)


def test_1d_files_have_pdebench_layout(tmp_path):
    for task, param, name in (("advection1d", 0.4, "1D_Advection_Sols_beta0.4.hdf5"),
                              ("burgers1d", 0.01, "1D_Burgers_Sols_Nu0.01.hdf5")):
        path = generate_task(task, 4, tmp_path, nx=64, nt=11, seed=0, param=param)
        assert path == tmp_path / name
        with h5py.File(path, "r") as f:
            assert sorted(f.keys()) == ["t-coordinate", "tensor", "x-coordinate"]
            assert {k: (f[k].shape, f[k].dtype) for k in f} == {
                "tensor": ((4, 11, 64), np.float32), "x-coordinate": ((64,), np.float32),
                "t-coordinate": ((12,), np.float32)}
            np.testing.assert_allclose(f["x-coordinate"][:], (np.arange(64) + 0.5) / 64, rtol=1e-6)
            np.testing.assert_allclose(f["t-coordinate"][:], np.arange(12) * 0.2, rtol=1e-6)
            assert f.attrs["seed"] == 0 and f.attrs["task"] == task
            u = f["tensor"][:]
        assert np.isfinite(u).all() and np.abs(u).max() > 0.05
        validate_file(path)
    adv = read_task(tmp_path / "1D_Advection_Sols_beta0.4.hdf5")
    assert np.abs(adv.u).max() <= 4.0 + 1e-5  # PDEBench's init_multi bound, k_tot = 4


def test_darcy_file_has_pdebench_layout(tmp_path):
    path = generate_task("darcy2d", 4, tmp_path, nx=16, nt=201, seed=1, param=1.0)
    assert path.name == "2D_DarcyFlow_beta1.0_Train.hdf5"
    with h5py.File(path, "r") as f:
        assert {k: (f[k].shape, f[k].dtype) for k in f} == {
            "tensor": ((4, 1, 16, 16), np.float32), "nu": ((4, 16, 16), np.float32),
            "x-coordinate": ((16,), np.float32), "y-coordinate": ((16,), np.float32)}
        assert set(np.unique(f["nu"][:])) <= {np.float32(0.1), np.float32(1.0)}
        assert (f["tensor"][:] > 0).all()  # positive forcing, zero boundary: u > 0 inside
    assert validate_file(path).task == "darcy2d"


def test_cli_deterministic_across_workers_and_chunks(tmp_path):
    """40 samples span two solver blocks; workers 2 with chunk 1 must equal workers 1 with one chunk.

    The byte-for-byte promise is the CPU path's (device="cpu"); CUDA is checked to a
    tolerance in test_generate_device.py.
    """
    a = generate_task("burgers1d", 40, tmp_path / "a", nx=32, nt=6, seed=7, param=0.01, workers=1, chunk=1000,
                      device="cpu")
    result = run_generate("--task", "burgers1d", "--samples", 40, "--out", tmp_path / "b", "--nx", 32, "--nt", 6,
                          "--seed", 7, "--nu", 0.01, "--workers", 2, "--chunk", 1, "--no-progress",
                          "--device", "cpu")
    assert result.returncode == 0, result.stderr
    b = tmp_path / "b" / a.name
    assert result.stdout.strip() == str(b)
    c = generate_task("burgers1d", 40, tmp_path / "c", nx=32, nt=6, seed=8, param=0.01, device="cpu")
    with h5py.File(a) as fa, h5py.File(b) as fb, h5py.File(c) as fc:
        np.testing.assert_array_equal(fa["tensor"][:], fb["tensor"][:])
        assert not np.array_equal(fa["tensor"][:], fc["tensor"][:])
    # a prefix of the samples does not depend on how many samples follow
    d = generate_task("burgers1d", 5, tmp_path / "d", nx=32, nt=6, seed=7, param=0.01, device="cpu")
    np.testing.assert_array_equal(read_task(d).u[:, 0], read_task(a, np.arange(5)).u[:, 0])


def test_darcy_and_advection_chunk_independent(tmp_path):
    for task, param in (("darcy2d", 0.1), ("advection1d", 1.0)):
        kw = dict(nx=16, nt=5, seed=3, param=param, device="cpu")
        a = generate_task(task, 35, tmp_path / "a", chunk=1, **kw)
        b = generate_task(task, 35, tmp_path / "b", chunk=64, **kw)
        np.testing.assert_array_equal(read_task(a).u, read_task(b).u)


BAD_ARGS = {
    "zero_samples": (["--task", "burgers1d", "--samples", "0"], "samples must be >= 1"),
    "negative_samples": (["--task", "burgers1d", "--samples", "-3"], "samples must be >= 1"),
    "unknown_task": (["--task", "heat1d", "--samples", "4"], "invalid choice: 'heat1d'"),
    "small_nx": (["--task", "advection1d", "--samples", "4", "--nx", "4"], "nx must be >= 8"),
    "small_nt": (["--task", "advection1d", "--samples", "4", "--nt", "1"], "nt must be >= 2"),
    "wrong_param": (["--task", "advection1d", "--samples", "4", "--nu", "0.1"],
                    "--nu does not apply to task advection1d"),
    "darcy_beta_for_burgers": (["--task", "burgers1d", "--samples", "4", "--darcy-beta", "1"],
                               "--darcy-beta does not apply to task burgers1d"),
    "nt_for_darcy": (["--task", "darcy2d", "--samples", "4", "--nt", "11"], "do not apply to the steady task"),
    "negative_param": (["--task", "burgers1d", "--samples", "4", "--nu", "-1"], "nu must be a finite number > 0"),
    "zero_workers": (["--task", "burgers1d", "--samples", "4", "--workers", "0"], "workers and chunk must be >= 1"),
    "unknown_device": (["--task", "burgers1d", "--samples", "4", "--device", "tpu"], "invalid choice: 'tpu'"),
    "not_a_number": (["--task", "burgers1d", "--samples", "many"], "invalid int value: 'many'"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_cli_refuses_bad_arguments(tmp_path, case):
    args, message = BAD_ARGS[case]
    out = tmp_path / "out"
    (tmp_path / "keep.txt").write_text("x")
    result = run_generate(*args, "--out", out)
    assert result.returncode == 2
    assert message in result.stderr and "usage: python -m pipelines.generate" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]  # out/ never created


def test_generate_task_refuses_before_writing(tmp_path):
    with pytest.raises(ValueError, match="nx must be >= 8"):
        generate_task("darcy2d", 2, tmp_path / "out", nx=4)
    with pytest.raises(ValueError, match="unknown task"):
        generate_task("heat1d", 2, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
