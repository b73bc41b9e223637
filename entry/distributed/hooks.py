"""Named points in a rank's work where a listener may act, unknown to the code that reaches them.

The training loop, the step, the data generation and the cache build call the dispatchers below
(`before_step`, `loss`, `model_ready`) at fixed points; each passes the event to every listener
registered with `add`, in order. With no listener a dispatcher is one call that loops over an
empty tuple. The listener today is the tests' fault injection (tests/faults.py, outside the product), so
no production code branches on faults; a profiler or a chaos tool would listen the same way.

A stage is a training stage's name, `"data"` (generating the missing data files, step 0) or
`"cache"` (building a latent cache, step = the rank's block of rows being encoded).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn


class Handle(Protocol):
    """What `model_ready` returns per armed hook: something the loop removes when the stage ends."""

    def remove(self) -> None: ...


class Listener:
    """Base of a listener: every event is a no-op here; override the ones to act on."""

    def before_step(self, stage: str, rank: int, step: int, attempt: int) -> None:
        """At the start of `step` of `stage` on `rank` in torchrun attempt `attempt`, before any
        of the step's collectives."""

    def loss(self, stage: str, rank: int, step: int, attempt: int, loss: torch.Tensor) -> torch.Tensor:
        """A micro-step's loss, before its backward; returns the loss to use (no device read
        allowed: the step's one host sync is the loop's, see tests/test_host_syncs.py)."""
        return loss

    def model_ready(self, stage: str, units: list[nn.Module], rank: int, attempt: int, now: Any) -> list[Handle]:
        """A stage's model is placed and about to train; `units` are its shard units in order
        (entry.distributed.sharding.shard_units) and `now.step` is the optimizer step in progress,
        read at any later time. Returns handles the loop removes when the stage ends."""
        return []


# Process-wide, like torch's global module hooks: the points are reached deep inside calls that
# must not carry a listener argument. Replaced (never mutated) so a dispatch in progress keeps
# the tuple it started with.
_listeners: tuple[Listener, ...] = ()


def add(listener: Listener) -> Listener:
    """Register `listener` for every event from now on (after those already registered); returns it."""
    global _listeners
    _listeners = (*_listeners, listener)
    return listener


def remove(listener: Listener) -> None:
    """Unregister `listener`; a listener not registered is ignored."""
    global _listeners
    _listeners = tuple(x for x in _listeners if x is not listener)


def listeners() -> tuple[Listener, ...]:
    """The registered listeners, in the order they hear events."""
    return _listeners


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[Listener]:
    """`add(listener)` for the duration of a `with` block, removed on every exit path."""
    add(listener)
    try:
        yield listener
    finally:
        remove(listener)


def before_step(stage: str, rank: int, step: int, attempt: int) -> None:
    """Tell every listener that `step` of `stage` starts (`Listener.before_step`)."""
    for listener in _listeners:
        listener.before_step(stage, rank, step, attempt)


def loss(stage: str, rank: int, step: int, attempt: int, value: torch.Tensor) -> torch.Tensor:
    """The micro-step's loss after every listener had it (`Listener.loss`); `value` with none."""
    for listener in _listeners:
        value = listener.loss(stage, rank, step, attempt, value)
    return value


def model_ready(stage: str, units: list[nn.Module], rank: int, attempt: int, now: Any) -> list[Handle]:
    """Tell every listener the stage's model is ready (`Listener.model_ready`); returns all the
    handles they armed, for the caller to `remove()` when the stage ends."""
    handles: list[Handle] = []
    for listener in _listeners:
        handles += listener.model_ready(stage, units, rank, attempt, now)
    return handles
