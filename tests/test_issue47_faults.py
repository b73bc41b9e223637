"""The outside campaign's findings on the commands (issue 47): each reproduced as reported, then
held fixed. Every subprocess has a timeout."""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
import yaml

from tests import tiny_run as tr
from tests.test_user_errors import _one_line_error

BURGERS = "1D_Burgers_Sols_Nu0.01.hdf5"


def _burgers_config(root, samples: int = 12):
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


# --- weak point 5: a full disk during export leaves the old weights with their description ----

def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _pair(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("fails", ["weights", "description"])
def test_a_full_disk_during_export_keeps_the_old_weights_and_their_description(tmp_path, monkeypatch, fails):
    from core.models.registry import build
    from entry.distributed.process_group import DistInfo
    from entry.models.files import description_file, read_description
    from entry.training import checkpoint as ckpt

    info = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)
    args = dict(in_channels=2, out_channels=1, init_features=4)
    torch.manual_seed(0)
    old = ckpt.export_weights(build("peer", "unet1d", **args), tmp_path / "operator.pt", info)
    before = _pair(tmp_path)
    assert sorted(before) == ["operator.model.json", "operator.pt"]
    newer = build("peer", "unet1d", **dict(args, init_features=8))  # other weights, another description
    if fails == "weights":
        monkeypatch.setattr(ckpt, "_save_synced", lambda obj, path: (path.write_bytes(b"half"), _enospc()))
    else:
        real = pathlib.Path.write_bytes
        monkeypatch.setattr(pathlib.Path, "write_bytes",
                            lambda self, data: _enospc() if ".model.json" in self.name else real(self, data))
    with pytest.raises(OSError) as err:
        ckpt.export_weights(newer, old, info)
    assert err.value.errno == errno.ENOSPC and "no space left" in str(err.value)
    assert _pair(tmp_path) == before  # the old pair, byte for byte, and no temporary file
    monkeypatch.undo()
    ckpt.export_weights(newer, old, info)  # space freed: the new pair replaces the old
    assert read_description(old)["args"]["init_features"] == 8 and description_file(old).is_file()
    newer.load_state_dict(torch.load(old, weights_only=True))


# --- weak point 6: one line, exit 2 and nothing written, where a traceback was ----------------

