"""Per-channel statistics of a dataset, streamed one trajectory at a time.

Legend: T time steps, C channels, S spatial axes.

The mean and standard deviation are what the model's normalisation uses (measured once over the
training split); the extremes and the count of non-finite values are what ``pipelines.inspect``
shows and refuses. Trajectories are merged with Chan et al.'s pairwise update of (count, mean,
M2) in float64, so the result does not depend on how many values one read holds and never needs
the whole file in memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pipelines.layouts import read_window
from pipelines.layouts.description import DatasetDescription

__all__ = ["ChannelStats", "channel_statistics"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ChannelStats:
    """One channel's summary over the trajectories read (finite values only)."""

    name: str
    count: int
    mean: float
    std: float
    min: float
    max: float
    nonfinite: int
    """NaN or Inf values seen; a dataset with any is not trained on."""


def _merge(a: tuple, b: tuple) -> tuple:
    """Chan's update of (count, mean, M2) for two disjoint parts."""
    (na, ma, qa), (nb, mb, qb) = a, b
    n = na + nb
    if n == 0:
        return a
    delta = mb - ma
    return n, ma + delta * nb / n, qa + qb + delta * delta * na * nb / n


def channel_statistics(desc: DatasetDescription, rows: Iterable[int] | None = None, *,
                       x_step: int = 1) -> tuple[ChannelStats, ...]:
    """Statistics of every state channel over trajectories `rows` (default all), reading one
    trajectory at a time: memory is one trajectory's window, whatever the file's size."""
    channels = desc.channels
    acc = [(0, 0.0, 0.0)] * len(channels)
    lo, hi = np.full(len(channels), np.inf), np.full(len(channels), -np.inf)
    bad = np.zeros(len(channels), dtype=np.int64)
    for row in range(desc.trajectories) if rows is None else rows:
        w_TCS = read_window(desc, row, x_step=x_step).astype(np.float64)
        per_c = np.moveaxis(w_TCS, 1, 0).reshape(len(channels), -1)
        for c, values in enumerate(per_c):
            finite = values[np.isfinite(values)]
            bad[c] += values.size - finite.size
            if finite.size:
                acc[c] = _merge(acc[c], (finite.size, finite.mean(), ((finite - finite.mean()) ** 2).sum()))
                lo[c], hi[c] = min(lo[c], finite.min()), max(hi[c], finite.max())
    return tuple(ChannelStats(name=name, count=int(n), mean=float(m), std=float(np.sqrt(q / n)) if n else float("nan"),
                              min=float(lo[c]), max=float(hi[c]), nonfinite=int(bad[c]))
                 for c, (name, (n, m, q)) in enumerate(zip(channels, acc, strict=True)))
