"""The arithmetic of the transfer measurement (issue 50, item 5; `bench.transfer`): the efficiency
gain EG = top / N* of a fine-tuned learning curve against the scratch model's score at the top N,
whether the scratch model's validation was flat over the last fifth of its steps, and how much of its
error its codec's reconstruction could account for. Pure
functions of numbers; lower scores (nRMSE) are better."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

FLAT_TOLERANCE = 0.05
"""A validation curve is flat over its last fifth when it moved by at most this fraction of its value there."""

CODEC_SHARE = 0.1
"""A codec still improving at its last step no longer bounds its model once its test reconstruction nRMSE is at
most this fraction of the model's one-step nRMSE: an exact codec could lower that error by about as much, no more."""


class Gain(NamedTuple):
    """EG of one fine-tuned curve against one target."""

    eg: float | None
    """top / N*; None when the curve never matches the target."""
    n_star: float | None
    """The smallest training-set size whose fine-tuned score matches the target, interpolated in log N."""
    bound: str
    """``exact`` (N* interpolated between two measured N, or at one), ``at_least`` (already matched at
    the smallest measured N: an unmeasured smaller N may match too, so EG is at least top / that N)
    or ``not_reached``."""


def efficiency_gain(ns: Sequence[float], scores: Sequence[float], target: float, top: float) -> Gain:
    """EG of the fine-tuned ``scores`` (one per size of ``ns``, increasing) against ``target`` (the
    scratch model's score at ``top``). N* is the first N whose score is at most ``target``; between
    the measured N below it (score above) and it, the score is taken linear in log N and N* is where
    that line meets ``target``. A curve matched at its smallest N gives ``at_least`` with N* that N;
    one never matched gives ``not_reached``. Sizes above ``top`` are a ValueError (EG compares to the
    scratch model at ``top``: a fine-tuned model needing more data has no EG >= 1 to report)."""
    if len(ns) != len(scores) or not ns:
        raise ValueError(f"one score per size: {len(ns)} sizes, {len(scores)} scores")
    if any(b <= a for a, b in zip(ns, ns[1:])) or ns[0] <= 0 or ns[-1] > top:
        raise ValueError(f"sizes must increase within (0, {top:g}]: {list(ns)}")
    hit = next((i for i, s in enumerate(scores) if s <= target), None)
    if hit is None:
        return Gain(None, None, "not_reached")
    if hit == 0:
        return Gain(top / ns[0], float(ns[0]), "at_least")
    (n0, s0), (n1, s1) = (ns[hit - 1], scores[hit - 1]), (ns[hit], scores[hit])
    fraction = (s0 - target) / (s0 - s1)  # s0 > target >= s1, so in (0, 1]
    n_star = n1 if fraction == 1 else math.exp(math.log(n0) + fraction * (math.log(n1) - math.log(n0)))
    return Gain(top / n_star, n_star, "exact")


def bracket(ns: Sequence[int], n_star: float | None) -> list[int]:
    """The measured sizes of ``ns`` (increasing) around N*: N* itself when measured, else the one below
    it and the one above (the issue's "3 seeds at N*"); [] for None (not reached)."""
    if n_star is None:
        return []
    i = next(i for i, n in enumerate(ns) if n >= n_star)
    return [ns[i]] if ns[i] == n_star or i == 0 else [ns[i - 1], ns[i]]


def flat_at_end(curve: Sequence[tuple[int, float]], fraction: float = 0.2) -> dict:
    """Whether a validation curve [(step, nRMSE)] stayed flat over its last ``fraction`` of steps:
    ``{"change", "flat"}``, the relative change from the last point at or before step
    (1 - fraction) * last step to the last point, and whether its size is within `FLAT_TOLERANCE`.
    ``{"change": None, "flat": None}`` for a curve with no point that early."""
    if not curve:
        return {"change": None, "flat": None}
    last_step, last = curve[-1]
    early = [v for s, v in curve if s <= (1 - fraction) * last_step]
    if not early or early[-1] == 0:
        return {"change": None, "flat": None}
    change = (last - early[-1]) / early[-1]
    return {"change": change, "flat": abs(change) <= FLAT_TOLERANCE}


def codec_share(score: dict) -> float | None:
    """A run's codec test reconstruction nRMSE over its one-step nRMSE on the same task (``score``: a
    record's ``{"one_step", "codec", ...}``); None for a record made before the codec's score was kept."""
    if score.get("codec") is None or not score.get("one_step"):
        return None
    return score["codec"] / score["one_step"]
