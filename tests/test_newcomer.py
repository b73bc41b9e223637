"""What a new user meets first: a stage command on a clean checkout (wandb offline with it), its
`--no-deps` message, more processes than GPUs. The quickstart at an odd world size is
tests/test_pipeline_e2e.py's.

Each multi-process test has a timeout; configs are tiny (tests/tiny_run.py) or the quickstart with
its steps cut, so the file stays a couple of minutes on 2 cores.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
import yaml

from tests import tiny_run as tr


def _tiny_config(root: Path, **training) -> Path:
    tree = tr.tiny_tree(root)
    tree["latent"]["hidden"] = 0  # the exact codec: fitted, nothing to train
    tree["autoencoder"] = {"steps": 0}
    tree["training"].update(training)
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_stage_command_builds_what_it_needs_on_a_clean_checkout_and_rank_0_alone_logs_to_wandb(tmp_path):
    # The README's "every stage command runs on its own":
    # `torchrun --nproc_per_node=2 -m entry.operator --config CFG`, nothing prepared:
    # data, codec and cache are made first, as entry.pipeline would, then the operator trains.
    cfg = _tiny_config(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "entry.operator", "--config", str(cfg), "--set", "operator.steps=4", "--set", "logging.plots=true",
           "--set", "logging.wandb.mode=offline"]
    env = {**tr.env(), "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "base"
    for stage in ("autoencoder", "cache", "operator"):
        assert (run / f"{stage}.done.json").is_file(), stage
    assert (run / "operator.pt").is_file() and (run / "plots" / "operator_loss.png").is_file()
    # wandb offline: rank 0 alone writes each stage's run (the codec's and the operator's, the
    # second under torchrun at world size 2), in one group named for the run folder; the
    # operator's summary holds its last loss.
    runs = sorted((run / "wandb").glob("offline-run-*"))
    ids = {p.read_text().strip() for p in run.glob("wandb_run_id_*.txt")}
    assert {p.name.rsplit("-", 1)[-1] for p in runs} == ids  # one wandb run per stage, none from rank 1
    assert {p.name for p in run.glob("wandb_run_id_*.txt")} == {"wandb_run_id_autoencoder.txt",
                                                               "wandb_run_id_operator.txt"}
    metrics = [orjson.loads(x) for x in (run / "metrics.jsonl").read_bytes().splitlines()]
    last_loss = [m["loss"] for m in metrics if m["stage"] == "operator" and "loss" in m][-1]
    from tests.wandb_files import offline_run_facts

    facts = [offline_run_facts(p) for p in runs]
    assert {f["group"] for f in facts} == {"base"}
    operator = next(f for f in facts if f["job_type"] == "operator")
    assert operator["summary"]["operator/loss"] == pytest.approx(last_loss)
    # Run again: every input is complete, nothing is rebuilt.
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "building its inputs first" not in again.stderr


@pytest.mark.timeout(120)
def test_no_deps_names_the_command_that_makes_the_missing_input(tmp_path, capfd):
    from entry.operator import main

    cfg = _tiny_config(tmp_path)
    argv = ["--config", str(cfg), "--no-deps", "--set", "operator.steps=3"]
    assert main(argv) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: ")
    assert f"python -m entry.prepare_data --config {cfg} --set operator.steps=3" in err[0]
    assert not (tmp_path / "runs").exists()  # nothing written
    subprocess.run([sys.executable, "-m", "entry.prepare_data", "--config", str(cfg)], cwd=tmp_path, env=tr.env(),
                   check=True, capture_output=True, timeout=120)
    assert main(argv) == 2
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert f"python -m entry.autoencoder --config {cfg} --set operator.steps=3" in err


@pytest.mark.timeout(60)
def test_more_processes_than_gpus_stops_before_any_cuda_work(monkeypatch, capfd):
    from entry.distributed import process_group as distributed

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: calls.append(a))
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(distributed.ConfigError, match=r"--nproc_per_node=2.*1 GPU.*--nproc_per_node=1"):
        distributed.init_distributed()
    assert calls == []  # no device was touched
    from entry.operator import main

    assert main(["--config", str(tr.ROOT / "configs" / "quickstart.yaml")]) == 2
    assert "--nproc_per_node=1" in capfd.readouterr().err
