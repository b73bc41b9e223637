"""The run folder `runs/<run-id>/`: config, environment, per-rank logs, metrics.jsonl, wandb.

Only rank 0 writes the shared files (config, environment, metrics, wandb); every rank writes
its own `rank<k>.log`, into which `faulthandler` also dumps a crashing rank's Python stack.
"""

from __future__ import annotations

import faulthandler
import logging
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import torch

from entry.config import config_hash, config_to_dict
from entry.config_schema import Config
from entry.distributed import DistInfo

_log_files: list = []  # open fault-log handles must outlive the logger set-up call


def run_dir_for(cfg: Config) -> Path:
    """`<logging.run_dir>/<run_name or config hash>` ($VAR in logging.run_dir expanded)."""
    from entry.storage import expand_path

    return expand_path(cfg.logging.run_dir) / (cfg.logging.run_name or f"run-{config_hash(cfg)}")


def git_commit() -> str:
    """The checkout's commit (with '+dirty' when there are uncommitted changes), or 'unknown'."""
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def environment() -> dict[str, Any]:
    """Versions and devices this process sees."""
    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
        "cuda": torch.version.cuda if cuda else None,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else ["cpu"],
        "git_commit": git_commit(),
    }


def setup_logging(run_dir: Path, info: DistInfo, name: str) -> logging.Logger:
    """Per-rank log file `rank<k>.log` (rank 0 also to stderr), with faulthandler into it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"us.{name}")
    logger.setLevel(logging.INFO)
    logger.handlers.clear()
    logger.propagate = False
    fmt = logging.Formatter(f"%(asctime)s rank{info.rank} %(levelname)s %(message)s")
    path = run_dir / f"rank{info.rank}.log"
    fh = logging.FileHandler(path)
    fh.setFormatter(fmt)
    logger.addHandler(fh)
    if info.is_main:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        logger.addHandler(sh)
    fault_file = open(path, "a", buffering=1)  # noqa: SIM115 - must stay open for faulthandler
    _log_files.append(fault_file)
    faulthandler.enable(file=fault_file, all_threads=True)
    return logger


def write_run_header(run_dir: Path, cfg: Config, info: DistInfo) -> None:
    """Rank 0: resolved config (with hash) and environment."""
    if not info.is_main:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_bytes(orjson.dumps(
        {"config_hash": config_hash(cfg), "config": config_to_dict(cfg)}, option=orjson.OPT_INDENT_2))
    (run_dir / "environment.json").write_bytes(orjson.dumps(
        {**environment(), "world_size": info.world_size, "backend": info.backend}, option=orjson.OPT_INDENT_2))


class MetricsSink:
    """Rank 0's metric writer: `metrics.jsonl` lines and (lazily imported) wandb."""

    def __init__(self, run_dir: Path, cfg: Config, info: DistInfo, stage: str):
        self.enabled = info.is_main
        self.stage = stage
        self.path = run_dir / "metrics.jsonl"
        self.wandb_run = None
        if self.enabled and cfg.logging.wandb.mode != "disabled":
            import wandb  # lazy: the GPU image and minimal installs run without it

            w = cfg.logging.wandb
            self.wandb_run = wandb.init(project=w.project, entity=w.entity or None, mode=w.mode,
                                        name=f"{run_dir.name}-{stage}", tags=list(w.tags),
                                        dir=str(run_dir), config=config_to_dict(cfg))
            (run_dir / f"wandb_run_id_{stage}.txt").write_text(self.wandb_run.id + "\n")

    def log(self, step: int, values: dict[str, float]) -> None:
        """Append one metrics line (rank 0 only)."""
        if not self.enabled:
            return
        line = {"stage": self.stage, "step": step, **values}
        with self.path.open("ab") as f:
            f.write(orjson.dumps(line) + b"\n")
        if self.wandb_run is not None:
            self.wandb_run.log({f"{self.stage}/{k}": v for k, v in values.items()}, step=step)

    def close(self, exit_code: int) -> None:
        """Finish wandb with the true exit code, so a crashed run is never marked finished."""
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None
