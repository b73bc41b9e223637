"""Evaluation: metric layer against oracles and hand-computed scores, and the command end to end.

Data are tiny generated PDEBench files; the end-to-end run uses seeded, untrained weights
(the test is about the plumbing, not accuracy).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
import yaml

from entry.config.schema import TaskConfig
from entry.evaluation.scoring import MetricSums, evaluate_task
from pipelines.generate import generate_task
from pipelines.task_data import read_task
from tests import tiny_run as tr

GIVEN = 3


@pytest.fixture(scope="module")
def advection(tmp_path_factory) -> torch.Tensor:
    """u [N, T, C, X] of a tiny advection file (20 samples, 32 points, 11 steps)."""
    path = generate_task("advection1d", 20, tmp_path_factory.mktemp("adv"), nx=32, nt=11, param=0.1)
    return torch.from_numpy(read_task(path).u)


def _oracle(u_NTCS: torch.Tensor):
    """Field-space step returning the true next frame of whichever stored frame it is given."""
    table = {u_NTCS[n, t].numpy().tobytes(): u_NTCS[n, t + 1]
             for n in range(u_NTCS.shape[0]) for t in range(u_NTCS.shape[1] - 1)}
    return lambda u_BCS, dt, tid: torch.stack([table[u.numpy().tobytes()] for u in u_BCS])


def _persistence_hand(u: np.ndarray, given: int) -> tuple[np.ndarray, float]:
    """Per-step nRMSE [T - given] of predicting every later frame by frame given - 1, and the one-step value."""
    u = u[:, :, 0].astype(np.float64)  # [N, T, X]
    err = np.sqrt(((u[:, given - 1:given] - u[:, given:]) ** 2).mean(-1))
    per_step = (err / np.sqrt((u[:, given:] ** 2).mean(-1))).mean(0)
    # one-step: frame t from true frame t - 1, scored on the predicted frames t >= given only
    one = np.sqrt(((u[:, given - 1:-1] - u[:, given:]) ** 2).mean(-1)) / np.sqrt((u[:, given:] ** 2).mean(-1))
    return per_step, float(one.mean())


TASK = TaskConfig(name="advection1d", param=0.1, initial_step=GIVEN)


def test_oracle_scores_zero(advection):
    s = evaluate_task(TASK, 0, advection, given_steps=GIVEN, dt=0.1, predict_fields=_oracle(advection))
    assert s["nrmse"] == 0 and s["nrmse_pdebench2022"] == 0 and s["one_step_nrmse"] == 0
    assert s["rmse"] == 0 and s["max_error"] == 0 and s["frmse_high"] == 0
    assert len(s["nrmse_per_step"]) == advection.shape[1] - GIVEN and s["n_samples"] == advection.shape[0]


def test_persistence_matches_hand_computed(advection):
    s = evaluate_task(TASK, 0, advection, given_steps=GIVEN, dt=0.1, predict_fields=lambda u, dt, tid: u,
                      batch_size=7)  # uneven batches: sums must combine exactly
    per_step, one = _persistence_hand(advection.numpy(), GIVEN)
    assert s["nrmse"] > 0.05  # advection moves the field: persistence is a real error
    np.testing.assert_allclose(s["nrmse"], per_step.mean(), rtol=1e-5)
    np.testing.assert_allclose(s["nrmse_per_step"], per_step, rtol=1e-5)
    np.testing.assert_allclose(s["one_step_nrmse"], one, rtol=1e-5)


def test_pdebench2022_counts_given_steps_as_zero_error(advection):
    s = evaluate_task(TASK, 0, advection, given_steps=GIVEN, dt=0.1, predict_fields=lambda u, dt, tid: u)
    per_step, _ = _persistence_hand(advection.numpy(), GIVEN)
    t = advection.shape[1]
    np.testing.assert_allclose(s["nrmse_pdebench2022"], per_step.sum() / t, rtol=1e-5)
    assert s["nrmse_pdebench2022"] < s["nrmse"]


def test_rollout_steps_caps_the_window(advection):
    s = evaluate_task(TASK, 0, advection, given_steps=GIVEN, dt=0.1, predict_fields=lambda u, dt, tid: u,
                      rollout_steps=2)
    per_step, _ = _persistence_hand(advection.numpy()[:, :GIVEN + 2], GIVEN)
    assert len(s["nrmse_per_step"]) == 2
    np.testing.assert_allclose(s["nrmse"], per_step.mean(), rtol=1e-5)


def test_sums_match_pdebench_metrics_on_one_batch():
    """Per-sample sums (mean metrics) and sums of squares (RMS-over-batch metrics) reproduce
    core.metrics on the whole batch, however the batch is cut."""
    from core.metrics import pdebench_metrics

    g = torch.Generator().manual_seed(0)
    pred, true = torch.randn(6, 1, 5, 16, generator=g), torch.randn(6, 1, 5, 16, generator=g)
    sums = MetricSums.zeros(1, 5, 2, False, "cpu")
    sums.add(pred[:4], true[:4], None)
    sums.add(pred[4:], true[4:], None)
    got, want = sums.summary(), pdebench_metrics(pred, true, given_steps=2)
    for k in ("rmse", "nrmse", "crmse", "brmse", "max_error", "frmse_low", "frmse_mid", "frmse_high"):
        np.testing.assert_allclose(got[k], want[f"{k}_mean"].item(), rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(got["nrmse_pdebench2022"], want["nrmse_pdebench2022"].item(), rtol=1e-5)


def test_steady_oracle_scores_zero(tmp_path):
    data = read_task(generate_task("darcy2d", 10, tmp_path, nx=16, param=1.0))
    table = {c.tobytes(): torch.from_numpy(u[0]) for c, u in zip(data.coefficient, data.u)}
    oracle = lambda c, dt, tid: torch.stack([table[x.numpy().tobytes()] for x in c])  # noqa: E731
    s = evaluate_task(TaskConfig(name="darcy2d", param=1.0), 2, torch.from_numpy(data.u), given_steps=0, dt=0.0,
                      predict_fields=oracle, coefficient_NCS=torch.from_numpy(data.coefficient))
    assert s["nrmse"] == 0 and s["one_step_nrmse"] == 0 and len(s["nrmse_per_step"]) == 1


# ------------------------------------------------------------------------------------ the command


def _tree(root: Path) -> dict:
    pdet = {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2, "group_size": 4}
    return {
        "data": {"root": str(root / "data"), "generate_if_missing": True, "tasks": [
            {"name": "advection1d", "param": 0.1, "samples": 20, "nx": 32, "nt": 11, "initial_step": 2},
            {"name": "burgers1d", "param": 0.01, "samples": 20, "nx": 32, "nt": 11, "reduce_t": 2},
            {"name": "darcy2d", "param": 1.0, "samples": 20, "nx": 16}]},
        "latent": {"tokens": 16, "dim": 8, "hidden": 16},
        "operator": {"pdet": pdet}, "diffusion": {"pdet": pdet, "noise_levels": 2}, "steady": {"pdet": pdet},
        "training": {"seed": 0, "num_workers": 0},
        "evaluation": {"plot_samples": 1, "time_rollout": False},  # no test here reads the timing
        "logging": {"run_dir": str(root / "runs"), "run_name": "ev", "progress": False,
                    "wandb": {"mode": "disabled"}},
    }


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    """Config, data and seeded untrained weights of every stage in the run folder."""
    from entry.config.load import load_config
    from entry.data.files import ensure_data
    from entry.storage.run_folder import run_dir_for
    from entry.models.build import build_autoencoder, build_denoiser, build_operator
    from entry.training.stage_record import weights_file

    root = tmp_path_factory.mktemp("eval_run")
    (root / "cfg.yaml").write_text(yaml.safe_dump(_tree(root)))
    cfg = load_config(root / "cfg.yaml")
    ensure_data(cfg)
    run_dir = run_dir_for(cfg)
    run_dir.mkdir(parents=True)
    torch.manual_seed(0)
    for stage, model in (("autoencoder", build_autoencoder(cfg)), ("operator", build_operator(cfg)),
                         ("diffusion", build_denoiser(cfg, cfg.diffusion.pdet)),
                         ("consistency", build_denoiser(cfg, cfg.diffusion.pdet)),
                         ("steady", build_denoiser(cfg, cfg.steady.pdet))):
        torch.save(model.state_dict(), weights_file(run_dir, stage))
    return root


def _evaluate(root: Path, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    env = tr.bare_env()
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    # --no-deps: the seeded weights in the run folder are what is evaluated (no stage made them).
    return subprocess.run([sys.executable, *launcher, "-m", "entry.evaluate", "--config", str(root / "cfg.yaml"),
                           "--no-deps", *args], cwd=root, env=env, capture_output=True, text=True, timeout=180)


def _copy_weights(root: Path, name: str, stages=("autoencoder", "operator", "diffusion", "consistency", "steady")):
    (root / "runs" / name).mkdir(exist_ok=True)
    for stage in stages:
        (root / "runs" / name / f"{stage}.pt").write_bytes((root / "runs" / "ev" / f"{stage}.pt").read_bytes())


SCORES = ("nrmse", "nrmse_pdebench2022", "one_step_nrmse", "rmse", "max_error", "crmse", "brmse",
          "frmse_low", "frmse_mid", "frmse_high")


def test_command_writes_finite_scores_and_plots(run_root):
    proc = _evaluate(run_root)
    assert proc.returncode == 0, proc.stderr
    run_dir = run_root / "runs" / "ev"
    tree = orjson.loads((run_dir / "eval.json").read_bytes())
    assert set(tree["tasks"]) == {"advection1d", "burgers1d", "darcy2d"}
    assert len(tree["config_hash"]) == 16 and tree["git_commit"] and not tree["small"]
    expect = {"advection1d": {"operator", "operator+diffusion", "operator+consistency"},
              "burgers1d": {"operator", "operator+diffusion", "operator+consistency"}, "darcy2d": {"steady"}}
    for task, variants in expect.items():
        entry = tree["tasks"][task]
        assert entry["n_test_samples"] == 2 and set(entry["variants"]) == variants
        for scores in entry["variants"].values():
            for k in SCORES:
                assert np.isfinite(scores[k]), (task, k)
            assert all(np.isfinite(scores["nrmse_per_step"]))
        assert set(entry["references"]) == ({"mean_solution"} if task == "darcy2d" else {"persistence", "training_mean"})
    # advection: 11 stored steps, 2 given -> 9 predictions; burgers: 6 steps after reduce_t=2, 1 given -> 5
    assert len(tree["tasks"]["advection1d"]["variants"]["operator"]["nrmse_per_step"]) == 9
    assert len(tree["tasks"]["burgers1d"]["variants"]["operator"]["nrmse_per_step"]) == 5
    plots = run_dir / "plots"
    for name in ("advection1d_operator_sample0.png", "advection1d_operator-diffusion_sample0.png",
                 "burgers1d_nrmse_vs_step.png", "advection1d_nrmse_vs_step.png", "darcy2d_steady_sample0.png"):
        assert (plots / name).stat().st_size > 1000, name
    assert "advection1d" in proc.stdout and "nrmse" in proc.stdout


def test_training_mean_reference_is_the_mean_of_the_first_training_trajectories_frames(run_root):
    """A time-dependent task's climatology: every stored frame of its first training trajectories
    (at most TRAINING_MEAN_TRAJECTORIES), whatever the state it is asked to step from."""
    from entry.config.load import load_config
    from entry.data.files import task_path, task_split
    from entry.evaluation.references import TRAINING_MEAN_TRAJECTORIES, reference_models

    cfg = load_config(run_root / "cfg.yaml")
    rows, _ = task_split(cfg, 0, "train")
    u = read_task(task_path(cfg, cfg.data.tasks[0])).u.astype(np.float64)  # [N, T, C, X]
    want = u[np.sort(rows[:TRAINING_MEAN_TRAJECTORIES])].mean(axis=(0, 1))
    step = reference_models(cfg, 0, False, "cpu")["training_mean"]
    got = step(torch.randn(3, *want.shape), torch.zeros(3), torch.zeros(3, dtype=torch.int64))
    assert got.shape == (3, *want.shape)
    np.testing.assert_allclose(got[2].numpy(), want, rtol=1e-5, atol=1e-6)


def test_two_ranks_with_an_empty_shard_match_one_process(run_root):
    """--small capped to 1 test sample: rank 1 scores nothing, yet joins every collective."""
    from entry.config.load import load_config
    from entry.distributed.process_group import DistInfo
    from entry.evaluation.scoring import evaluate_config

    sets = ["evaluation.max_test_samples=1", "evaluation.plot_samples=0"]
    _copy_weights(run_root, "dist")
    proc = _evaluate(run_root, "--small", *[a for kv in sets + ["logging.run_name=dist"] for a in ("--set", kv)],
                     nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _copy_weights(run_root, "single")
    cfg = load_config(run_root / "cfg.yaml", sets + ["logging.run_name=single"])
    trees = {"dist": orjson.loads((run_root / "runs" / "dist" / "eval_small.json").read_bytes()),
             "single": evaluate_config(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None, 0), small=True)}
    assert trees["dist"]["world_size"] == 2 and trees["dist"]["small"]
    for task, entry in trees["single"]["tasks"].items():
        assert entry["n_test_samples"] == 1
        for variant, scores in entry["variants"].items():
            other = trees["dist"]["tasks"][task]["variants"][variant]
            assert other["n_samples"] == 1
            for k in SCORES:  # rank 0 holds the sample with the same generator seed in both runs
                np.testing.assert_allclose(other[k], scores[k], rtol=1e-5, err_msg=f"{task} {variant} {k}")


def test_the_val_split_is_scored_apart_from_the_test_report(run_root):
    """evaluation.split=val scores the val trajectories (persistence as computed by hand on those
    rows) and writes eval_val.json: eval.json, the test report, is never overwritten by it."""
    from entry.config.load import load_config
    from entry.data.files import task_path, task_split
    from entry.distributed.process_group import DistInfo
    from entry.evaluation.scoring import evaluate_config

    _copy_weights(run_root, "val")
    cfg = load_config(run_root / "cfg.yaml", ["evaluation.split=val", "evaluation.plot_samples=0",
                                              "logging.run_name=val"])
    tree = evaluate_config(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None, 0))
    run_dir = run_root / "runs" / "val"
    assert (run_dir / "eval_val.json").is_file() and not (run_dir / "eval.json").exists()
    assert tree["split"] == "val"
    rows, _ = task_split(cfg, 0, "val")
    assert rows.size and not set(rows) & set(task_split(cfg, 0, "test")[0])
    u = read_task(task_path(cfg, cfg.data.tasks[0])).u[np.sort(rows)]
    per_step, _ = _persistence_hand(u, cfg.data.tasks[0].initial_step)
    entry = tree["tasks"]["advection1d"]
    assert entry["n_test_samples"] == rows.size
    np.testing.assert_allclose(entry["references"]["persistence"]["nrmse"], per_step.mean(), rtol=1e-5)


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record under capsys
def test_missing_weights_exit_2_naming_the_file(run_root, capsys):
    from entry.evaluate import main

    cfg = str(run_root / "cfg.yaml")
    assert main(["--config", cfg, "--no-deps", "--set", "logging.run_name=nothing"]) == 2
    assert "nothing/autoencoder.pt" in capsys.readouterr().err  # the first missing file is named
    _copy_weights(run_root, "no_operator", stages=("autoencoder", "steady"))
    assert main(["--config", cfg, "--no-deps", "--set", "logging.run_name=no_operator"]) == 2
    err = capsys.readouterr().err
    assert "no_operator/operator.pt" in err and "python -m entry.operator" in err, err
    assert not (run_root / "runs" / "no_operator" / "eval.json").exists()
