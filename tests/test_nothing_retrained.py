"""A complete run is not retrained for nothing (issue 29, bugs 1 and 2): re-exporting the same
weights, a lost done file, run-control settings and identical copies of the data or the cache
leave every stage complete, while a change of the math still retrains what depends on it."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from entry.storage.weights_fingerprint import weights_fingerprint
from tests import tiny_run as tr

pytestmark = [pytest.mark.slow]

STAGES = ["autoencoder", "cache", "operator", "diffusion"]


def _pipeline(root, capfd, *sets: str) -> dict[str, str]:
    """Run entry.pipeline in this process; returns each stage's line: "skipped" or why it ran."""
    from entry.pipeline import main

    capfd.readouterr()
    args = ["--config", str(root / "pipe.yaml")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    err = capfd.readouterr().err
    status = {}
    for stage in STAGES:
        if f"stage {stage}: complete for config hash" in err:
            status[stage] = "skipped"
        else:
            ran = re.search(rf"stage {stage}: runs because (.*)", err)
            assert ran, err[-3000:]
            status[stage] = ran.group(1)
    return status


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A complete tiny pipeline: autoencoder, cache, operator (4 steps), diffusion (2 steps)."""
    root = tmp_path_factory.mktemp("retrain")
    tree = tr.tiny_tree(root)
    tree["stages"] = STAGES
    tree["operator"]["steps"] = 4
    tree["training"]["checkpoint_every"] = 2
    tree["diffusion"] = {"steps": 2, "batch_size": 8, "noise_levels": 2,
                         "pdet": {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2, "group_size": 2}}
    (root / "pipe.yaml").write_text(yaml.safe_dump(tree))
    from entry.pipeline import main

    assert main(["--config", str(root / "pipe.yaml")]) == 0
    return root


def _set_aside(root) -> list:
    return sorted(p.name for p in (root / "runs" / "base" / "checkpoints").glob("*.stale-*"))


@pytest.mark.timeout(300)
def test_the_same_weights_exported_again_retrain_nothing(root, capfd):
    from entry.operator import main as operator_main

    run = root / "runs" / "base"
    before = weights_fingerprint(run / "operator.pt")
    # The outside campaign's case: the operator command on a complete run resumes its last
    # checkpoint and exports the same tensors again, into a new file.
    inode = (run / "operator.pt").stat().st_ino
    assert operator_main(["--config", str(root / "pipe.yaml")]) == 0
    assert (run / "operator.pt").stat().st_ino != inode and weights_fingerprint(run / "operator.pt") == before
    assert _pipeline(root, capfd) == dict.fromkeys(STAGES, "skipped")
    # A done file cut short: the operator runs again (it resumes at its last step), nothing after it.
    done = run / "operator.done.json"
    done.write_bytes(done.read_bytes()[:25])
    status = _pipeline(root, capfd)
    assert status["operator"].startswith("its done file is unreadable")
    assert status["diffusion"] == "skipped" and status["cache"] == "skipped"
    assert weights_fingerprint(run / "operator.pt") == before
    assert _set_aside(root) == []


@pytest.mark.timeout(300)
def test_run_control_and_moved_copies_retrain_nothing(root, capfd):
    run_control = ["training.num_workers=2", "training.checkpoint_every=7", "training.timeout_s=99",
                   "training.keep_checkpoints=5", "training.prefetch_factor=3", "evaluation.plot_samples=0"]
    assert _pipeline(root, capfd, *run_control) == dict.fromkeys(STAGES, "skipped")
    shutil.copytree(root / "data", root / "data_copy")
    shutil.copytree(root / "cache", root / "cache_copy")
    moved = [f"data.root={root / 'data_copy'}", f"training.cache_dir={root / 'cache_copy'}"]
    assert _pipeline(root, capfd, *moved) == dict.fromkeys(STAGES, "skipped")
    assert _set_aside(root) == []


@pytest.mark.timeout(300)
def test_a_change_of_the_math_still_retrains_what_depends_on_it(root, capfd):
    status = _pipeline(root, capfd, "diffusion.lr=3e-3")
    assert [s for s in STAGES if status[s] != "skipped"] == ["diffusion"]
    assert status["diffusion"].startswith("its config sections changed")
