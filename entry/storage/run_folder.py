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

from entry.config.load import config_hash, config_to_dict
from entry.config.schema import Config
from entry.distributed.process_group import DistInfo, all_reduce_max
from entry.storage.atomic import atomic_write_bytes, atomic_write_json, read_json
from entry.storage.folder_lock import FolderInUse, acquire, holds, record_holder, release
from entry.storage.probe import expand_path

_log_files: list = []  # open fault-log handles must outlive the logger set-up call


def show_progress(enabled: bool) -> bool:
    """Whether to draw a progress bar: asked for and stderr is a terminal. In a log file a bar's
    carriage-return redraws are noise; the log lines already say how far a command is."""
    return enabled and sys.stderr.isatty()


def run_dir_for(cfg: Config) -> Path:
    """`<logging.run_dir>/<run_name or config hash>` ($VAR in logging.run_dir expanded)."""
    return expand_path(cfg.logging.run_dir) / (cfg.logging.run_name or f"run-{config_hash(cfg)}")


def weights_file(run_dir: Path, stage: str) -> Path:
    """`<run_dir>/<stage>.pt`: the weights stage `stage` exports."""
    return run_dir / f"{stage}.pt"


def evaluation_suffix(cfg: Config, small: bool = False) -> str:
    """What an evaluation adds to its file names: "_val" when it scores the val split
    (`evaluation.split`), "_small" with ``small`` (entry.evaluate --small); "" for the test report."""
    return ("_val" if cfg.evaluation.split == "val" else "") + ("_small" if small else "")


def evaluation_file(run_dir: Path, cfg: Config, small: bool = False) -> Path:
    """`<run_dir>/eval<suffix>.json` (`evaluation_suffix`): eval.json is always the test split's report."""
    return run_dir / f"eval{evaluation_suffix(cfg, small)}.json"


def stage_done_file(run_dir: Path, stage: str) -> Path:
    """`<run_dir>/<stage>.done.json`: the record that stage `stage` completed (entry.training.stage_record)."""
    return run_dir / f"{stage}.done.json"


def published_selection(run_dir: Path, stages) -> dict[str, dict]:
    """Per stage of `stages` that published its best validation's weights: ``best_step`` and
    ``best_val_nrmse`` from its done file (best_step 0: its untrained start was published). An
    unreadable done file counts as absent, as everywhere (docs/design.md)."""
    out = {}
    for stage in stages:
        try:
            done = read_json(stage_done_file(run_dir, stage))
        except ValueError:
            continue
        if isinstance(done, dict) and done.get("select") == "best" and done.get("best_step") is not None:
            out[stage] = {"best_step": done["best_step"], "best_val_nrmse": done["best_val_nrmse"]}
    return out


def commit_label() -> str:
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


def processor_name(device: torch.device, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The processor a run or a bench record was computed on, finer than a core count (bench's
    `device_slug`): the GPU's name, or the CPU's model name, family and model number (``cpuinfo``'s
    first processor; "unknown CPU" where the file is missing or says none) and the instruction set
    torch's kernels dispatch to. Two 2-core machines can compute different bits: a solver's
    data file came out other bytes on another "AMD EPYC" (docs/benchmarks.md, the Navier-Stokes race)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""  # no such file off Linux: the CPU is named unknown, the instruction set still known
    first = text.strip().split("\n\n", 1)[0]  # the first processor's block ends at a blank line
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}
    name = fields.get("model name") or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return f"{name}, torch kernels {torch.backends.cpu.get_cpu_capability()}"


def environment() -> dict[str, Any]:
    """Versions and devices this process sees, and the CPU it runs on (`processor_name`: two CPUs of
    one kind of machine can train at other speeds and round other bits)."""
    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
        "cuda": torch.version.cuda if cuda else None,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else ["cpu"],
        "processor": processor_name(torch.device("cpu")),
        "git_commit": commit_label(),
    }


