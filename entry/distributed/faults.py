"""Fault injection for the distributed tests, driven by the `US_INJECT_FAULT` variable.

Format: `KIND@rank=R,step=S[,stage=NAME][,attempt=A][,seconds=N][,repeat=1]`, KIND one of
  oom    raise torch.OutOfMemoryError inside the forward of the middle shard unit
  error  raise RuntimeError inside the same forward
  nan    make the loss NaN (with repeat=1: on every step from S on)
  segv   SIGSEGV the process at the start of step S
  kill   SIGKILL the process at the start of step S
  sleep  sleep `seconds` before the step's first collective (a rank that stops taking part)
  term   SIGTERM the process (preemption) at the start of step S
It fires only in torchrun attempt A (default 0), so a restarted job runs clean, and only in
stage NAME when one is given (entry.pipeline runs several stages in one process); stage `data`
(named explicitly) fires at step 0 of entry.data.files's generation of missing files. Unset, it
costs one dict lookup per step.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch
from torch import nn

ENV = "US_INJECT_FAULT"
KINDS = ("oom", "error", "nan", "segv", "kill", "sleep", "term")


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    rank: int
    step: int
    attempt: int = 0
    seconds: float = 0.0
    repeat: bool = False
    stage: str = ""

    def due(self, rank: int, step: int, attempt: int) -> bool:
        if rank != self.rank or attempt != self.attempt:
            return False
        return step >= self.step if self.repeat else step == self.step


def parse_fault(text: str | None) -> Fault | None:
    """Parse the variable's value; None when unset or empty."""
    if not text:
        return None
    kind, _, rest = text.partition("@")
    if kind not in KINDS:
        raise ValueError(f"{ENV}: unknown fault kind {kind!r}; allowed: {KINDS}")
    fields = dict(item.split("=", 1) for item in rest.split(",") if item)
    return Fault(kind=kind, rank=int(fields.get("rank", 0)), step=int(fields.get("step", 0)),
                 attempt=int(fields.get("attempt", 0)), seconds=float(fields.get("seconds", 0)),
                 repeat=fields.get("repeat", "0") == "1", stage=fields.get("stage", ""))


def fault_from_env(stage: str) -> Fault | None:
    """The injected fault for `stage`, if the variable names one."""
    fault = parse_fault(os.environ.get(ENV))
    return fault if fault is not None and fault.stage in ("", stage) else None


def before_step(fault: Fault | None, rank: int, step: int, attempt: int) -> None:
    """Signals and stalls that happen at the start of a step."""
    if fault is None or not fault.due(rank, step, attempt):
        return
    if fault.kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif fault.kind == "sleep":
        time.sleep(fault.seconds)


def poison_loss(fault: Fault | None, rank: int, step: int, attempt: int, loss: torch.Tensor) -> torch.Tensor:
    """The loss, or NaN when a `nan` fault is due."""
    if fault is not None and fault.kind == "nan" and fault.due(rank, step, attempt):
        return loss * float("nan")
    return loss


def arm_forward_fault(fault: Fault | None, units: list[nn.Module], rank: int, attempt: int, now):
    """Install a forward pre-hook on the middle unit raising the fault when due at step ``now.step``
    (the loop's `StepPhase`, read at each forward); returns the handle."""
    if fault is None or fault.kind not in ("oom", "error") or not units:
        return None
    middle = units[len(units) // 2]

    def hook(module, args):
        if fault.due(rank, now.step, attempt):
            if fault.kind == "oom":
                raise torch.OutOfMemoryError(f"injected out of memory (rank {rank}, step {now.step})")
            raise RuntimeError(f"injected error (rank {rank}, step {now.step})")

    return middle.register_forward_pre_hook(hook)
