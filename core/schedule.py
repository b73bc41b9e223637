"""The learning-rate decay and the weight average's decay, defined once: the training stages
(entry.training.step) and the budgeted runs (entry.training.budgeted: the race's peers) both use these."""

from __future__ import annotations

import math


def cosine_decay(progress: float, *, floor: float, peak: float = 1.0) -> float:
    """Half a cosine from ``peak`` (progress 0) down to ``floor`` (progress 1 and beyond; below 0
    counts as 0): ``floor + (peak - floor) * (1 + cos(pi * p)) / 2``. Exact at the ends
    (``cos(pi) = -1``). The stages' schedule decays a factor to ``floor=0.1``; the race decays the
    rate itself, to its ``final_ratio`` of the peak."""
    p = min(max(progress, 0.0), 1.0)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * p))


def ema_decay_at(decay: float, updates: int) -> float:
    """Decay of a weight average after ``updates`` earlier updates (0-based optimizer step):
    ``min(decay, (1 + n) / (10 + n))``.

    The ramp keeps a short run's average from being mostly the random initialisation (with 0.999
    and 300 steps it would still weigh the initial weights by 0.74); long runs see ``decay``.
    """
    return min(decay, (1 + updates) / (10 + updates))
