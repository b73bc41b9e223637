"""A user's mistake exits 2 with one line naming the key or file, and changes nothing on disk
(issue 17, items 2 and 8); checkpoints are never lost to a command; one job per run folder."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipelines import file_facts
from tests import tiny_run as tr

pytestmark = [pytest.mark.slow]


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path (empty folders count too)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
    return out


def _one_line_error(capfd, prefix: str, *names: str) -> str:
    """The command's stderr ends in exactly one error line that starts with `prefix` and names `names`."""
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith(("config error", "data error", "cache error",
                                                                     "checkpoint error", "folder in use"))]
    assert len(errors) == 1, err
    assert errors[0].startswith(prefix) and "Traceback" not in err, err
    for name in names:
        assert name in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A prepared tiny run "base" with a finished operator stage (checkpoints at steps 3 and 6)."""
    return tr.finished_run(tmp_path_factory.mktemp("user_errors"))


def _operator(root: Path, *sets: str) -> int:
    from entry.operator import main

    args = ["--config", str(root / "tiny.yaml"), "--no-deps", "--set", "logging.run_name=base",
            "--set", "operator.steps=6"]
    for s in sets:
        args += ["--set", s]
    return main(args)


@pytest.mark.timeout(300)
def test_a_user_error_leaves_the_run_folder_byte_identical(root, capfd, monkeypatch):
    # Every file counts as older than the racy-clean window, as on a machine slow enough to reach
    # these commands seconds after the run wrote its weights: a fact cached about a file in the
    # run folder would now be written there (it once was: `.autoencoder.pt.facts.json`).
    monkeypatch.setattr(file_facts, "RACY_S", 0.0)
    run = root / "runs" / "base"
    before = tree_digest(run)
    assert any(k.startswith("checkpoints/operator/step_00000006") for k in before)
    empty_dir = root / "not_a_file"
    empty_dir.mkdir()
    cases = [
        (("operator.batch_size=1000000000",), "config error", ("batch",)),  # the example
        (("operator.lr=.nan",), "config error", ("operator.lr",)),
        (("training.timeout_s=.inf",), "config error", ("training.timeout_s",)),
        (("operator.lr=[1,",), "config error", ("operator.lr", "not valid YAML")),
        ((f"data.tasks.0.path={empty_dir}",), "config error", ("data.tasks[0].path", str(empty_dir))),
    ]
    for sets, prefix, names in cases:
        assert _operator(root, *sets) == 2, sets
        _one_line_error(capfd, prefix, *names)
        assert tree_digest(run) == before, sets
    # The correct command afterwards resumes the run's own checkpoint, nothing was set aside.
    assert not list((run / "checkpoints").glob("operator.stale-*"))


@pytest.mark.timeout(300)
def test_a_refused_pipeline_creates_no_run_folder(root, capfd):
    """A batch the data cannot fill is found after the data are checked and the run folder's
    storage is probed: the refusal leaves no empty `runs/<name>/` behind (it once did: the probe
    created the folder to write its token in)."""
    from entry.pipeline import main

    args = ["--config", str(root / "tiny.yaml"), "--set", "logging.run_name=never_made",
            "--set", "operator.batch_size=1000000000"]
    assert main(args) == 2
    _one_line_error(capfd, "config error", "batch")
    assert not (root / "runs" / "never_made").exists()


@pytest.mark.timeout(120)
def test_a_batch_the_ranks_cannot_split_is_refused_before_the_first_stage_trains(root):
    """Rank 0 of a 2-rank pipeline whose operator batch (7) cannot be split over 2 ranks: refused before the
    data, the storage probes and the run folder (it once trained the codec and the cache, then failed in
    stage operator with exit 1); likewise a stage command whose input stage's batch cannot be split, before
    it builds that input, and a rank's share that `training.accum_steps` cannot split. No process group is
    needed to get there, so none is made."""
    import logging

    from entry.config.load import ConfigError, load_config
    from entry.distributed.process_group import DistInfo
    from entry.pipeline import run_pipeline
    from entry.training.stage_sequence import ensure_inputs

    rank0_of_2 = DistInfo(0, 2, 0, torch.device("cpu"), "gloo", 0)
    cfg = load_config(root / "tiny.yaml", overrides=["logging.run_name=never_split", "operator.batch_size=7"])
    with pytest.raises(ConfigError, match=r"operator.batch_size \(7\) must be divisible by the world size \(2\)"):
        run_pipeline(cfg, rank0_of_2, logging.getLogger("test"), dry_run=False, workers=0)
    cfg = load_config(root / "tiny.yaml", overrides=["logging.run_name=never_split", "autoencoder.batch_size=7"])
    with pytest.raises(ConfigError, match=r"autoencoder.batch_size \(7\) must be divisible by the world size"):
        ensure_inputs(cfg, rank0_of_2, "operator")
    # A rank's 4 samples in 3 micro-batches: this once failed in the first stage with "after 0 out-of-memory
    # restart(s) ... cannot be split", exit 1, the run folder written.
    cfg = load_config(root / "tiny.yaml", overrides=["logging.run_name=never_split", "training.accum_steps=3"])
    with pytest.raises(ConfigError, match=r"autoencoder.batch_size \(8\) gives each of 2 rank\(s\) 4 samples a step, "
                                          r"which training.accum_steps \(3\) must split"):
        run_pipeline(cfg, rank0_of_2, logging.getLogger("test"), dry_run=False, workers=0)
    assert not (root / "runs" / "never_split").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting,names", [
    ("operator.unroll_steps=11", ("operator.unroll_steps (11)", "keeps 11")),
    ("operator.horizon=11", ("operator.horizon (11)", "keeps 11")),
    ("data.tasks.0.initial_step=11", ("initial_step=11", "data.tasks[0].initial_step")),
])
def test_a_trajectory_too_short_for_the_stages_is_refused_before_the_first_stage_trains(root, capfd, setting, names):
    """Trajectories of 11 steps: 11 unrolled steps, pairs 11 apart or 11 given steps leave nothing to train
    on or predict. Each failed only in its own stage (the operator with exit 1, the evaluation after every
    stage had trained); now before the run folder is made."""
    from entry.pipeline import main

    assert main(["--config", str(root / "tiny.yaml"), "--set", "logging.run_name=too_short", "--set", setting]) == 2
    _one_line_error(capfd, "config error", *names)
    assert not (root / "runs" / "too_short").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("no_deps", [False, True])
def test_a_stage_command_refuses_a_trajectory_too_short_before_it_writes(root, capfd, no_deps):
    """`python -m entry.operator` builds its inputs first (the codec, the cache) and met 11 unrolled
    steps only in its own stage (LatentPairs' ValueError, exit 1); with --no-deps on a finished run
    the same, after its log was opened. Now refused with the pipeline's line before anything is written."""
    from entry.operator import main

    run = "base" if no_deps else "short_stage"
    before = tree_digest(root / "runs" / "base")
    args = ["--config", str(root / "tiny.yaml"), "--set", f"logging.run_name={run}",
            "--set", "operator.unroll_steps=11"]
    assert main([*args, *(["--no-deps"] if no_deps else [])]) == 2
    _one_line_error(capfd, "config error", "operator.unroll_steps (11)", "keeps 11")
    assert not (root / "runs" / "short_stage").exists() and tree_digest(root / "runs" / "base") == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages,names", [
    ("[operator]", ("operator needs", "autoencoder.pt", "add autoencoder to stages")),
    ("[autoencoder,operator]", ("the cache of the autoencoder this run trains", "add cache to stages")),
])
def test_a_stage_whose_input_stages_do_not_make_is_refused_before_the_folder(root, capfd, stages, names):
    """`stages` without what a selected stage reads, in a new run folder: it wrote the folder, trained
    the stages before, then exited 2 in that stage ("no trained encoder")."""
    from entry.pipeline import main

    args = ["--config", str(root / "tiny.yaml"), "--set", "logging.run_name=unmade", "--set", f"stages={stages}"]
    assert main(args) == 2
    _one_line_error(capfd, "config error", *names)
    assert not (root / "runs" / "unmade").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text,names", [
    ("data: {root: d}\nlatent: {tokens: 8, dim: 8}\nlatent: {tokens: 16, dim: 8}\n",
     ("duplicate key 'latent'", "line 3")),
    (b"\x89HDF\r\n\x1a\n\x00\x00\xff\xfe".decode("latin-1"), ("not a text file",)),
])
def test_malformed_config_files_exit_2_naming_the_file(tmp_path, capfd, text, names):
    from entry.operator import main

    cfg = tmp_path / "bad.yaml"
    cfg.write_bytes(text.encode("latin-1"))
    assert main(["--config", str(cfg)]) == 2
    _one_line_error(capfd, "config error", str(cfg), *names)


