"""The solver as a peer (bench.solver_pareto): started from the stored frame the surrogate starts
from, on the grid the data were solved on, our solver reproduces the stored trajectories (an
independent check that the frames, channels, times and metric line up); on a coarser grid it is
cheaper and less accurate; the speedup reads the solver's cost at the surrogate's error."""

from __future__ import annotations

import math

import orjson
import pytest
import torch
import yaml

from bench import provenance
from bench.solver_pareto import SolverPoint, main, run, solver_points, speedup_at, speedup_bound
from entry.config.load import load_config
from entry.data.files import data_inputs, ensure_data, task_key

pytestmark = [pytest.mark.slow]


def _config(tmp_path, name: str, param: float, nt: int, nx: int = 16):
    grid = {"nx": nx} if name == "burgers1d" else {"nx": nx, "resolution": nx}  # solved on the stored grid
    if name == "gray_scott2d":  # its frames 80 time units apart by default: 8 apart cost a tenth of the steps
        grid["t_end"] = 40.0
    tree = {"data": {"root": str(tmp_path / "data"), "generate_if_missing": True,
                     "tasks": [{"name": name, "param": param, "samples": 20, "nt": nt, "initial_step": 2, **grid}]},
            "latent": {"codec": "conv", "patch": 4, "dim": 2, "hidden": 8},
            "logging": {"run_dir": str(tmp_path / "runs"), "wandb": {"mode": "disabled"}}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    cfg = load_config(path)
    ensure_data(cfg)
    return cfg


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, param, nt, nx", [("dr2d", 0.005, 6, 16), ("allen_cahn2d", 1e-3, 6, 16),
                                                ("gray_scott2d", 0.057, 6, 16),
                                                ("swe2d", 1.0, 6, 16), ("ns2d", 1e-3, 6, 16),
                                                ("burgers1d", 0.01, 11, 64)])
def test_the_solver_on_the_data_grid_reproduces_the_stored_trajectories(tmp_path, name, param, nt, nx):
    cfg = _config(tmp_path, name, param, nt, nx)
    fine, coarse = solver_points(cfg, 0, [nx, nx // 2], trajectories=2, rounds=1)
    # The restart from a float32 frame and its own step sizes: far below any model's error.
    assert fine.resolution == nx and fine.nrmse < 1e-3, fine
    assert coarse.nrmse > fine.nrmse, (coarse, fine)


def test_speedup_reads_the_solver_cost_at_the_surrogate_error_on_a_log_log_line():
    points = [SolverPoint(8, 0.1, 0.01, (0.01,)), SolverPoint(16, 0.01, 1.0, (1.0,))]
    # Halfway in log error between the two points: the geometric mean of their costs, 0.1 s.
    assert speedup_at(points, math.sqrt(0.1 * 0.01), 0.001) == pytest.approx(100.0)
    assert speedup_at(points, 0.1, 0.01) == pytest.approx(1.0)
    assert speedup_at(points, 0.001, 0.01) is None  # more accurate than any solver point: no bracket
    assert speedup_bound(points, math.sqrt(0.1 * 0.01), 0.001) is None  # bracketed: speedup_at's exact value
    # Less accurate than the coarsest solve: the solver is at most 0.01 s / 0.02 s; more accurate than the finest: at least 1 s / 0.02 s.
    assert speedup_bound(points, 0.2, 0.02) == ("at most", pytest.approx(0.5))
    assert speedup_bound(points, 0.001, 0.02) == ("at least", pytest.approx(50.0))


@pytest.mark.timeout(300)
def test_the_command_records_the_commit_and_the_data_it_measured(tmp_path, monkeypatch, capfd):
    cfg = _config(tmp_path, "burgers1d", 0.01, 11, 64)
    argv = ["--config", str(tmp_path / "cfg.yaml"), "--resolutions", "32,64", "--trajectories", "2", "--rounds", "1",
            "--out", str(tmp_path / "out")]
    monkeypatch.setattr(provenance, "uncommitted", lambda root: ["core/x.py"])  # a dirty tree: refused, nothing written
    assert main(argv) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bench.solver_pareto" in err[0] and "--allow-dirty" in err[0], err
    assert not (tmp_path / "out").exists()
    assert run([*argv, "--allow-dirty"]) == 0  # a development run measures, its record says so
    (record,) = [orjson.loads(p.read_bytes()) for p in (tmp_path / "out").glob("*-solver-pareto-burgers1d.json")]
    assert record["git_commit"] and record["dirty"] in (True, False)  # the real tree's state
    assert record["processor"] == provenance.processor_name(torch.device("cpu"))
    assert record["data_fingerprint"] and record["data_fingerprint"] == data_inputs(cfg)[task_key(cfg, 0)]
    assert [p["resolution"] for p in record["solver"]] == [32, 64] and record["surrogate"] is None