def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("setting,names", [
    ("logging.run_name=" + "r" * 300, ["run_name is 300 bytes", "longer than the 255"]),
    ("training.cache_dir=/proc/no-such-folder/cache", ["training.cache_dir", "/proc/no-such-folder/cache",
                                                       "not writable"]),
])
def test_an_impossible_run_name_or_cache_folder_is_one_line_before_anything_is_written(tmp_path, capfd, setting,
                                                                                        names):
    from entry.pipeline import main

    cfg = _burgers_config(tmp_path)  # its data are missing and would be generated
    before = _files(tmp_path)
    assert main(["--config", str(cfg), "--set", setting]) == 2
    _one_line_error(capfd, "config error", *names)
    assert _files(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["burgers.yaml"]


# --- weak point 1: a data file replaced during a run is caught before completion or scoring -----

def _replace_with_other_samples(cfg_path: pathlib.Path) -> None:
    """Replace the config's Burgers file (atomically, as an operator's `cp` + `mv` would) by one of
    other samples: another seed, not recorded in the file (one brought from elsewhere; a file that records
    another seed than the config's is refused before any stage, tests/test_task_seed.py)."""
    from pipelines.generate import generate_task

    other = generate_task("burgers1d", 12, cfg_path.parent / "other", nx=32, nt=5, seed=7, param=0.01)
    with h5py.File(other, "a") as f:
        del f.attrs["seed"]
    os.replace(other, cfg_path.parent / "data" / BURGERS)


def test_a_data_file_replaced_while_a_stage_trains_leaves_it_incomplete_and_unscored(tmp_path, capfd):
    from entry.distributed import hooks
    from entry.pipeline import main

    cfg = _burgers_config(tmp_path)

    class ReplaceAtStep3(hooks.Listener):
        def before_step(self, stage, rank, step, attempt):
            if stage == "operator" and step == 3:
                _replace_with_other_samples(cfg)

    stages = "stages=[autoencoder,cache,operator,evaluate]"
    with hooks.listening(ReplaceAtStep3()):
        assert main(["--config", str(cfg), "--set", stages]) == 2
    _one_line_error(capfd, "data error", BURGERS, "changed since stage operator started")
    run = tmp_path / "runs" / "base"
    assert (run / "autoencoder.done.json").is_file()  # before the change: complete
    assert not (run / "operator.done.json").exists() and not (run / "eval.json").exists()
    # Run again on the data as they are now: the stages that read the old file train again.
    assert main(["--config", str(cfg), "--set", stages]) == 0
    assert (run / "operator.done.json").is_file() and (run / "eval.json").is_file()


def test_a_run_is_not_scored_on_data_its_models_were_not_trained_on(tmp_path, capfd):
    from entry.evaluate import main as evaluate
    from entry.pipeline import main

    cfg = _burgers_config(tmp_path)
    assert main(["--config", str(cfg), "--set", "stages=[autoencoder,cache,operator]"]) == 0
    _replace_with_other_samples(cfg)
    capfd.readouterr()
    assert evaluate(["--config", str(cfg), "--no-deps", "--set", "stages=[autoencoder,cache,operator,evaluate]"]) == 2
    _one_line_error(capfd, "data error", BURGERS, "was trained on it")
    assert not (tmp_path / "runs" / "base" / "eval.json").exists()


# --- weak point 4: unbounded work refused or bounded ------------------------------------------

@pytest.mark.timeout(60)
def test_a_double_star_glob_over_a_folder_linking_to_itself_ends(tmp_path):
    from pipelines.layouts import expand_path

    folder = tmp_path / "well"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "a.hdf5").write_bytes(b"")
    (folder / ".hidden.hdf5").write_bytes(b"")  # as glob: a wildcard does not match a hidden name
    for name in ("again", "and_again"):
        (folder / name).symlink_to(folder, target_is_directory=True)
    # In a child with a timeout: before the fix glob.glob walked again/and_again/again/... without end.
    code = f"from pipelines.layouts import expand_path; print(expand_path({str(folder / '**' / '*.hdf5')!r}))"
    proc = subprocess.run([sys.executable, "-c", code], env=tr.env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert expand_path(folder / "**" / "*.hdf5") == [folder / "train" / "a.hdf5"]
    assert expand_path(folder / "*" / "a.hdf5") == [folder / "train" / "a.hdf5"]
    # A link the pattern names is followed, as before.
    assert expand_path(folder / "again" / "train" / "*.hdf5") == [folder / "again" / "train" / "a.hdf5"]


def test_a_million_member_ensemble_is_refused_at_once(tmp_path, capfd):
    from entry.evaluate import main

    cfg = _burgers_config(tmp_path)
    assert main(["--config", str(cfg), "--set", "evaluation.ensemble_members=1000000"]) == 2
    _one_line_error(capfd, "config error", "ensemble_members must be at most 1024", "1000000")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["burgers.yaml"]


def test_an_ensemble_is_estimated_and_one_that_does_not_fit_is_refused_before_training(tmp_path, capfd,
                                                                                      monkeypatch):
    from entry.config.load import load_config
    from entry.data.files import ensure_data
    from entry.evaluation import task_frames
    from entry.pipeline import main

    cfg = _burgers_config(tmp_path)
    ensure_data(load_config(cfg))
    # 1 test trajectory (the first 10% of 12) of 5 steps x 32 points: 2 x K x 160 float32 per batch.
    monkeypatch.setattr(task_frames, "available_memory", lambda: 2 * 2 * 1000 * 160 * 4)  # K = 1000 fits, just
    lines = []
    task_frames.require_scored_rows(load_config(cfg, ["evaluation.ensemble_members=1000"]), 0, lines.append)
    assert lines == ["evaluate: ensemble of 1000 members on burgers1d: 1000 rollouts per stochastic variant, "
                     "0.00119 GiB of predictions held per batch of 16"]
    assert main(["--config", str(cfg), "--set", "evaluation.ensemble_members=1001"]) == 2
    _one_line_error(capfd, "config error", "evaluation.ensemble_members=1001", "ensemble_members=1000")
    assert not list((tmp_path / "runs").rglob("*.*")) and not (tmp_path / "cache").exists()  # nothing trained


# --- weak point 8: a user error before anything is written leaves the run folder as it was ------

@pytest.mark.timeout(300)
def test_a_full_disk_cache_error_leaves_the_run_folder_and_its_log_byte_identical(tmp_path, capfd, monkeypatch):
    from entry.cache import main

    tr.prepare(tmp_path)
    run = tmp_path / "runs" / "base"
    (run / "rank0.log").write_text("an earlier command's lines\n")
    before = _files(run)
    monkeypatch.setattr(os, "posix_fallocate", _enospc)
    capfd.readouterr()
    args = ["--config", str(tmp_path / "tiny.yaml"), "--no-deps", "--set", f"training.cache_dir={tmp_path / 'new'}"]
    assert main(args) == 2
    _one_line_error(capfd, "cache error", "no space for the latent cache")
    assert _files(run) == before


# --- weak point 3: a rerun removes what a killed The Well writer left -------------------------

def test_a_rerun_of_generate_the_well_removes_a_killed_writers_temporary_file(tmp_path):
    from pipelines.generate import main

    args = ["--task", "burgers1d", "--samples", "10", "--nx", "32", "--nt", "5", "--nu", "0.01",
            "--out", str(tmp_path), "--layout", "the_well", "--device", "cpu", "--no-progress"]
    assert main(args) == 0
    train = tmp_path / "burgers1d" / "data" / "train"
    (written,) = train.glob("*.hdf5")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=60)
    dead_pid = int(gone.stdout)  # a process that has exited: its writer was killed
    dead = train / f".{written.name}.{dead_pid}-0123abcd.tmp"
    live = train / f".{written.name}.{os.getpid()}-0123abcd.tmp"  # a writer still running
    other = train / f".{written.name}.{dead_pid}-notours.tmp"  # not the writer's exact pattern
    for f in (dead, live, other):
        f.write_bytes(b"x" * 4096)
    assert main(args) == 0
    assert not dead.exists() and live.exists() and other.exists() and written.is_file()


