"""Resuming never runs code planted in a checkpoint folder (issue 29, bug 3): `rank<k>.pt`, DCP's
`.metadata` and the pickled values inside `*.distcp` are read with allow-lists, and a file that
holds anything else stops the stage with exit 2 naming it (no fallback to an older checkpoint)."""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from entry.training import checkpoint as ckpt
from entry.training.checkpoint_trust import RefusedPickle, load_metadata
from tests import tiny_run as tr
from tests.test_user_errors import tree_digest

NEWEST = Path("checkpoints") / "operator" / "step_00000006"


class _Plant:
    """Unpickled, it opens (creates) `marker` for writing: what a planted pickle could do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A prepared tiny run "base" with a finished operator stage (checkpoints at steps 3 and 6)."""
    return tr.finished_run(tmp_path_factory.mktemp("trust"))


def _copy(root: Path, name: str) -> Path:
    """A copy of the base run named `name` whose operator stage is to run again (it resumes)."""
    run = root / "runs" / name
    shutil.copytree(root / "runs" / "base", run)
    (run / "run.lock").unlink()
    (run / "operator.done.json").unlink()
    return run


def _resume(root: Path, name: str) -> int:
    from entry.operator import main

    return main(["--config", str(root / "tiny.yaml"), "--no-deps", "--set", f"logging.run_name={name}",
                 "--set", "operator.steps=6", "--set", "training.checkpoint_every=3"])


def _refusal(capfd, file: Path) -> str:
    """The one `checkpoint error` line, which names `file` and says why it was refused."""
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("checkpoint error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(file) in lines[0] and "holds objects a checkpoint may not contain" in lines[0], lines[0]
    return lines[0]


def _assert_refused(root: Path, name: str, file: Path, marker: Path, capfd) -> None:
    run = root / "runs" / name
    before = tree_digest(run)
    assert _resume(root, name) == 2
    assert not marker.exists()  # nothing the file names was called
    _refusal(capfd, file)
    assert tree_digest(run) == before  # no fallback to step 3: nothing was trained or written


@pytest.mark.timeout(120)
def test_a_planted_loop_state_is_refused_exit_2(root, tmp_path, capfd):
    run, marker = _copy(root, "planted_rank"), tmp_path / "marker"
    file = run / NEWEST / "rank0.pt"
    torch.save({ckpt.KEY_STEP: 6, "x": _Plant(marker)}, file)
    _assert_refused(root, "planted_rank", file, marker, capfd)


@pytest.mark.timeout(120)
def test_a_planted_dcp_metadata_is_refused_exit_2(root, tmp_path, capfd):
    run, marker = _copy(root, "planted_metadata"), tmp_path / "marker"
    file = run / NEWEST / ".metadata"
    file.write_bytes(pickle.dumps(_Plant(marker)))
    _assert_refused(root, "planted_metadata", file, marker, capfd)


@pytest.mark.timeout(120)
def test_a_planted_optimizer_value_in_distcp_is_refused_exit_2(root, tmp_path, capfd):
    """DCP stores non-tensor values (the optimizer's lr, betas...) as pickles inside `*.distcp`."""
    run, marker = _copy(root, "planted_value"), tmp_path / "marker"
    folder = run / NEWEST
    with open(folder / ".metadata", "rb") as f:
        metadata = load_metadata(f)
    index = next(i for i in metadata.storage_data if i.fqn == "optimizer.param_groups.0.lr")
    info = metadata.storage_data[index]
    planted = io.BytesIO()
    torch.save(_Plant(marker), planted)
    data = folder / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(planted.getvalue())
    info.offset, info.length = offset, len(planted.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _assert_refused(root, "planted_value", data, marker, capfd)


def test_refused_and_unreadable_files_are_told_apart(root, tmp_path):
    folder = tmp_path / "step_00000001"
    shutil.copytree(root / "runs" / "base" / NEWEST, folder)
    good = (folder / "rank0.pt").read_bytes()
    marker = tmp_path / "marker"
    cases = [(good[:100], ckpt.CheckpointError), (b"garbage" * 10, ckpt.CheckpointError),
             (pickle.dumps({ckpt.KEY_STEP: 1, "x": _Plant(marker)}), ckpt.UntrustedCheckpointError)]
    for content, error in cases:
        (folder / "rank0.pt").write_bytes(content)
        with pytest.raises(ckpt.CheckpointError) as caught:
            ckpt.read_loop_state(folder, 0)
        assert type(caught.value) is error and str(folder / "rank0.pt") in str(caught.value)
    assert not marker.exists()
    (folder / "rank0.pt").write_bytes(good)
    assert ckpt.read_loop_state(folder, 0)[ckpt.KEY_STEP] == 6  # plain values: weights_only loads it
    with open(folder / ".metadata", "rb") as f:
        assert load_metadata(f).state_dict_metadata  # a real checkpoint's metadata passes the allow-list
    with pytest.raises(RefusedPickle, match="builtins.eval"):
        load_metadata(io.BytesIO(pickle.dumps(eval)))
