"""A race's budgets in seconds of the machine that started it, so that a race of days that outlives
one machine still gives every model the same work at a rung (issue 51).

A race's records are written over many sessions, and a session's machine is not always the last
one's: advection's 4B rung (bench/results/race-advection1d.jsonl) ran partly on a machine whose
reference workload (`bench.machine_speed`) took 0.82-1.47 ms and partly on one taking 0.31-0.36 ms.
Nor does one workload scale every model alike: the plain transformer's one-step trials at 240 s
took ~3,440 steps on the first and 5,850-6,740 on the second, 1.8x more where the reference ran
2.8x faster. So each model is its own yardstick: its training step is timed (`peer_step_seconds`,
`ours_step_seconds`: the fastest of a few steps on a fixed batch, off every clock) once when the
store starts (recorded as ``<model>@calibration``) and again before each of its trials; a trial
whose machine runs the model more than `SAME_MACHINE` times faster or slower than the store's gets
``budget * now / then`` wall seconds (`machine_factor`), any other the budget itself (the timing's
own noise on one machine, ~1.13x between calls of the reference on a quiet machine, moves no
budget). A record keeps its wall seconds and its factor; the report divides by it
(`store_seconds`).

Legend: N trajectories, T time steps, C channels, S spatial axes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from bench.accuracy_scores import TaskFields
from bench.budget import train_budgeted
from bench.machine_speed import DRIFT
from bench.race_train import batch_stream, peer_loss
from bench.result_store import reuse_or_run
from entry.config.schema import Config
from entry.distributed.process_group import DistInfo
from entry.training.estimate import stage_step_seconds

SAME_MACHINE = DRIFT
"""A model's step time now over its time when the store started, within which (either way) the
machine counts as the store's and the budget is not scaled: the bound at which the report already
says records did not share one clock."""
CALIBRATION_STEPS = 8
"""Training steps a peer's calibration runs; the first (allocator, kernels) is not counted."""
CALIBRATION_BATCH = 16
"""The batch a peer's calibration trains on: the races' batch."""
CALIBRATION_LR = 1e-4


def machine_factor(now_s: float, store_s: float) -> float:
    """Wall seconds per second of the store's machine for a model whose step takes ``now_s`` here
    and took ``store_s`` when the store started: 1 when they are within `SAME_MACHINE` of each other
    (either way), else their ratio. Both must be positive."""
    if not (now_s > 0 and store_s > 0 and math.isfinite(now_s) and math.isfinite(store_s)):
        raise ValueError(f"step seconds must be positive and finite: now {now_s}, store {store_s}")
    ratio = now_s / store_s
    return 1.0 if 1 / SAME_MACHINE <= ratio <= SAME_MACHINE else ratio


def peer_step_seconds(net: nn.Module, f: TaskFields, device: torch.device) -> float:
    """The fastest of a peer's training steps on ``f``'s training split (batches of
    `CALIBRATION_BATCH` from a fixed seed, the one-step loss, or a steady task's single step),
    trained by the product's budgeted loop for `CALIBRATION_STEPS` steps. ``net`` is a throwaway
    instance (its weights change): build the trial's own afterwards."""
    ends: list[float] = []
    batches = batch_stream(f.train, CALIBRATION_BATCH, device, generator=torch.Generator().manual_seed(0))
    loss = peer_loss("rollout" if f.steady else "one_step", f.given, seed=0)
    train_budgeted(net.to(device), batches, loss, math.inf, CALIBRATION_LR, max_steps=CALIBRATION_STEPS, seed=0,
                   on_step=lambda step, train_s, lr, value: ends.append(train_s))
    return min(b - a for a, b in zip(ends, ends[1:]))


def ours_step_seconds(cfg: Config, stage: str, info: DistInfo) -> float:
    """The fastest of our ``stage``'s training steps on random batches of its training shapes, as
    the dry-run estimate times them (`entry.training.estimate.stage_step_seconds`)."""
    return stage_step_seconds(cfg, stage, info)[0]


def machine_clock(store: Path, models: list[str], step_seconds: Callable[[str], float], stamp: dict
                  ) -> Callable[[str, float], dict]:
    """``(model, budget_s) -> the trial's budget on this machine`` for a race whose ``store`` starts
    (or started) on the machine its ``<model>@calibration`` records were made on: each of
    ``models`` timed by ``step_seconds`` and recorded with ``stamp`` the first time, read back after.
    The budget is ``{budget_s, wall_budget_s, machine_factor, step_calibration_s,
    store_step_calibration_s}``, the model's step timed anew for it."""
    calibrations = {m: reuse_or_run(store, f"{m}@calibration", 0, lambda m=m: {"step_s": step_seconds(m)} | stamp
                                    )["step_s"] for m in models}

    def clock(model: str, budget_s: float) -> dict:
        now = step_seconds(model)
        factor = machine_factor(now, calibrations[model])
        return {"budget_s": budget_s, "wall_budget_s": budget_s * factor, "machine_factor": factor,
                "step_calibration_s": now, "store_step_calibration_s": calibrations[model]}

    return clock


def store_seconds(record: dict, wall_s: float) -> float:
    """``wall_s`` of a race record in seconds of the store's machine: divided by the record's
    ``machine_factor`` (1 for records that predate it)."""
    return wall_s / record.get("machine_factor", 1.0)
