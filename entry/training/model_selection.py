"""Validation during training and the weights it selects (evaluation.select=best).

Every rank validates the same samples; the scores are agreed by one all_reduce so every rank takes
the same best-weights decision; the time spent is left out of the training clock.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from entry.distributed.process_group import DistInfo, all_reduce_mean
from entry.training import checkpoint as ckpt
from entry.training.clock import TrainClock
from entry.training.step import StageParts


class BestWeights:
    """The best validation so far and its exported weights (evaluation.select=best).

    A resumed attempt takes the best from the record on disk, which always describes the file it
    names (entry.training.checkpoint.save_best_weights), even when a failed attempt wrote it after the
    checkpoint it resumes from: those weights and their score are still a real measurement, and
    the record's step and score then stay true of the file. A fresh start removes an older
    run's record.
    """

    def __init__(self, folder: Path, stage: str, info: DistInfo, *, resumed: bool):
        self.folder, self.stage, self.info = folder, stage, info
        self.step: int | None = None
        self.val_nrmse = math.inf
        record = ckpt.read_best_record(folder, stage) if resumed else None
        if record is not None:
            self.step, self.val_nrmse = int(record["step"]), float(record["val_nrmse"])
        elif not resumed:
            ckpt.clear_best_weights(folder, stage, info)

    def offer(self, model: nn.Module, step: int, val_nrmse: float) -> bool:
        """Export the weights if `val_nrmse` improves on the best (collective: every rank calls it
        with the same, all-reduced value, so all take the same branch). NaN never improves."""
        if not val_nrmse < self.val_nrmse:
            return False
        ckpt.save_best_weights(model, self.folder, self.stage, step=step, val_nrmse=val_nrmse, info=self.info)
        self.step, self.val_nrmse = step, val_nrmse
        return True


def validation_scores(parts: StageParts, model: nn.Module, info: DistInfo) -> dict[str, float]:
    """`{"val_nrmse": mean over tasks, "val_nrmse/<task_key>": per task}`, the same on every rank.

    Runs `parts.validate` under no_grad in eval mode (back to train mode after, also on errors).
    The per-task values are averaged over ranks by one all_reduce: every rank saw the same samples,
    and this makes the numbers bitwise equal, so every rank takes the same best-weights decision.
    """
    model.eval()
    try:
        # No autocast: the final evaluation runs the exported weights in fp32, and validation is
        # there to predict its score. FSDP2's bf16 policy still gathers bf16 parameters, but its
        # root keeps the rolled-out latent state in fp32 (entry.distributed.precision), as on one device.
        with torch.no_grad():
            per_task = parts.validate(model)
    finally:
        model.train()
    if not per_task:
        raise ValueError(f"{parts.name}: validate returned no task scores")
    keys = sorted(per_task)
    values = torch.tensor([float(per_task[k]) for k in keys], dtype=torch.float64, device=info.device)
    values = all_reduce_mean(values, info).tolist()
    return {"val_nrmse": sum(values) / len(values), **{f"val_nrmse/{k}": v for k, v in zip(keys, values)}}


def validate_and_log(parts: StageParts, model: nn.Module, info: DistInfo, step: int, steps: int,
                     clock: TrainClock, best: BestWeights | None, sink, logger) -> None:
    """One validation: scores, a metrics line, the best-weights export; none of it counts as training time."""
    wall_s = clock.seconds()
    scores = validation_scores(parts, model, info)
    improved = best is not None and best.offer(model, step, scores["val_nrmse"])
    clock.skip()
    scores |= parts.val_extras
    sink.log(step, {**scores, "train_wall_s": wall_s})
    logger.info(f"{parts.name} step {step}/{steps} " + " ".join(f"{k} {v:.4g}" for k, v in scores.items())
                + f" train_wall_s {wall_s:.1f}" + (" (best so far: weights exported)" if improved else ""))
