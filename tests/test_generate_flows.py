"""``pipelines.generate`` for the 2D flows: files in PDEBench's and The Well's layouts that our
readers and ``pipelines.validate`` accept, the same values in both layouts, any worker count.

Legend: N samples, T stored steps, C channels, X/Y stored grid points.
"""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

from pipelines.flows import FLOWS, generate_flow
from pipelines.layouts import describe, read_window
from pipelines.validate import validate_dataset
from tests import tiny_run as tr

TINY = dict(resolution=16, stored=8, steps=3, t_end=0.05, chunk=2)
"""A few explicit steps of each solver on a 16 x 16 grid: seconds, not minutes."""


def _tiny_params(task: str) -> dict:
    return {"spinup": 0.05} if "spinup" in FLOWS[task].params else {}


@pytest.mark.parametrize("task", list(FLOWS))
def test_each_flow_writes_pdebench_layout_that_reads_back(tmp_path, task):
    spec = FLOWS[task]
    path = generate_flow(task, 3, tmp_path, params=_tiny_params(task), **TINY)
    (desc,) = describe(path)  # auto: recognised from the keys
    assert desc.layout == "pdebench" and desc.channels == spec.fields and desc.trajectories == 3
    assert desc.grid.shape == (8, 8) and desc.steps == 3
    np.testing.assert_allclose(desc.times, np.linspace(0, 0.05, 3))
    u = np.stack([read_window(desc, i) for i in range(3)])
    assert u.shape == (3, 3, len(spec.fields), 8, 8) and np.isfinite(u).all()
    assert not np.array_equal(u[0], u[1])  # each sample its own draw
    with h5py.File(path) as f:
        assert f.attrs["seed"] == 0 and f.attrs["resolution"] == 16 and f.attrs["solver"] == spec.module
    assert "N=3" in validate_dataset(path)


def test_the_well_layout_holds_the_same_values_split_as_pdebench_tests_first(tmp_path):
    pde = generate_flow("dr2d", 10, tmp_path / "p", **TINY)
    well = generate_flow("dr2d", 10, tmp_path / "w", layout="the_well", **TINY)
    (a,) = describe(pde)
    (b,) = describe(well)
    assert b.layout == "the_well" and b.channels == a.channels
    assert [len(b.split_rows(s)) for s in ("train", "valid", "test")] == [8, 1, 1]
    # test = the first 10% of the samples, validation the next 10% (PDEBench's convention)
    assert np.array_equal(read_window(b, b.split_rows("test")[0]), read_window(a, 0))
    assert np.array_equal(read_window(b, b.split_rows("valid")[0]), read_window(a, 1))
    assert np.array_equal(read_window(b, b.split_rows("train")[-1]), read_window(a, 9))


@pytest.mark.slow
def test_two_workers_write_the_same_file_as_one(tmp_path):
    one = generate_flow("swe2d", 4, tmp_path / "one", workers=1, **TINY)
    two = generate_flow("swe2d", 4, tmp_path / "two", workers=2, **TINY)
    (a,), (b,) = describe(one), describe(two)
    for i in range(4):
        assert np.array_equal(read_window(a, i), read_window(b, i))


