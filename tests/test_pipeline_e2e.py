"""entry.pipeline end to end on the quickstart config: a failing stage is loud and named, a
re-run (through the rented-machine bootstrap script) continues where it stopped, every stage's loss
falls, evaluation is written."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import orjson
import pytest
import yaml

from tests import tiny_run as tr
from tests.faults import fault_env

pytestmark = [pytest.mark.slow]


def _launch(root, fault: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "entry.pipeline", "--config", str(root / "quickstart.yaml")],
                          cwd=root, env=fault_env(tr.env(), fault), capture_output=True, text=True, timeout=900)


def _bootstrap(root) -> subprocess.CompletedProcess:
    """The rented-machine script (configs/launch/bootstrap.sh) with --skip-cuda-install on this CPU:
    doctor, data, pipeline under torchrun, the run folder archived under `root`/results."""
    script = tr.ROOT / "configs" / "launch" / "bootstrap.sh"
    return subprocess.run(["bash", str(script), "--skip-cuda-install", "--config", str(root / "quickstart.yaml"),
                           "--nproc", "1", "--results", str(root / "results")],
                          cwd=root, env=dict(tr.env(), PYTHON=sys.executable), capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run that fails in the diffusion stage, then the same config again without the fault, as the
    rented-machine bootstrap runs it: the script's end-to-end test, with no quickstart of its own."""
    root = tmp_path_factory.mktemp("pipeline")
    tree = yaml.safe_load((tr.ROOT / "configs" / "quickstart.yaml").read_text())
    tree["data"]["root"] = str(root / "data")
    tree["training"]["cache_dir"] = str(root / "cache")
    tree["logging"].update(run_dir=str(root / "runs"), progress=False, log_every=10)
    tree["training"]["checkpoint_every"] = 25  # the failed diffusion attempt leaves one to resume
    tree["data"]["tasks"] = [{**t, "samples": 64} for t in tree["data"]["tasks"]]
    # An ensemble and a plot, at half the cost; the rollout's timing is a record no test here reads.
    tree["evaluation"].update(ensemble_members=2, plot_samples=1, time_rollout=False)
    # The steady prior's loss halves within 30 steps. The refiners model the operator's residual:
    # with 60 operator steps consistency's last loss was 0.89 of its first, over the 0.8 asserted.
    for stage, steps in (("operator", 120), ("diffusion", 60), ("consistency", 30), ("steady", 30)):
        tree[stage]["steps"] = steps
    (root / "quickstart.yaml").write_text(yaml.safe_dump(tree))
    failed = _launch(root, fault="error@rank=0,step=40,stage=diffusion")
    again = _bootstrap(root)
    return root, failed, again


@pytest.mark.timeout(1800)
def test_failing_stage_is_named_and_never_reported_as_success(runs):
    root, failed, _ = runs
    out = failed.stdout + failed.stderr
    assert failed.returncode != 0
    assert "pipeline FAILED in stage diffusion" in out
    assert "rank0.log" in out
    assert "pipeline completed" not in out


@pytest.mark.timeout(1800)
def test_rerun_skips_completed_stages_and_finishes(runs):
    root, _, again = runs
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    for stage in ("autoencoder", "cache", "operator"):
        assert f"stage {stage}: complete for config hash" in out
    assert "diffusion: resumed from" in out  # continues from the failed attempt's checkpoint
    assert "pipeline completed" in out


