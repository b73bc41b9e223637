"""entry.pipeline end to end on the quickstart config: a failing stage is loud and named, a
re-run continues where it stopped, every stage's loss falls, evaluation is written."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
import yaml

from tests import tiny_run as tr

pytestmark = [pytest.mark.slow]


def _launch(root, fault: str | None = None) -> subprocess.CompletedProcess:
    e = tr.env()
    if fault:
        e["US_INJECT_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "entry.pipeline", "--config", str(root / "quickstart.yaml")],
                          cwd=root, env=e, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run that fails in the diffusion stage, then the same command again without the fault."""
    root = tmp_path_factory.mktemp("pipeline")
    tree = yaml.safe_load((tr.ROOT / "configs" / "quickstart.yaml").read_text())
    tree["data"]["root"] = str(root / "data")
    tree["training"]["cache_dir"] = str(root / "cache")
    tree["logging"].update(run_dir=str(root / "runs"), progress=False)
    (root / "quickstart.yaml").write_text(yaml.safe_dump(tree))
    failed = _launch(root, fault="error@rank=0,step=60,stage=diffusion")
    again = _launch(root)
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


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_two_process_pipeline_runs_every_stage(tmp_path):
    """The README's main command, shortened: FSDP2 on 2 gloo ranks through every stage and evaluation."""
    tree = yaml.safe_load((tr.ROOT / "configs" / "quickstart.yaml").read_text())
    tree["data"]["root"] = str(tmp_path / "data")
    tree["training"]["cache_dir"] = str(tmp_path / "cache")
    tree["logging"].update(run_dir=str(tmp_path / "runs"), progress=False)
    for stage in ("operator", "diffusion", "consistency", "steady"):  # the codec is fitted, not trained
        tree[stage]["steps"] = 6
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(tree))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "entry.pipeline", "--config", str(tmp_path / "q.yaml")],
                          cwd=tmp_path, env=tr.env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = orjson.loads((tmp_path / "runs" / "quickstart" / "eval.json").read_bytes())
    assert report["world_size"] == 2
    for task in report["tasks"].values():
        for metrics in task["variants"].values():
            assert 0 <= metrics["nrmse"] < float("inf")
