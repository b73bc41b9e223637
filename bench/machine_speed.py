"""How fast the machine runs right now: a fixed reference workload timed before each trained run of
a benchmark on a wall clock (`bench.race`), so that a referee can see whether every record had the
same clock.

A race gives every model the same seconds, but a shared 2-core machine does not run at one speed
for hours: our 1D operator's training step on the reduced advection task took 0.072 s on
2026-11-26 and 0.156 s on 2026-11-28, at the same commit (7f986b6), torch and data. Records made
while the machine was slower got less work out of their budget. The reference is a small 1D
convolution stack's forward pass (the kind of work the models do; no backward: bench/ trains
nothing), on weights and inputs made from a fixed seed; its fastest repeat is the machine's speed
at that moment, the slowest repeats being whatever else was running.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

REPEATS = 5
"""Timed repeats of the workload; the fastest counts."""
ITERATIONS = 16
"""Forward passes per repeat."""
RECORD_KEYS = {"machine_forward_s": "a conv1d stack's forward pass",
               "machine_reference_s": "a conv1d stack's forward and backward, as records of 71d85e8 timed it"}
"""Record key -> the reference workload it timed: `measured` writes the first; a key names one
workload, so that records timing different ones are never compared."""
DRIFT = 1.2
"""Slowest over fastest reference of a race's records above which its report says the records did
not share one clock."""


def _workload() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A fixed input [8, 32, 256] and three conv1d weights [32, 32, 5], from their own generator."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, 256, generator=g)
    weights = [torch.randn(32, 32, 5, generator=g) / 12.0 for _ in range(3)]
    return x, weights


@torch.no_grad()
def _passes(x: torch.Tensor, weights: list[torch.Tensor], n: int) -> None:
    for _ in range(n):
        h = x
        for w in weights:
            h = F.gelu(F.conv1d(h, w, padding=2))


def reference_seconds(repeats: int = REPEATS, iterations: int = ITERATIONS) -> float:
    """Seconds of one forward pass of the reference workload on the CPU, the fastest of
    ``repeats`` timings of ``iterations`` passes each (with the process's torch threads). About
    ``repeats * iterations`` times a few milliseconds."""
    x, weights = _workload()
    _passes(x, weights, 1)  # allocator and kernels warmed outside the timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _passes(x, weights, iterations)
        best = min(best, (time.perf_counter() - start) / iterations)
    return best


def measured(run: Callable[[], dict]) -> dict:
    """``run()``'s record with ``machine_forward_s``, the reference timed just before it (off its clock)."""
    speed = reference_seconds()
    return run() | {"machine_forward_s": speed}


def speed_note(references: dict[str, list[float]], workload: str = RECORD_KEYS["machine_forward_s"]) -> str:
    """A report's paragraph on the machine's speed over a benchmark's records: ``references`` maps a
    model to the reference seconds measured before each of its records (`reference_seconds`, of the
    ``workload`` named). Says the range, and when the slowest is more than `DRIFT` times the
    fastest, that the records did not share one clock and each model's median. Empty when no
    record measured it."""
    every = [s for seconds in references.values() for s in seconds]
    if not every:
        return ""
    low, high = min(every), max(every)
    text = (f"The machine's speed: a fixed reference workload ({workload}: `bench.machine_speed`) took {low * 1e3:.3g} to "
            f"{high * 1e3:.3g} ms a pass before the training of the {len(every)} records that measured it")
    if high <= DRIFT * low:
        return text + f" ({high / low:.2f}x apart: one clock)."
    medians = "; ".join(f"{model} {statistics.median(s) * 1e3:.3g} ms" for model, s in references.items() if s)
    return (text + f". **They are {high / low:.2f}x apart: these records did not all train on the same clock** "
            f"(median per model: {medians}).")
