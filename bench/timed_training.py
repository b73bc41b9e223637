"""A model trained for a wall-clock budget, keeping the weights of its best validation score: how
`bench.codec`'s learned corrections (the grid codec's and the conv codec's) use the product's
budgeted loop (`entry.training.budgeted.train_budgeted`, each step the stages' `train_step`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from torch import Tensor, nn

from entry.training.budgeted import train_budgeted


def train_for_seconds(model: nn.Module, batch_loss: Callable[[], Tensor], val_score: Callable[[], float],
                      seconds: float, *, lr: float, validations: int,
                      clock: Callable[[], float] = time.perf_counter) -> dict:
    """AdamW steps (no weight decay, gradient norm clipped at 1, a constant rate) on ``batch_loss()``
    (which draws its own batch) for ``seconds`` of training (validation excluded); ``val_score()``
    of the untrained weights, then ``validations`` times over the budget and after the last step;
    ``model``'s trainable parameters end at the best validated weights (the untrained ones included).

    ``clock`` is `train_budgeted`'s (tests pass a fake). Returns {"steps", "best_step" (steps taken
    by the kept weights), "val_curve": [(training seconds, val score)]}.
    """
    steps: list[tuple] = []
    validated_at: list[int] = []

    def validate(_: nn.Module) -> float:
        validated_at.append(len(steps))
        return val_score()

    _, curve = train_budgeted(model, lambda: None, lambda net, batch: batch_loss(), seconds, lr, clock=clock,
                              schedule="constant", clip_grad_norm=1.0, validate=validate, validate_every_s=seconds / validations,
                              validate_first=True, keep_best=True, on_step=lambda *step: steps.append(step))
    # The point whose weights train_budgeted kept: the first of the lowest finite scores.
    kept = min(((v, i) for i, (_, v) in enumerate(curve) if math.isfinite(v)), default=None)
    return {"steps": len(steps), "best_step": None if kept is None else validated_at[kept[1]],
            "val_curve": [tuple(p) for p in curve]}
