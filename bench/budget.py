"""The race's own rules around budgeted training (issue 31, "a fair race"): the validation targets
whose time to reach it reports, and the learning-rate sweep every model gets.

The training itself (the budget clock, the stop rule, the schedules annealed to the budget, the
moving average, keeping the best weights) is the product's one implementation,
`entry.training.budgeted.train_budgeted`, whose every step is `entry.training.step.train_step`;
its names are re-exported here for the race's callers.

A race re-run reuses what a crashed or interrupted one finished: `bench.result_store`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from core.schedule import ema_decay_at
from entry.training.budgeted import (SCHEDULES, VALIDATIONS, BudgetClock, CurvePoint, cosine_lr, predicted_step_s,
                                     step_lr_for_budget, train_budgeted)

__all__ = [
    "SCHEDULES", "TARGETS", "VALIDATIONS", "BudgetClock", "CurvePoint", "best_lr", "bracketed_sweep", "cosine_lr",
    "ema_decay_at", "lr_sweep", "predicted_step_s", "step_lr_for_budget", "time_to_targets", "train_budgeted",
]

TARGETS = (0.1, 0.05, 0.02, 0.01)
"""Validation nRMSE targets whose time to reach the race reports."""


def time_to_targets(curve: Sequence[tuple[float, float]], targets: Sequence[float] = TARGETS) -> dict[float, float | None]:
    """Training time at which the curve's value is first at or below each target.

    Takes ``(train_s, value)`` points (`CurvePoint`s, in any order); returns ``{target: train_s}``,
    None for a target never reached (a NaN value reaches none).
    """
    return {t: min((s for s, v in curve if v <= t), default=None) for t in targets}


def lr_sweep(base_lr: float, factors: Sequence[float] = (0.3, 1.0, 3.0)) -> list[float]:
    """Learning rates to try: ``base_lr`` times each factor, in the factors' order."""
    if not base_lr > 0 or not all(f > 0 for f in factors):
        raise ValueError(f"base_lr={base_lr} and factors={list(factors)} must be > 0")
    return [base_lr * f for f in factors]


def best_lr(results: Mapping[float, float]) -> float:
    """The learning rate with the lowest validation score in ``{lr: score}``; on a tie the lower
    lr (the safer one). Non-finite scores (diverged runs) never win; all of them is a ValueError."""
    finite = [(score, lr) for lr, score in results.items() if math.isfinite(score)]
    if not finite:
        raise ValueError(f"no learning rate gave a finite score: {dict(results)}")
    return min(finite)[1]


def bracketed_sweep(score_of: Callable[[float], float], base_lr: float, factors: Sequence[float] = (0.3, 1.0, 3.0),
                    *, extensions: int = 2) -> dict[float, float]:
    """Validation scores ``{lr: score_of(lr)}`` of ``lr_sweep(base_lr, factors)``, extended while the
    best rate lies at an edge of those tried: one more rate beyond that edge, the sweep's outer
    ratio further (factors 0.3, 1, 3: x3), at most ``extensions`` times, so a peer whose best rate
    lies outside the first grid is not reported at the grid's edge. Every model gets this rule."""
    lrs = sorted(lr_sweep(base_lr, factors))
    scores = {lr: score_of(lr) for lr in lrs}
    if len(lrs) < 2:
        return scores
    up, down = lrs[-1] / lrs[-2], lrs[1] / lrs[0]
    for _ in range(extensions):
        best, tried = best_lr(scores), sorted(scores)
        if best == tried[-1]:
            lr = tried[-1] * up
        elif best == tried[0]:
            lr = tried[0] / down
        else:
            break
        scores[lr] = score_of(lr)
    return scores
