"""Fault injection for the tests: a listener on entry.distributed.hooks that raises, poisons,
signals or stalls one rank at one step, so no production code branches on faults.

Not part of the product: nothing outside tests/ imports it. A test reaches the processes it
starts (torchrun's workers and their restarts included) through the `US_INJECT_FAULT` variable (a
process cannot receive an object) and `fault_env`, which also puts tests/fault_site on
PYTHONPATH: its `sitecustomize` calls `install_from_env` when each process starts. A test in its
own process installs a `Fault` directly: `with injected(parse_fault("nan@rank=0,step=3")): ...`
(or `install` and `uninstall`).

Format: `KIND@rank=R,step=S[,stage=NAME][,attempt=A][,seconds=N][,repeat=1]`, KIND one of
  oom    raise torch.OutOfMemoryError inside the forward of the middle shard unit
  error  raise RuntimeError inside the same forward
  nan    make the loss NaN (with repeat=1: on every step from S on)
  segv   SIGSEGV the process at the start of step S
  kill   SIGKILL the process at the start of step S
  sleep  sleep `seconds` before the step's first collective (a rank that stops taking part)
  term   SIGTERM the process (preemption) at the start of step S
It fires only in torchrun attempt A (default 0), so a restarted job runs clean, and only in
stage NAME when one is given (entry.pipeline runs several stages in one process); the latent
cache's build is stage `cache` (step = the rank's block of rows); stage `data` (named
explicitly) fires at step 0 of entry.data.files's generation of missing files. Uninstalled, it
costs nothing; installed, a few integer comparisons per event (the nan fault multiplies on the
device and reads nothing back).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from entry.distributed import hooks

ENV = "US_INJECT_FAULT"
SITE = Path(__file__).resolve().parent / "fault_site"
"""The folder whose `sitecustomize` installs the fault named by `ENV` in a starting process."""
KINDS = ("oom", "error", "nan", "segv", "kill", "sleep", "term")
EXPLICIT_STAGES = ("data",)
"""Stages a fault fires in only when it names them (a fault without a stage fires in all others)."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: what happens (`kind`), on which rank, at which step of which attempt."""

    kind: str
    rank: int
    step: int
    attempt: int = 0
    seconds: float = 0.0
    repeat: bool = False
    stage: str = ""

    def applies_to(self, stage: str) -> bool:
        """Whether the fault fires in `stage` at all (its stage, or any but the explicit ones)."""
        return self.stage == stage or (not self.stage and stage not in EXPLICIT_STAGES)

    def due(self, rank: int, step: int, attempt: int) -> bool:
        """Whether the fault fires at this rank, step and attempt (any stage it applies to)."""
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


_SIGNALS = {"segv": signal.SIGSEGV, "kill": signal.SIGKILL, "term": signal.SIGTERM}


class FaultInjector(hooks.Listener):
    """The listener that makes `fault` happen at the events it names."""

    def __init__(self, fault: Fault):
        self.fault = fault

    def before_step(self, stage: str, rank: int, step: int, attempt: int) -> None:
        """Signals and stalls that happen at the start of a step."""
        fault = self.fault
        if not (fault.applies_to(stage) and fault.due(rank, step, attempt)):
            return
        if fault.kind in _SIGNALS:
            os.kill(os.getpid(), _SIGNALS[fault.kind])
        elif fault.kind == "sleep":
            time.sleep(fault.seconds)

    def loss(self, stage: str, rank: int, step: int, attempt: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss, or NaN when a `nan` fault is due (a multiply on the device: no host read)."""
        fault = self.fault
        if fault.kind == "nan" and fault.applies_to(stage) and fault.due(rank, step, attempt):
            return loss * float("nan")
        return loss

    def model_ready(self, stage: str, units: list[nn.Module], rank: int, attempt: int, now: Any) -> list:
        """For `oom` and `error`: a forward pre-hook on the middle unit that raises when the fault is
        due at step ``now.step`` (read at each forward); returns its handle."""
        fault = self.fault
        if fault.kind not in ("oom", "error") or not units or not fault.applies_to(stage):
            return []

        def raise_when_due(module, args):
            if fault.due(rank, now.step, attempt):
                if fault.kind == "oom":
                    raise torch.OutOfMemoryError(f"injected out of memory (rank {rank}, step {now.step})")
                raise RuntimeError(f"injected error (rank {rank}, step {now.step})")

        return [units[len(units) // 2].register_forward_pre_hook(raise_when_due)]


def install(fault: Fault) -> FaultInjector:
    """Make `fault` happen in this process from now on; returns the listener for `uninstall`."""
    return hooks.add(FaultInjector(fault))


def uninstall(injector: FaultInjector) -> None:
    """Stop `injector`'s fault (forward hooks already armed go when their stage ends)."""
    hooks.remove(injector)


@contextlib.contextmanager
def injected(fault: Fault) -> Iterator[FaultInjector]:
    """`install(fault)` for the duration of a `with` block, uninstalled on every exit path."""
    with hooks.listening(FaultInjector(fault)) as injector:
        yield injector


_from_env: list[FaultInjector] = []  # what install_from_env installed: one per process, however often called


def install_from_env() -> FaultInjector | None:
    """Install the fault `US_INJECT_FAULT` names, once per process (a second call returns the
    first one's listener); None when the variable is unset or empty."""
    if not _from_env:
        fault = parse_fault(os.environ.get(ENV))
        if fault is None:
            return None
        _from_env.append(install(fault))
    return _from_env[0]


def fault_env(env: dict, fault: str) -> dict:
    """A copy of the environment `env` for a subprocess in which `fault` happens (`ENV` set and
    `SITE` first on PYTHONPATH, so every Python process it starts installs it)."""
    path = env.get("PYTHONPATH", "")
    return {**env, ENV: fault, "PYTHONPATH": str(SITE) + (os.pathsep + path if path else "")}