class _Held(logging.Handler):
    """Keeps a rank's records in memory until its log file may be written (`open_rank_log`)."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def setup_logging(run_dir: Path, info: DistInfo, name: str, *, deferred: bool = False) -> logging.Logger:
    """Per-rank log file `rank<k>.log` (rank 0 also to stderr), with faulthandler into it.

    With `deferred`, nothing is written to the run folder yet: records are held in memory (rank 0
    still prints them) until `open_rank_log`, so a command that stops on a user error leaves the
    run folder as it found it.
    """
    logger = logging.getLogger(f"us.{name}")
    logger.setLevel(logging.INFO)
    logger.handlers.clear()
    logger.propagate = False
    fmt = logging.Formatter(f"%(asctime)s rank{info.rank} %(levelname)s %(message)s")
    if info.is_main:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        logger.addHandler(sh)
    held = _Held()
    held.setFormatter(fmt)
    logger.addHandler(held)
    if not deferred:
        open_rank_log(logger, run_dir, info)
    return logger


def open_rank_log(logger: logging.Logger, run_dir: Path, info: DistInfo) -> None:
    """Start writing `logger` to `rank<k>.log` (with the records held so far) and point
    faulthandler there; a no-op for a logger already writing its file."""
    held = next((h for h in logger.handlers if isinstance(h, _Held)), None)
    if held is None:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"rank{info.rank}.log"
    fh = logging.FileHandler(path)
    fh.setFormatter(held.formatter)
    for record in held.records:
        fh.handle(record)
    logger.removeHandler(held)
    logger.addHandler(fh)
    fault_file = open(path, "a", buffering=1)  # noqa: SIM115 - must stay open for faulthandler
    _log_files.append(fault_file)
    faulthandler.enable(file=fault_file, all_threads=True)


def run_lock_file(run_dir: Path) -> Path:
    """The lock file of a run folder (held by rank 0 of the job writing it)."""
    return run_dir / "run.lock"


def lock_run_folder(run_dir: Path, info: DistInfo, *, create: bool) -> bool:
    """Rank 0 takes the run folder's lock (see entry.storage.folder_lock); a collective under torchrun.

    With `create` the lock file is made when missing, the folder too, and rank 0 records itself
    as the holder; without, only an existing lock file is locked (nothing is written). Returns
    whether this call took the lock (rank 0, not held before): the caller then releases it with
    `unlock_run_folder` when done. Raises `FolderInUse` on every rank when another job holds it.
    """
    lock = run_lock_file(run_dir)
    error, took = None, False
    if info.is_main:
        already = holds(lock)
        try:
            if create:
                run_dir.mkdir(parents=True, exist_ok=True)
            if acquire(lock, create=create, what=f"run folder {run_dir}") and create and not already:
                record_holder(lock)
        except FolderInUse as e:
            error = e
        took = not already and holds(lock)
    if info.distributed:
        taken = all_reduce_max(torch.tensor([float(error is not None)], device=info.device), info)
        if taken.item() > 0 and error is None:
            error = FolderInUse(f"run folder {run_dir} is in use by another job (rank 0 names it)")
    if error is not None:
        raise error
    return took


def unlock_run_folder(run_dir: Path) -> None:
    """Release a run folder lock this process took (process exit releases it too)."""
    release(run_lock_file(run_dir))


def write_run_header(run_dir: Path, cfg: Config, info: DistInfo) -> None:
    """Rank 0: resolved config (with hash) and environment, each replaced atomically."""
    if not info.is_main:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "config.json", {"config_hash": config_hash(cfg), "config": config_to_dict(cfg)},
                      indent=True)
    atomic_write_json(run_dir / "environment.json",
                      {**environment(), "world_size": info.world_size, "backend": info.backend}, indent=True)


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
            # One wandb run per stage, grouped by the run folder: a pipeline's stages land together.
            self.wandb_run = wandb.init(project=w.project, entity=w.entity or None, mode=w.mode,
                                        name=f"{run_dir.name}-{stage}", group=run_dir.name, job_type=stage,
                                        tags=list(w.tags), dir=str(run_dir), config=config_to_dict(cfg))
            atomic_write_bytes(run_dir / f"wandb_run_id_{stage}.txt", (self.wandb_run.id + "\n").encode())

    def supersede_after(self, step: int) -> int:
        """Rank 0: move this stage's lines of steps after `step` out of `metrics.jsonl` into
        `metrics.superseded.jsonl` (a resumed run logs those steps again); returns how many moved."""
        if not self.enabled or not self.path.is_file():
            return 0

        keep, moved = [], []
        for line in self.path.read_bytes().splitlines(keepends=True):
            try:
                rec = orjson.loads(line)
                later = rec.get("stage") == self.stage and rec.get("step", 0) > step
            except orjson.JSONDecodeError:
                later = False  # a line cut short by a crash stays where it is
            (moved if later else keep).append(line)
        if moved:
            with (self.path.parent / "metrics.superseded.jsonl").open("ab") as f:
                f.writelines(moved)
            atomic_write_bytes(self.path, b"".join(keep))
        return len(moved)

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
