"""A step that failed on one rank: the log line naming the step's phase and the device memory, and
the out-of-memory record a restarted attempt reads to halve its micro-batch (training.on_oom=shrink)."""

from __future__ import annotations

from pathlib import Path

import orjson
import torch

from entry.distributed.process_group import DistInfo
from entry.storage.atomic import atomic_write_bytes
from entry.training.step import LoopSettings, StepPhase, micro_batches


def oom_record_dir(run_dir: Path) -> Path:
    return run_dir / "oom_records"


def count_oom_records(run_dir: Path, stage: str) -> int:
    """Out-of-memory records left by failed attempts of `stage` (each halves the micro-batch)."""
    folder = oom_record_dir(run_dir)
    if not folder.is_dir():
        return 0
    # Several ranks may record the same failed attempt: count attempts, not files.
    return len({p.stem.rsplit("-attempt", 1)[-1] for p in folder.glob(f"{stage}-rank*-attempt*.json")})


def memory_report(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu (no device memory statistics)"
    gib = 2 ** 30
    return (f"allocated {torch.cuda.memory_allocated(device) / gib:.2f} GiB, reserved "
            f"{torch.cuda.memory_reserved(device) / gib:.2f} GiB, peak {torch.cuda.max_memory_allocated(device) / gib:.2f} GiB")


def micro_batching(run_dir: Path, stage: str, settings: LoopSettings, on_oom: str, logger) -> tuple[int, int]:
    """(micro-batch, accum_steps), halved once per out-of-memory record with on_oom=shrink."""
    oom_count = count_oom_records(run_dir, stage) if on_oom == "shrink" else 0
    micro, accum = micro_batches(settings.per_rank_batch, settings.accum_steps, oom_count, stage)
    if oom_count:
        logger.info(f"{stage}: {oom_count} earlier out-of-memory record(s): micro-batch {micro}, accum_steps {accum}")
    return micro, accum


def record_failure(error: BaseException, info: DistInfo, stage: str, step: int, now: StepPhase,
                   run_dir: Path, logger) -> None:
    """Log why this rank is about to exit; an out-of-memory also leaves a record for the restart."""
    memory = memory_report(info.device)
    micro = now.micro
    kind = "out of memory" if isinstance(error, torch.OutOfMemoryError) else type(error).__name__
    logger.error(f"{stage}: {kind} on rank {info.rank} at step {step}, micro-batch {micro}, during "
                 f"{now.phase}: {error}; "
                 f"memory: {memory}. This rank exits; torchrun stops the others"
                 f"{' and restarts from the last checkpoint' if info.distributed else ''}.")
    if isinstance(error, torch.OutOfMemoryError):
        folder = oom_record_dir(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        record = {"stage": stage, "rank": info.rank, "step": step, "micro_batch": micro,
                  "attempt": info.restart_count, "memory": memory, "error": str(error)}
        atomic_write_bytes(folder / f"{stage}-rank{info.rank}-attempt{info.restart_count}.json", orjson.dumps(record))
