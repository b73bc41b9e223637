"""Where a benchmark's record comes from: the machine it ran on (`device_slug`, and `processor_name`
from `entry.storage.run_folder`, which every run folder's environment records too), the code
(`commit_state`, `uncommitted`), both in the one stamp every record carries (`record_stamp`), and the
refusal to measure from a work tree a referee could not check out again (`refuse_dirty`), and the
environment in which a bench's child runs this checkout's code (`checkout_env`). Every bench
command reads these from here."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import torch

from entry.config.load import ConfigError
from entry.storage.run_folder import processor_name  # re-exported: a record names its processor

ROOT = Path(__file__).resolve().parents[1]


def device_slug(device: torch.device) -> str:
    """The name a result file gives its machine: the GPU's name in lower-case words joined by "-",
    or "cpu-<N>core" with N the CPU cores this process may run on."""
    if device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"cpu-{len(os.sched_getaffinity(0))}core"


def uncommitted(root: Path | None = None) -> list[str] | None:
    """The paths `git status --porcelain` lists outside bench/results/ (a bench's own records there,
    written as it runs, are not a change to the code): [] for a clean tree, None where ``root``
    (default this repository) is no git checkout or git is missing."""
    root = root or ROOT
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", ".", ":(exclude)bench/results"], cwd=root,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [line[3:] for line in out.splitlines() if line.strip()]


def commit_state(root: Path | None = None) -> tuple[str, bool]:
    """(HEAD commit or "unknown", whether the work tree has uncommitted changes outside
    bench/results/ (`uncommitted`)). ``root``: the repository (default this one)."""
    root = root or ROOT
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False
    return head, bool(uncommitted(root))


def checkout_env() -> dict[str, str]:
    """This process's environment with this checkout first on PYTHONPATH and the caller's entries after it,
    empty ones dropped (an empty entry would put the child's working folder on its path): what a bench's
    ``python -m entry.pipeline`` child runs with, so that it runs the code its record names."""
    entries = [str(ROOT), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(entries)}


def training_device() -> torch.device:
    """The device this machine's training runs pick (`entry.distributed.process_group.init_distributed`:
    CUDA when torch sees one, else the CPU): where a command that starts pipeline runs records them made."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def record_stamp(device: torch.device) -> dict:
    """What every bench record says of where it was made, on ``device``: a dict of "device"
    (`device_slug`), "processor" (`processor_name`), "git_commit" and "dirty" (`commit_state` of this
    repository), "torch" (its version) and "threads" (the threads its CPU kernels may use). A
    command adds its own keys (date, command, config) beside these."""
    commit, dirty = commit_state()
    return {"device": device_slug(device), "processor": processor_name(device), "git_commit": commit,
            "dirty": dirty, "torch": torch.__version__, "threads": torch.get_num_threads()}


def refuse_dirty(allow_dirty: bool, command: str) -> None:
    """Raises ConfigError unless this repository's work tree is a clean git checkout (outside
    bench/results/) or ``allow_dirty`` (the command's --allow-dirty) is set: a referee accepts records
    of a commit only. ``command`` names the benchmark in the message."""
    if allow_dirty:
        return
    changed = uncommitted(ROOT)
    if changed is None:
        raise ConfigError(f"{command}: {ROOT} is no git checkout, so no record could name its code: run from a "
                          "checkout, or pass --allow-dirty for a development run")
    if changed:
        raise ConfigError(f"{command}: the work tree has {len(changed)} uncommitted change(s) outside bench/results/ "
                          f"(e.g. {changed[0]}): commit them, or pass --allow-dirty for a development run (its records "
                          "say dirty)")