def test_the_command_line_writes_a_flow_and_refuses_a_parameter_it_lacks(tmp_path):
    base = [sys.executable, "-m", "pipelines.generate", "--task", "dr2d", "--samples", "2", "--nx", "8",
            "--resolution", "16", "--nt", "3", "--t-end", "0.05", "--out", str(tmp_path), "--no-progress",
            "--device", "cpu"]
    done = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("2D_diff-react_k0.005_NA.h5")
    bad = subprocess.run([*base, "--nu", "0.1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--nu does not apply to dr2d" in bad.stderr


def test_each_forcing_of_the_kolmogorov_setting_is_one_flow_and_one_task():
    """The forcings are written in three places (the solver's table, the flows, the tasks): each
    Kolmogorov-setting forcing the solver knows is one flow, whose task reads the file named after
    that forcing, and every flow's forcing is one the solver knows."""
    from pipelines.solvers.ns2d import FORCINGS, KOLMOGOROV_WAVENUMBER
    from pipelines.tasks import get_task

    flows = [s for s in FLOWS.values() if s.forcing]
    by_forcing = {s.forcing: s for s in flows}
    assert len(by_forcing) == len(flows) and set(by_forcing) <= set(FORCINGS)
    for forcing in (*KOLMOGOROV_WAVENUMBER, "decaying"):
        assert f"ns_incom_{forcing}_2d_" in get_task(by_forcing[forcing].name).file_pattern, forcing


def test_the_solver_timing_solves_the_flow_it_is_asked_about_and_nothing_else():
    from bench.solver_time import solver_seconds
    from entry.config.schema import TaskConfig

    flow = TaskConfig(name="dr2d", param=0.005, nx=8, nt=3)
    s = solver_seconds(flow, rounds=1, batch=2)
    assert s["resolution"] == 8 and s["steps"] == 3 and s["batch"] == 2 and s["best_s"] > 0
    assert solver_seconds(flow, rounds=1, batch=2, as_generated=True)["resolution"] == 128  # the flow's own
    assert solver_seconds(TaskConfig(name="burgers1d", param=0.01, nx=16, nt=3)) is None


@pytest.mark.cuda
@pytest.mark.parametrize("task", list(FLOWS))
def test_cuda_solves_each_flow_as_the_cpu_does(task):
    """The same draws solved by the same float64 schemes on the GPU: only rounding differs (FFTs,
    reductions), far below the float32 the files store."""
    from pipelines.flows import solve_chunk

    flow = FLOWS[task]
    kw = dict(resolution=32, stored=16, steps=3, t_end=0.2, seed=1, params={**flow.params, **_tiny_params(task)})
    _, cpu = solve_chunk(flow, 0, 4, device="cpu", **kw)
    _, gpu = solve_chunk(flow, 0, 4, device="cuda", **kw)
    np.testing.assert_allclose(gpu, cpu, rtol=0, atol=1e-5 * np.abs(cpu).max())


def test_a_1d_task_in_the_well_layout_holds_the_pdebench_files_values(tmp_path):
    """`--layout the_well` for a generated 1D task: the same trajectories, split test first, and
    the_well's own reader sees what ours does; a steady task is refused in one line."""
    from pipelines.generate import main

    args = ["--task", "burgers1d", "--samples", "20", "--nx", "32", "--nt", "6", "--no-progress", "--device", "cpu"]
    assert main([*args, "--out", str(tmp_path / "p")]) == 0
    assert main([*args, "--out", str(tmp_path / "w"), "--layout", "the_well"]) == 0
    (pde,) = describe(tmp_path / "p")
    (well,) = describe(tmp_path / "w" / "burgers1d")
    assert well.layout == "the_well" and [len(well.split_rows(s)) for s in ("train", "valid", "test")] == [16, 2, 2]
    assert np.array_equal(read_window(well, well.split_rows("test")[1]), read_window(pde, 1))
    assert np.array_equal(read_window(well, well.split_rows("train")[0]), read_window(pde, 4))
    the_well = pytest.importorskip("the_well.data")
    ds = the_well.WellDataset(path=str(tmp_path / "w" / "burgers1d"), well_split_name="test", n_steps_input=2,
                              n_steps_output=1, use_normalization=False)
    sample = ds[0]  # trajectory 0 of the test split, steps 0, 1 in and 2 out, as [T, X, C]
    assert np.array_equal(sample["input_fields"].numpy(), read_window(pde, 0)[:2].transpose(0, 2, 1))
    with pytest.raises(SystemExit):
        main(["--task", "darcy2d", "--samples", "2", "--nx", "8", "--out", str(tmp_path / "d"), "--layout", "the_well"])


@pytest.mark.parametrize("task", [{"name": "advection1d", "param": 0.1, "nx": 32, "nt": 5, "t_end": 0.4},
                                  {"name": "swe2d", "param": 1.0, "nx": 8, "resolution": 16, "nt": 3, "t_end": 0.05}])
def test_a_task_entrys_t_end_is_the_time_of_its_last_stored_step(tmp_path, task):
    """`data.tasks[i].t_end`: the generated file stores ``nt`` steps evenly from t = 0 to it (a chaotic
    flow's frames close enough in time to be predicted one from the next); 0 keeps the task's own."""
    from entry.config.load import load_config
    from entry.data.files import ensure_data
    from tests.tiny_run import tiny_tree

    tree = tiny_tree(tmp_path)
    tree["data"]["tasks"] = [{**task, "samples": 2}]
    tree["latent"]["tokens"] = 16  # a power of 4, as a 2D task needs
    (path,) = ensure_data(load_config(tree=tree))
    (desc,) = describe(path)
    assert desc.steps == task["nt"] and desc.trajectories == 2
    np.testing.assert_allclose(desc.times, np.linspace(0.0, task["t_end"], task["nt"]), rtol=1e-6)


_DRAWS = """
import hashlib, sys
import numpy as np
from pipelines.solvers import dr2d, gray_scott, libm, ns2d, swe2d
from pipelines.solvers.initial_conditions import darcy_coefficient

def h(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]

rng = lambda: np.random.default_rng(7)
x = np.linspace(-30.0, 30.0, 20001)
print("grf", h(ns2d.gaussian_random_field(4, 32, rng=rng())))
for forcing in ("fno", "kolmogorov", "decaying"):
    print(forcing, h(ns2d.draw_ns2d_initial(rng(), 32, forcing=forcing)))
print("swe2d", h(swe2d.draw_dam_break(rng(), 32)), "dr2d", h(dr2d.draw_dr_initial(rng(), 32)))
print("darcy", h(darcy_coefficient(8, 32, rng=rng())))
print("gray_scott", h(gray_scott.draw_gray_scott_initial(rng(), 32)))
print("libm", h(libm.exp(x / 8)), h(libm.power(np.abs(x) + 0.5, -1.25)))
print("numpy", h(np.exp(x / 8)), h((np.abs(x) + 0.5) ** -1.25))
"""


def test_initial_states_are_the_same_bytes_whichever_simd_numpy_picks(tmp_path):
    # numpy picks its exp and power code by the CPU; with AVX-512 they differ from the C library's
    # in the last place, and the ns2d race file with them (2026-12-04). The draws go through
    # pipelines.solvers.libm: the same bytes with numpy's AVX-512 code turned off, which is numpy's
    # code on a CPU without it. (On a CPU without AVX-512 both runs below take the same path.)
    no_avx512 = "X86_V4 AVX512_ICL AVX512_SPR AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL"
    out = {}
    for name, extra in (("found", {}), ("no_avx512", {"NPY_DISABLE_CPU_FEATURES": no_avx512})):
        env = {k: v for k, v in tr.env().items() if k != "NPY_DISABLE_CPU_FEATURES"} | extra
        done = subprocess.run([sys.executable, "-c", _DRAWS], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        out[name] = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    numpy_found = out["found"].pop("numpy")
    assert out["found"] == {k: v for k, v in out["no_avx512"].items() if k != "numpy"}, (out, numpy_found)
    assert out["no_avx512"]["libm"] == out["no_avx512"]["numpy"]  # the C library's values: numpy's without AVX-512
