"""`python -m bench.data_throughput` end to end on a tiny generated config (no timing asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from tests import tiny_run as tr

ROOT = Path(__file__).resolve().parents[1]

TINY = """
data:
  root: {root}
  generate_if_missing: true
  tasks:
    - {{name: advection1d, param: 0.1, samples: 12, nx: 16, nt: 6}}
    - {{name: burgers1d, param: 0.01, samples: 12, nx: 16, nt: 6, reduce_x: 2}}
    - {{name: darcy2d, param: 1.0, samples: 4, nx: 8}}
latent: {{tokens: 4, dim: 4, hidden: 8}}
operator: {{batch_size: 4}}
training: {{num_workers: 0, prefetch_factor: 1}}
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_command_writes_well_formed_json(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY.format(root=tmp_path / "elsewhere"))
    out = tmp_path / "results"
    env = tr.env()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.data_throughput", "--config", str(cfg),
         "--set", f"data.root={tmp_path / 'data'}", "--set", "operator.batch_size=3",
         "--workers", "0,2", "--batches", "4", "--warmup", "1", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "data").is_dir() and not (tmp_path / "elsewhere").exists()  # --set applied
    files = list(out.glob("*-data_throughput.json"))
    assert len(files) == 1
    name = files[0].name
    report = orjson.loads(files[0].read_bytes())
    assert name == f"{report['device']}-{report['date']}-data_throughput.json"
    for key in ("config_hash", "git_commit", "dirty", "processor", "encoder", "tasks", "cache", "speedup_cached_over_field"):
        assert key in report
    assert len(report["config_hash"]) == 16
    assert report["batch_size"] == 3
    assert report["tasks"] == ["0:advection1d:0.1", "1:burgers1d:0.01"]  # Darcy is steady: not paired
    for pipeline in ("cached_latent", "field_on_the_fly"):
        rows = report[pipeline]
        assert [r["num_workers"] for r in rows] == [0, 2]
        for r in rows:
            assert r["batches"] == 4
            for key in ("seconds", "batches_per_s", "gb_per_s", "mb_per_batch"):
                assert r[key] > 0
    assert report["speedup_cached_over_field"] > 0
    assert "cached_latent" in proc.stdout and str(files[0]) in proc.stdout


def test_bad_workers_is_a_user_error(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY.format(root=tmp_path / "data"))
    from bench.data_throughput import main

    assert main(["--config", str(cfg), "--workers", "a,b", "--out", str(tmp_path)]) == 2
