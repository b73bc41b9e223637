"""`pipelines.generate --device`: the CPU path is unchanged, CUDA is refused when absent, CUDA matches CPU."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from pipelines.generate import (SOLVE_BLOCK, _draw_inputs, _solve_chunk, _solve_chunk_torch, _times,
                                generate_task, resolve_device)
from pipelines.solvers import solve_advection, solve_burgers, solve_darcy
from pipelines.solvers.burgers import solve_burgers_blocks
from pipelines.solvers.darcy import solve_darcy_cg
from pipelines.task_data import read_task
from tests.test_generate import run_generate

CASES = (("advection1d", 0.4, 32), ("burgers1d", 0.02, 32), ("darcy2d", 1.0, 16))
needs_cuda = pytest.mark.cuda  # skipped with the reason without a GPU (tests/conftest.py)


def test_cpu_device_solves_the_drawn_inputs_with_the_cpu_solvers(tmp_path):
    """device="cpu" writes exactly what the per-sample draws and the CPU solvers give."""
    for task, param, nx in CASES:
        path = generate_task(task, 40, tmp_path, nx=nx, nt=6, seed=2, param=param, device="cpu")
        inputs = _draw_inputs(task, 0, 40, nx, seed=2)
        t_T = _times(6, 2.0)[:6]
        if task == "darcy2d":
            expected = solve_darcy(inputs, param)[:, None]
        elif task == "advection1d":
            expected = solve_advection(inputs, param, t_T)
        else:
            expected = np.concatenate([solve_burgers(inputs[b:b + SOLVE_BLOCK], param, t_T, chunk=SOLVE_BLOCK)
                                       for b in range(0, 40, SOLVE_BLOCK)])
        data = read_task(path)
        np.testing.assert_array_equal(data.u.reshape(expected.shape), expected)
        if task == "darcy2d":
            np.testing.assert_array_equal(data.coefficient.reshape(inputs.shape), inputs)


def test_torch_chunk_path_matches_cpu_path_on_cpu():
    """The code path CUDA takes, run on CPU: same inputs, same results to float32 rounding."""
    for task, param, nx in CASES:
        nt, t_end = (1, 0.0) if task == "darcy2d" else (6, 2.0)  # what generate_task passes
        _, ref, nu_ref = _solve_chunk(task, param, 0, 40, nx, nt, t_end, 3)
        _, got, nu_got = _solve_chunk_torch("cpu", task, param, 0, 40, nx, nt, t_end, 3)
        assert got.dtype == ref.dtype == np.float32 and got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
        assert (nu_ref is None and nu_got is None) or np.array_equal(nu_ref, nu_got)


def test_resolve_device():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_refused_without_cuda(tmp_path):
    with pytest.raises(ValueError, match="--device cuda"):
        generate_task("darcy2d", 2, tmp_path / "api", nx=8, device="cuda")
    result = run_generate("--task", "darcy2d", "--samples", 2, "--nx", 8, "--device", "cuda",
                          "--out", tmp_path / "cli")
    assert result.returncode == 2
    assert "--device cuda" in result.stderr and "torch.cuda.is_available() is False" in result.stderr
    assert list(tmp_path.iterdir()) == []


@needs_cuda
def test_cuda_solvers_match_cpu_solvers_in_float64():
    rng = np.random.default_rng(0)
    x_X = (np.arange(64) + 0.5) / 64
    u0_NX = np.stack([np.sin(2 * np.pi * x_X * k + rng.uniform(0, 6)) * rng.uniform(0.1, 4) for k in range(1, 41)])
    t_T = np.linspace(0.0, 0.5, 6)
    f64 = dict(out_dtype=np.float64)

    def close(got, ref):
        got = got.cpu().numpy()
        assert np.abs(got - ref).max() <= 1e-9 * np.abs(ref).max()

    close(solve_advection(torch.from_numpy(u0_NX).cuda(), 0.4, t_T, **f64), solve_advection(u0_NX, 0.4, t_T, **f64))
    for nu in (0.001, 0.05):
        ref = np.concatenate([solve_burgers(u0_NX[b:b + 16], nu, t_T, chunk=16, compile=False, **f64)
                              for b in range(0, 40, 16)])
        close(solve_burgers_blocks(torch.from_numpy(u0_NX).cuda(), nu, t_T, block=16, **f64), ref)
    a_NXY = _draw_inputs("darcy2d", 0, 8, 64, seed=0)
    close(solve_darcy_cg(torch.from_numpy(a_NXY).cuda(), 1.0, **f64), solve_darcy(a_NXY, 1.0, **f64))


@needs_cuda
def test_cuda_files_match_cpu_files(tmp_path):
    for task, param, nx in CASES:
        kw = dict(nx=nx, nt=6, seed=4, param=param)
        cpu = read_task(generate_task(task, 40, tmp_path / "cpu", device="cpu", **kw))
        gpu_path = generate_task(task, 40, tmp_path / "gpu", device="cuda", chunk=64, **kw)
        with h5py.File(gpu_path) as f:
            assert f.attrs["solver"].endswith(("solve_advection", "solve_burgers_blocks", "solve_darcy_cg"))
        gpu = read_task(gpu_path)
        small = read_task(generate_task(task, 40, tmp_path / "small", device="cuda", chunk=1, **kw))
        # float32 files of float64 results that agree to ~1e-12: at most a last-bit difference
        for other in (gpu, small):
            np.testing.assert_allclose(other.u, cpu.u, rtol=1e-6, atol=1e-6 * np.abs(cpu.u).max())
        if task == "darcy2d":
            np.testing.assert_array_equal(gpu.coefficient, cpu.coefficient)
