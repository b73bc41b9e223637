"""A 3D multi-channel field trains end to end: PDEBench's 3D compressible-flow layout (density,
pressure, Vx, Vy, Vz as [N, T, X, Y, Z]) at 32^3 through the codec, the cache, the operator, the
rollout, the evaluation (every metric per field) and its plots.

Legend: N trajectories, T stored steps, X/Y/Z grid points.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import orjson
import pytest
import yaml

from pipelines.layouts import describe
from tests.cfd_files import cell_centres, write_cfd
from tests.tiny_run import ROOT, env

pytestmark = pytest.mark.slow

N, T, S = 6, 6, 32
FIELDS = ("density", "pressure", "Vx", "Vy", "Vz")


def write_cfd_3d(path, seed: int = 0) -> None:
    """Smooth travelling waves in PDEBench's 3D CFD layout (`tests.cfd_files`)."""
    rng = np.random.default_rng(seed)
    X, Y, Z = np.meshgrid(*[cell_centres(S)] * 3, indexing="ij")
    t = np.linspace(0, 0.5, T)[:, None, None, None]

    def trajectory(n: int) -> dict[str, np.ndarray]:
        phase = rng.uniform(0, 2 * np.pi, 5)
        a = np.sin(2 * np.pi * (X - t) + phase[0]) * np.cos(2 * np.pi * Y + phase[1])
        b = np.cos(2 * np.pi * (Z - t) + phase[2]) * np.sin(2 * np.pi * X + phase[3])
        return dict(zip(FIELDS, (1 + 0.1 * a, 1 + 0.1 * b, a * b, a - b, np.sin(2 * np.pi * (Y + Z - t) + phase[4]))))

    write_cfd(path, trajectory, trajectories=N, steps=T, side=S, dims=3, t_end=0.6)


@pytest.mark.timeout(600)
def test_a_3d_multichannel_field_runs_through_codec_operator_rollout_and_evaluation(tmp_path):
    path = tmp_path / "3D_CFD_Rand_M1.0_Eta1e-08_Zeta1e-08_periodic_Train.hdf5"
    write_cfd_3d(path)
    (desc,) = describe(path)
    assert desc.dims == 3
    cfg = {
        "data": {"root": str(tmp_path / "data"), "split": {"test_fraction": 0.2},
                 "tasks": [{"path": str(path), "layout": "pdebench", "initial_step": 1}]},
        # 64 tokens = a 4^3 Morton grid of 8^3-point cells; 2 modes per axis, 40 coefficients -> 32.
        "latent": {"tokens": 64, "dim": 32, "hidden": 0, "modes": 2},
        "autoencoder": {"steps": 0},
        "operator": {"steps": 20, "batch_size": 4, "lr": 2e-3, "warmup_steps": 2,
                     "pdet": {"hidden_dim": 32, "depths": [1, 1], "num_heads": 4, "group_size": 8,
                              "token_conv": True}},
        "training": {"num_workers": 0, "cache_dir": str(tmp_path / "cache"), "parallel": "none"},
        "evaluation": {"val_every": 10, "val_samples": 2, "time_rollout": False},
        "logging": {"run_dir": str(tmp_path / "runs"), "run_name": "r3d", "progress": False,
                    "wandb": {"mode": "disabled"}},
        "stages": ["autoencoder", "cache", "operator", "evaluate"],
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    done = subprocess.run([sys.executable, "-m", "entry.pipeline", "--config", str(tmp_path / "cfg.yaml")],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]

    run = tmp_path / "runs" / "r3d"
    (task,) = orjson.loads((run / "eval.json").read_bytes())["tasks"].values()
    assert task["channels"] == ["density", "pressure", "velocity_x", "velocity_y", "velocity_z"]
    op, ref = task["variants"]["operator"], task["references"]["persistence"]
    assert set(op["per_field"]) == set(task["channels"])
    for name in ("nrmse", "vrmse"):
        assert np.isfinite([op["per_field"][f][name] for f in task["channels"]]).all(), name
    for name in ("brmse", "frmse_high", "crmse", "max_error"):  # the 3D faces and wavenumber shells
        assert np.isfinite(op[name]), name
    # Waves travel a fifth of the box between stored steps: persistence is a poor guess, and 20
    # steps of training already halve its error (0.43 against 0.80 when written).
    assert op["nrmse"] < 0.8 * ref["nrmse"], (op["nrmse"], ref["nrmse"])
    plots = sorted(p.name for p in (run / "plots").glob("*.png"))
    assert any(p.endswith("operator_sample0.png") for p in plots), plots
