"""A model trained for a wall-clock budget, keeping the weights of its best validation score: the
loop `bench.codec`'s learned corrections share (the grid codec's and the conv codec's)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def train_for_seconds(params: Sequence[Tensor], batch_loss: Callable[[], Tensor], val_score: Callable[[], float],
                      seconds: float, *, lr: float, due: Callable[[int, float, float], bool]) -> dict:
    """AdamW steps (no weight decay, gradient norm clipped at 1) on ``batch_loss()`` while less than
    `seconds` have passed; validation whenever ``due(step, seconds before the step, seconds after
    it)``; the parameters end at the best validated weights (step 0, the untrained ones, included).

    Returns {"steps", "best_step", "val_curve": [(seconds, val score)]}.
    """
    params = list(params)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    best = (val_score(), 0, [p.detach().clone() for p in params])
    curve, step, t0 = [(0.0, best[0])], 0, time.perf_counter()
    while (before := time.perf_counter() - t0) < seconds:
        loss = batch_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if due(step, before, time.perf_counter() - t0):
            v = val_score()
            curve.append((time.perf_counter() - t0, v))
            if v < best[0]:
                best = (v, step, [p.detach().clone() for p in params])
    with torch.no_grad():
        for p, b in zip(params, best[2]):
            p.copy_(b)
    return {"steps": step, "best_step": best[1], "val_curve": curve}