@pytest.mark.timeout(120)
def test_tokens_that_cannot_tile_a_2d_task_exit_2(tmp_path, capfd):
    from entry.operator import main

    tree = tr.tiny_tree(tmp_path)
    tree["data"]["tasks"].append({"name": "darcy2d", "param": 1.0, "samples": 20, "nx": 32})
    tree["latent"]["tokens"] = 15
    cfg = tmp_path / "darcy.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    assert main(["--config", str(cfg)]) == 2
    _one_line_error(capfd, "config error", "latent.tokens", "power of 4")


@pytest.mark.timeout(300)
def test_a_corrupt_latest_checkpoint_falls_back_and_ends_bitwise_equal(root):
    import shutil

    base, run = root / "runs" / "base", root / "runs" / "fallback"
    shutil.copytree(base, run)
    (run / "run.lock").unlink()
    newest = run / "checkpoints" / "operator" / "step_00000006"
    (newest / "rank0.pt").write_bytes((newest / "rank0.pt").read_bytes()[:100])  # truncated
    (run / "operator.done.json").unlink()
    proc = tr.launch(root, ["--set", "logging.run_name=fallback", "--set", "operator.steps=6",
                            "--set", "training.checkpoint_every=3"], nproc=1, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run / "rank0.log").read_text()
    warning = next(line for line in log.splitlines() if "resuming from the previous complete checkpoint" in line)
    assert "step_00000003" in warning and "step_00000006" in warning  # names both
    a, b = tr.final_weights(root, "base"), tr.final_weights(root, "fallback")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_unreadable_checkpoints_and_weights_exit_2_naming_the_file(root, capfd):
    import shutil

    from entry.diffusion import main as diffusion_main

    run = root / "runs" / "garbage"
    shutil.copytree(root / "runs" / "base", run)
    (run / "run.lock").unlink()
    for step in ("step_00000003", "step_00000006"):
        (run / "checkpoints" / "operator" / step / "__0_0.distcp").write_bytes(b"garbage" * 10)
    before = tree_digest(run)
    from entry.operator import main

    args = ["--config", str(root / "tiny.yaml"), "--no-deps", "--set", "logging.run_name=garbage",
            "--set", "operator.steps=9"]
    assert main(args) == 2
    _one_line_error(capfd, "checkpoint error", "step_00000006")
    assert tree_digest(run) == before
    (run / "operator.pt").write_bytes(b"not a torch file")
    assert diffusion_main(["--config", str(root / "tiny.yaml"), "--no-deps", "--set", "logging.run_name=garbage"]) == 2
    _one_line_error(capfd, "checkpoint error", str(run / "operator.pt"))