# --- weak point 2: planted checkpoint metadata cannot make a resume allocate without bound ------

class _Alloc:
    """Unpickled, it calls `bytes(n)`: n zero bytes, from a pickle of a few dozen."""

    def __init__(self, n: int):
        self.n = n

    def __reduce__(self):
        return bytes, (self.n,)


def _small_checkpoint(folder: pathlib.Path) -> dict:
    """A DCP checkpoint of one tensor and one non-tensor value in `folder`; returns a state to load into."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0), "lr": 0.5}, checkpoint_id=str(folder))
    return {"w": torch.zeros(6), "lr": 0.0}


def _planted_reads(folder: pathlib.Path, **change) -> None:
    """Rewrite the checkpoint's metadata so every read it declares has the fields in `change`."""
    import dataclasses
    import pickle

    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.storage_data = {k: dataclasses.replace(v, **change) for k, v in metadata.storage_data.items()}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.timeout(60)
def test_planted_checkpoint_metadata_cannot_exhaust_memory(tmp_path):
    import io
    import pickle

    from entry.training.checkpoint_trust import RefusedPickle, load_dcp, load_metadata

    with pytest.raises(RefusedPickle, match=r"builtins.bytes\(1099511627776\)"):
        load_metadata(io.BytesIO(pickle.dumps(_Alloc(1 << 40))))  # 1 TiB, refused before it is made
    good = tmp_path / "good"
    state = _small_checkpoint(good)
    load_dcp(state, good)
    assert torch.equal(state["w"], torch.arange(6.0)) and state["lr"] == 0.5
    for name, change, why in [
        ("zero", {"relative_path": "zero.distcp", "offset": 0, "length": 1 << 40}, "not a regular file"),
        ("outside", {"relative_path": "../good/" + next(good.glob("*.distcp")).name}, "outside the checkpoint"),
    ]:
        folder = tmp_path / name
        state = _small_checkpoint(folder)
        (folder / "zero.distcp").symlink_to("/dev/zero")
        _planted_reads(folder, **change)
        with pytest.raises(RefusedPickle, match=why):
            load_dcp(state, folder)
    metadata_is_zero = tmp_path / "metadata_is_zero"
    state = _small_checkpoint(metadata_is_zero)
    (metadata_is_zero / ".metadata").unlink()
    (metadata_is_zero / ".metadata").symlink_to("/dev/zero")
    with pytest.raises(RefusedPickle, match="not a regular file"):
        load_dcp(state, metadata_is_zero)


def test_a_truncated_checkpoint_file_is_unreadable_not_refused(tmp_path):
    from entry.training.checkpoint_trust import RefusedPickle, load_dcp

    state = _small_checkpoint(tmp_path)
    (data,) = tmp_path.glob("*.distcp")
    data.write_bytes(data.read_bytes()[:40])
    with pytest.raises(BaseException) as caught:  # DCP's CheckpointException is a BaseException
        load_dcp(state, tmp_path)
    assert not isinstance(caught.value, RefusedPickle)


# --- weak point 7: The Well's own split, dropped, says so --------------------------------------

def test_a_missing_well_split_folder_is_named_with_the_rule_used_instead(tmp_path, capfd):
    from entry.prepare_data import main as prepare
    from pipelines.generate import main as generate

    assert generate(["--task", "burgers1d", "--samples", "20", "--nx", "32", "--nt", "5", "--nu", "0.01",
                     "--out", str(tmp_path / "well"), "--layout", "the_well", "--device", "cpu", "--no-progress"]) == 0
    dataset = tmp_path / "well" / "burgers1d"
    tree = tr.tiny_tree(tmp_path)
    tree["data"]["tasks"] = [{"path": str(dataset), "layout": "the_well", "initial_step": 1}]
    cfg = tmp_path / "well.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    capfd.readouterr()
    assert prepare(["--config", str(cfg)]) == 0
    assert "split folder" not in capfd.readouterr().err  # all three: The Well's own split, nothing to say
    shutil.rmtree(dataset / "data" / "valid")
    assert prepare(["--config", str(cfg)]) == 0
    lines = [line for line in capfd.readouterr().err.splitlines() if "split folder" in line]
    assert len(lines) == 1, lines
    assert ("The Well's split folder(s) valid missing or empty" in lines[0] and str(dataset) in lines[0]
            and "split by data.split instead (test: the first 0.1; val: a seeded 0.1 of the rest, seed 0)" in lines[0])
