"""Golden loss: 20 steps of the quickstart operator at a fixed seed in deterministic mode.

World size 1 must reproduce `tests/golden/quickstart_operator_loss.json` exactly on CPU;
world size 2 (FSDP2, gloo) within 1e-5 relative. The encoder is seeded, not trained, so
the file depends only on our solvers, models and loop. Regenerate it (after a change that
is meant to alter the numbers, and say so in the commit) with
    UPDATE_GOLDEN=1 python -m pytest tests/test_golden_loss.py
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
import yaml

from tests import tiny_run as tr

GOLDEN = Path(__file__).parent / "golden" / "quickstart_operator_loss.json"
STEPS = 20
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    from entry.cache import build_cache
    from entry.config import load_config
    from entry.data import ensure_data
    from entry.distributed import DistInfo
    from entry.models import build_autoencoder
    from entry.run_files import run_dir_for
    from entry.runner import weights_file

    root = tmp_path_factory.mktemp("golden")
    tree = yaml.safe_load((tr.ROOT / "configs" / "quickstart.yaml").read_text())
    tree["data"]["root"] = str(root / "data")
    tree["training"].update(cache_dir=str(root / "cache"), deterministic=True, num_workers=0)
    tree["logging"].update(run_dir=str(root / "runs"), log_every=1, progress=False)
    tree["operator"]["steps"] = STEPS
    cfg_path = root / "quickstart.yaml"
    cfg_path.write_text(yaml.safe_dump(tree))
    cfg = load_config(cfg_path)
    ensure_data(cfg)
    torch.manual_seed(0)
    weights = weights_file(run_dir_for(cfg), "autoencoder")
    weights.parent.mkdir(parents=True)
    torch.save(build_autoencoder(cfg).state_dict(), weights)
    build_cache(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None, 0), logging.getLogger("golden"), "dynamic", "train")
    return root, cfg_path


def _run(root: Path, cfg_path: Path, name: str, nproc: int) -> list[float]:
    src = root / "runs" / "quickstart" / "autoencoder.pt"
    (root / "runs" / name).mkdir(parents=True, exist_ok=True)
    (root / "runs" / name / "autoencoder.pt").write_bytes(src.read_bytes())
    base = ["-m", "entry.operator", "--config", str(cfg_path), "--set", f"logging.run_name={name}"]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *base]
           if nproc > 1 else [sys.executable, *base])
    proc = subprocess.run(cmd, cwd=root, env=tr.env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [orjson.loads(x) for x in (root / "runs" / name / "metrics.jsonl").read_bytes().splitlines()]
    return [x["loss"] for x in lines if x["stage"] == "operator"]


@pytest.mark.timeout(600)
def test_world_size_1_reproduces_golden_exactly(quickstart):
    losses = _run(*quickstart, "golden1", 1)
    assert len(losses) == STEPS
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_bytes(orjson.dumps({"steps": STEPS, "loss": losses}, option=orjson.OPT_INDENT_2))
    assert orjson.loads(GOLDEN.read_bytes())["loss"] == losses


@pytest.mark.timeout(600)
def test_world_size_2_matches_golden(quickstart):
    losses = _run(*quickstart, "golden2", 2)
    golden = orjson.loads(GOLDEN.read_bytes())["loss"]
    assert len(losses) == len(golden)
    for got, want in zip(losses, golden):
        assert abs(got - want) <= 1e-5 * abs(want)