_HOLDER = """
import sys, time
from entry.storage.folder_lock import acquire, record_holder
acquire(sys.argv[1], create=True, what="x")
record_holder(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(200)
def test_a_second_job_in_the_same_run_folder_exits_2_naming_the_holder(root, capfd):
    import os
    import socket

    lock = root / "runs" / "base" / "run.lock"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], env=tr.env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = tree_digest(root / "runs" / "base")
        assert _operator(root) == 2
        _one_line_error(capfd, "folder in use", str(root / "runs" / "base"), f"pid {holder.pid}",
                        socket.gethostname())
        assert tree_digest(root / "runs" / "base") == before
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert os.path.exists(lock)


def test_set_aside_folders_are_unique_and_the_newest_kept(tmp_path):
    from entry.distributed.process_group import DistInfo
    from entry.training.checkpoint import SET_ASIDE_KEPT, set_aside, set_aside_folders

    info = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)
    ckpt = tmp_path / "checkpoints" / "operator"
    moved = []
    for i in range(SET_ASIDE_KEPT + 1):
        (ckpt / "step_00000001").mkdir(parents=True)
        (ckpt / "step_00000001" / "mark").write_text(str(i))
        aside, removed = set_aside(ckpt, "samehash", info)  # the same stale hash every time
        moved.append(aside)
        assert removed == (moved[:1] if i == SET_ASIDE_KEPT else [])
    kept = set_aside_folders(ckpt)
    assert kept == moved[1:]  # distinct folders, oldest first, the first one pruned
    assert [(p / "step_00000001" / "mark").read_text() for p in kept] == ["1", "2", "3"]


@pytest.mark.parametrize("command", ["pipeline", "check_config", "autoencoder", "cache", "operator", "diffusion",
                                     "consistency", "steady", "evaluate", "plan"])
def test_a_command_refuses_a_mistyped_key_before_loading_the_training_machinery(tmp_path, command):
    """entry.pipeline, entry.check_config, the cache, the evaluation, the plan and every stage command parse
    the config before they import the training steps: their TensorDicts bring in torch._dynamo, seconds a
    refused command should not spend (the pipeline's refusal took 5.0 s where it takes 2.5 s on the 2-core
    machine; a stage command's 4.6 s, now 2.7 s; the plan's 5.5 s, now 2.1 s)."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tr.tiny_tree(tmp_path)))
    more = ", '--world-size', '2'" if command == "plan" else ""
    probe = (f"import sys\nfrom entry.{command} import main\n"
             f"code = main(['--config', sys.argv[1], '--set', 'operator.stepz=3'{more}])\n"
             "print(code, *(m in sys.modules for m in ('tensordict', 'torch._dynamo', 'torch.distributed.fsdp')))\n")
    proc = subprocess.run([sys.executable, "-c", probe, str(cfg)], cwd=tmp_path, env=tr.env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.stdout.split() == ["2", "False", "False", "False"], proc.stdout + proc.stderr[-2000:]
    assert "operator.stepz" in proc.stderr and not (tmp_path / "runs").exists()
