"""Done files record what a stage read, are written atomically, and a truncated one counts as
absent: the pipeline retrains what depends on a changed data file (issue 17, items 5 and 7)."""

from __future__ import annotations

import subprocess
import sys

import h5py
import orjson
import pytest
import yaml

from entry.config.load import load_config
from entry.training.stage_record import stage_done_file, stage_inputs, stage_status, write_done
from tests import tiny_run as tr

STAGES = ["autoencoder", "cache", "operator"]


def _pipeline(root) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "entry.pipeline", "--config", str(root / "pipe.yaml")], cwd=root,
                          env=tr.env(), capture_output=True, text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_changed_data_file_retrains_what_depends_on_it(tmp_path):
    tree = tr.tiny_tree(tmp_path)
    tree["stages"] = STAGES
    tree["operator"]["steps"] = 4
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(tree))
    first = _pipeline(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    cfg = load_config(tmp_path / "pipe.yaml")
    run = tmp_path / "runs" / "base"
    assert not (run / "plots").exists()  # logging.plots: false (the tiny tree's): no training curve either
    old = {s: orjson.loads(stage_done_file(run, s).read_bytes()) for s in STAGES}
    data_key, = old["operator"]["inputs"]["data"]
    # A crash while an older version wrote a done file, and the data regenerated in place.
    done = stage_done_file(run, "operator")
    done.write_bytes(done.read_bytes()[:25])
    with h5py.File(tmp_path / "data" / "1D_Advection_Sols_beta0.1.hdf5", "r+") as f:
        f["tensor"][0] = f["tensor"][0] * 1.5
    second = _pipeline(tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    log = second.stderr
    assert f"stage operator: runs because its done file is unreadable ({done}" in log
    assert "stage autoencoder: runs because its inputs changed since it ran (data " + data_key in log
    for stage in ("cache", "operator"):
        assert f"stage {stage}: runs because" in log
    assert "skipped" not in log
    new = {s: orjson.loads(stage_done_file(run, s).read_bytes()) for s in STAGES}
    assert new == {s: {**new[s], "inputs": stage_inputs(cfg, run, s)} for s in STAGES}
    assert new["autoencoder"]["inputs"]["data"][data_key] != old["autoencoder"]["inputs"]["data"][data_key]
    # Retrained from scratch: the old checkpoints were trained on the old data.
    assert list((run / "checkpoints").glob("autoencoder.stale-*"))


def test_a_truncated_or_foreign_done_file_is_not_complete(tmp_path):
    cfg = load_config(tree=tr.tiny_tree(tmp_path))
    run = tmp_path / "runs" / "base"
    run.mkdir(parents=True)
    assert stage_status(run, "autoencoder", cfg) == (False, "it has not completed")
    write_done(run, "autoencoder", cfg, stage_inputs(cfg, run, "autoencoder"))
    assert stage_status(run, "autoencoder", cfg) == (True, "complete")
    assert not list(run.glob(".*.part"))  # the atomic write left no temporary file
    path = stage_done_file(run, "autoencoder")
    path.write_bytes(path.read_bytes()[:10])
    complete, why = stage_status(run, "autoencoder", cfg)
    assert not complete and str(path) in why and "unreadable" in why
    write_done(run, "autoencoder", cfg, {"data": {}, "weights": {}})  # what an older version recorded
    complete, why = stage_status(run, "autoencoder", cfg)
    assert not complete and "inputs changed" in why
