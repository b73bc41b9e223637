"""Where a stage starts: from the newest readable checkpoint written for its config, or afresh.

`find_resume_point` only reads (it loads the checkpoint into the model and optimizer it is
given); what it decides - set another config's checkpoints aside, supersede metric lines - the
runner does once the whole stage has validated. Every decision is agreed by all ranks: a file
that one rank cannot read makes every rank skip that checkpoint, so no two ranks ever resume
from different steps.

An unreadable newest checkpoint (truncated, garbage, half-deleted by hand) is skipped with a
warning naming it and the older one used instead; when none is readable the stage stops with
a `CheckpointError` naming the folder (exit 2), never silently starting afresh over it. A file
that holds objects a checkpoint may not contain (entry.training.checkpoint_trust) is not skipped:
the stage stops with an `UntrustedCheckpointError` naming it (exit 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from entry.distributed.process_group import DistInfo, all_reduce_max
from entry.training import checkpoint as ckpt


@dataclass(frozen=True)
class ResumePoint:
    """What a stage starts from."""

    checkpoint: Path | None = None
    """The checkpoint loaded into the model and optimizer (None: a fresh start)."""
    loop_state: dict[str, Any] | None = None
    """That checkpoint's loop state for this rank."""
    set_aside: str = ""
    """Why the stage's checkpoint folder holds checkpoints it must not resume (another config's, or
    a fresh start was asked for); when set, the runner moves the folder aside before training."""
    stale_hash: str | None = None
    """The config hash those checkpoints were written for (None when unknown)."""

    @property
    def step(self) -> int:
        return int(self.loop_state[ckpt.KEY_STEP]) if self.loop_state is not None else 0


def _agreed(action: Callable[[], Any], info: DistInfo, what: Path | None) -> tuple[bool, Any, str]:
    """Run `action` on every rank; (all succeeded, its result here, this rank's error or a note).

    Raises `UntrustedCheckpointError` on every rank when any rank refused a file of the checkpoint
    `what` (one all_reduce agrees on [failed, refused]): a refused file is never fallen back from.
    With `what` None a refused file counts as unreadable.
    """
    result, error, refused = None, "", None
    try:
        result = action()
    except (KeyboardInterrupt, SystemExit):
        raise
    except ckpt.UntrustedCheckpointError as e:
        error, refused = str(e), e
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    flags = torch.tensor([float(bool(error)), float(refused is not None)], device=info.device)
    failed, refused_anywhere = (all_reduce_max(flags, info) > 0).tolist()
    if refused is not None and what is not None:
        raise refused
    if refused_anywhere and what is not None:
        raise ckpt.CheckpointError(f"checkpoint {what} holds objects a checkpoint may not contain (refused on "
                                   f"another rank; its log names the file); it was not loaded")
    if failed and not error:
        error = "unreadable on another rank"
    return not failed, result, error


def find_resume_point(ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo,
                      logger, *, config_hash: str, resume: bool, ema: nn.Module | None = None) -> ResumePoint:
    """Choose, and load into `model` and `optimizer`, the checkpoint a stage resumes from.

    Takes the stage's checkpoint folder, its (sharded) model and optimizer (and the average of
    its weights, when the stage keeps one), the stage's resume hash and whether to resume at all. Returns the `ResumePoint`. A collective: every rank calls
    it. Raises `CheckpointError` when checkpoints exist but none of them can be read, and
    `UntrustedCheckpointError` (no fallback) when a file holds objects a checkpoint may not contain.
    """
    candidates = list(reversed(ckpt.complete_checkpoints(ckpt_dir)))
    if not candidates:
        return ResumePoint()
    if not resume:
        # Only for the config hash the set-aside folder is named after: nothing to refuse.
        ok, state, _ = _agreed(lambda: ckpt.read_loop_state(candidates[0], 0), info, None)
        return ResumePoint(set_aside="are not resumed (--resume never)",
                           stale_hash=state.get(ckpt.KEY_CONFIG_HASH) if ok else None)
    failures: list[str] = []
    for i, path in enumerate(candidates):
        ok, state, error = _agreed(lambda: ckpt.read_loop_state(path, info.rank), info, path)
        if ok:
            written_for = state.get(ckpt.KEY_CONFIG_HASH)
            if written_for not in (config_hash, None):
                return ResumePoint(set_aside=f"were written for another config or other inputs (key {written_for})",
                                   stale_hash=written_for)
            ok, _, error = _agreed(lambda: ckpt.load_checkpoint(path, info, model, optimizer, ema=ema), info,
                                  path)
        if ok:
            if failures:
                logger.warning(f"{ckpt_dir.parent.name}/{ckpt_dir.name}: resuming from the previous complete "
                               f"checkpoint {path} instead of {candidates[0]}, which is unreadable ({failures[0]})")
            return ResumePoint(checkpoint=path, loop_state=state)
        failures.append(error)
        following = candidates[i + 1] if i + 1 < len(candidates) else None
        logger.warning(f"checkpoint {path} is unreadable ({error}); "
                       + (f"trying the previous one, {following}" if following else "no older checkpoint left"))
    raise ckpt.CheckpointError(
        f"no checkpoint in {ckpt_dir} can be read (newest: {candidates[0]}: {failures[0]}); move that folder "
        f"away to start the stage afresh, or pass --resume never (it sets the folder aside)")
