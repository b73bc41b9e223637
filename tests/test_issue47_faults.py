"""The outside campaign's findings on the commands (issue 47): each reproduced as reported, then
held fixed. Every subprocess has a timeout."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest
import yaml

from tests import tiny_run as tr

BURGERS = "1D_Burgers_Sols_Nu0.01.hdf5"


def _burgers_config(root, samples: int = 8):
    """A tiny config of one generated Burgers task under `root` (data in `root/data`); returns its path."""
    tree = tr.tiny_tree(root)
    tree["data"]["tasks"] = [{"name": "burgers1d", "param": 0.01, "samples": samples, "nx": 32, "nt": 5}]
    cfg = root / "burgers.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    return cfg


# --- bug 4: prepare_data under torchrun generates each file once ------------------------------

@pytest.mark.timeout(240)
def test_prepare_data_under_two_process_torchrun_generates_the_file_once(tmp_path):
    from pipelines.generate import generate_task

    cfg = _burgers_config(tmp_path, samples=12)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "entry.prepare_data", "--config", str(cfg)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=tr.env(), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "is being written by" not in proc.stderr
    data = tmp_path / "data"
    assert proc.stdout.count(BURGERS) == 1  # rank 0 reports, once
    # Nothing left beside the file but its cached facts: no part, temporary or lock.
    assert sorted(p.name for p in data.iterdir() if not p.name.endswith(".facts.json")) == [BURGERS]
    # The same samples a single process writes.
    alone = generate_task("burgers1d", 12, tmp_path / "alone", nx=32, nt=5, seed=0, param=0.01)
    with h5py.File(data / BURGERS, "r") as got, h5py.File(alone, "r") as want:
        np.testing.assert_allclose(got["tensor"][:], want["tensor"][:], rtol=1e-6, atol=1e-7)