@pytest.mark.timeout(1800)
def test_the_bootstrap_script_archives_the_run_with_wandb_offline(runs):
    """Its last line says the pipeline completed; the archive holds the run folder without its
    checkpoints, wandb's offline files among them."""
    root, _, again = runs
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert again.stdout.strip().splitlines()[-1].endswith("pipeline completed"), again.stdout[-2000:]
    (archive,) = (root / "results").glob("quickstart-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert "quickstart/eval.json" in names
    assert any(n.startswith("quickstart/wandb/offline-run-") for n in names)
    assert not any("/checkpoints/" in n for n in names)


@pytest.mark.timeout(1800)
def test_eval_json_has_finite_metrics_and_plots(runs):
    root, _, again = runs
    assert again.returncode == 0
    run_dir = root / "runs" / "quickstart"
    report = orjson.loads((run_dir / "eval.json").read_bytes())
    tasks = report["tasks"]
    for task in ("advection1d", "burgers1d", "darcy2d"):
        entry = next(v for k, v in tasks.items() if task in k)
        for variant, metrics in entry["variants"].items():
            assert metrics["nrmse"] == metrics["nrmse"] and metrics["nrmse"] < float("inf"), (task, variant)
    assert list((run_dir / "plots").glob("*.png"))


@pytest.mark.timeout(1800)
def test_every_stage_loss_falls(runs):
    root, _, again = runs
    assert again.returncode == 0
    lines = [orjson.loads(x) for x in (root / "runs" / "quickstart" / "metrics.jsonl").read_bytes().splitlines()]
    trained = [s for s in ("autoencoder", "operator", "diffusion", "consistency", "steady")
               if yaml.safe_load((root / "quickstart.yaml").read_text())[s]["steps"] > 0]
    assert {"operator", "diffusion", "consistency", "steady"} <= set(trained)
    for stage in trained:
        by_step = {rec["step"]: rec["loss"] for rec in lines if rec["stage"] == stage and "loss" in rec}
        steps = sorted(by_step)
        k = max(1, len(steps) // 5)
        first = sum(by_step[s] for s in steps[:k]) / k
        last = sum(by_step[s] for s in steps[-k:]) / k
        assert last < 0.8 * first, (stage, first, last)


def _short_quickstart(root, **training) -> Path:
    tree = yaml.safe_load((tr.ROOT / "configs" / "quickstart.yaml").read_text())
    tree["data"]["root"] = str(root / "data")
    tree["data"]["tasks"] = [{**t, "samples": 48} for t in tree["data"]["tasks"]]
    tree["training"].update(cache_dir=str(root / "cache"), **training)
    # The ensembles' split over ranks, at half the rollouts of 4 of the 11 steps (the module's fixture
    # rolls out the whole trajectory); the training curves are plotted, the samples not (the fixture
    # plots them).
    tree["evaluation"].update(ensemble_members=2, plot_samples=0, time_rollout=False, rollout_steps=4)
    tree["logging"].update(run_dir=str(root / "runs"), progress=True)  # a bar only where there is a terminal
    for stage in ("operator", "diffusion", "consistency", "steady"):  # the codec is fitted, not trained
        tree[stage]["steps"] = 6
    (root / "q.yaml").write_text(yaml.safe_dump(tree))
    return root / "q.yaml"


def _torchrun(root, cfg: Path, nproc: int, module: str = "entry.pipeline", *extra: str):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           "-m", module, "--config", str(cfg), *extra],
                          cwd=root, env=tr.env(), capture_output=True, text=True, timeout=800)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_two_process_pipeline_runs_every_stage(tmp_path):
    """The README's main command, shortened, with FSDP2 on 2 gloo ranks through every stage; its output
    is a log (no progress bars off a terminal), every trained stage leaves a loss curve, and the
    evaluation does not depend on the world size."""
    cfg = _short_quickstart(tmp_path, parallel="fsdp")
    proc = _torchrun(tmp_path, cfg, 2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "\r" not in proc.stdout + proc.stderr
    run = tmp_path / "runs" / "quickstart"
    assert "\r" not in (run / "rank0.log").read_text()
    for stage in ("operator", "diffusion", "consistency", "steady"):
        assert (run / "plots" / f"{stage}_loss.png").stat().st_size > 1000, stage
    two = orjson.loads((run / "eval.json").read_bytes())
    assert two["world_size"] == 2
    for task in two["tasks"].values():
        for metrics in task["variants"].values():
            assert 0 <= metrics["nrmse"] < float("inf")
    # The same weights evaluated by one process: the refiners' noise belongs to the test samples,
    # not to the ranks, so every score agrees up to the order of the sums.
    one_proc = subprocess.run([sys.executable, "-m", "entry.evaluate", "--config", str(cfg), "--no-deps"],
                              cwd=tmp_path, env=tr.env(), capture_output=True, text=True, timeout=300)
    assert one_proc.returncode == 0, one_proc.stderr[-3000:]
    one = orjson.loads((run / "eval.json").read_bytes())
    assert one["world_size"] == 1
    for key, task in two["tasks"].items():
        for group in ("codec", "references", "variants"):
            a, b = task[group], one["tasks"][key][group]
            flat = (lambda d: {k: v for k, v in d.items() if isinstance(v, float)}) if group == "codec" else None
            pairs = [(flat(a), flat(b))] if flat else [(a[m], b[m]) for m in a]
            for x, y in pairs:
                for metric, value in x.items():
                    # rollout_step_ms is a record of this machine's speed, not a score
                    if isinstance(value, float) and metric != "rollout_step_ms":
                        assert value == pytest.approx(y[metric], rel=1e-6, abs=1e-12), (key, group, metric)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_quickstart_runs_at_world_size_3(tmp_path):
    # Its global batches (48, 24) split over 3 (and 4) ranks; the codec has no batches to split.
    # The refiners' batches split by the operator's code (the 2-process test runs them).
    proc = _torchrun(tmp_path, _short_quickstart(tmp_path), 3, "entry.pipeline", "--set", tr.WITHOUT_REFINERS)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "pipeline completed" in proc.stderr
    assert orjson.loads((tmp_path / "runs" / "quickstart" / "eval.json").read_bytes())["world_size"] == 3
