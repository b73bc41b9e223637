# long file: one module holds the race's rules (clock, schedules, averaging, stop rule, the loop), which change together
"""Budgeted training: the pieces of a race that trains every model, at its best, for the same
wall-clock budget (issue 31, "a fair race").

Fair means the same rules for every model: only training time counts (data, forward, backward,
optimiser, EMA; validation does not); the learning rate is annealed to the budget (a function of
the fraction of the budget spent, so a short budget still ends annealed, as a long one does); the
run stops before a step that would not fit instead of overrunning; every model gets the same
options (EMA, schedule, a learning-rate sweep). Each piece is pure or takes what it touches (the
clock, the batches, the loss, the validation), so tests drive it with a fake clock.

A race re-run reuses what a crashed or interrupted one finished: `bench.result_store`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from core.schedule import cosine_decay, ema_decay_at

__all__ = [
    "SCHEDULES", "TARGETS", "VALIDATIONS", "BudgetClock", "CurvePoint", "best_lr", "cosine_lr", "ema_decay_at",
    "lr_sweep", "predicted_step_s", "step_lr_for_budget", "time_to_targets", "train_budgeted",
]

TARGETS = (0.1, 0.05, 0.02, 0.01)
"""Validation nRMSE targets whose time to reach the race reports."""
SCHEDULES = ("cosine", "step", "constant")
"""Learning-rate schedules `train_budgeted` knows, all functions of the budget fraction."""
VALIDATIONS = 10
"""Validations per run when `train_budgeted` is not given ``validate_every_s`` (plus one at the end)."""


class BudgetClock:
    """Training time spent against a budget. Only time inside ``with clock.training():`` counts.

    Args:
        budget_s: seconds of training allowed (> 0).
        clock: seconds as a float, monotone (default ``time.perf_counter``; tests pass a fake).
    """

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.perf_counter):
        if not budget_s > 0:
            raise ValueError(f"budget_s={budget_s} must be > 0")
        self.budget_s, self._clock, self._spent = float(budget_s), clock, 0.0

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Count the time of the block (also when it raises); ``spent`` moves when it ends."""
        start = self._clock()
        try:
            yield
        finally:
            self._spent += self._clock() - start

    @property
    def spent(self) -> float:
        """Seconds counted so far (finished ``training()`` blocks)."""
        return self._spent

    @property
    def remaining(self) -> float:
        """Budget left, never negative."""
        return max(0.0, self.budget_s - self._spent)

    @property
    def fraction(self) -> float:
        """``spent / budget`` clipped to [0, 1]."""
        return min(1.0, self._spent / self.budget_s)

    @property
    def exhausted(self) -> bool:
        """Whether the whole budget is spent."""
        return self._spent >= self.budget_s


def predicted_step_s(step_times: Sequence[float]) -> float:
    """A cautious estimate of the next step's time from those before (seconds; at least one).

    The slowest step so far plus the spread (slowest - fastest), the first step left out once
    there are others (it carries one-off costs: allocator growth, cuDNN autotuning, compilation).
    Not the mean: the mean under-predicts whenever steps slow down (a throttling GPU, a busy
    neighbour), and under-prediction is what overruns a budget, while over-prediction costs at
    most a few steps. Steady steps are predicted exactly (spread 0), so a budget of n steps runs n.
    """
    if not step_times:
        raise ValueError("no step time to predict from")
    seen = step_times[1:] or step_times
    return 2 * max(seen) - min(seen)


def cosine_lr(base_lr: float, fraction: float, final_ratio: float = 0.0, warmup_fraction: float = 0.0) -> float:
    """Learning rate at ``fraction`` of the budget: linear warm-up from 0, then half a cosine from
    ``base_lr`` down to ``base_lr * final_ratio``, reached exactly at fraction 1 (``cos(pi) = -1``)."""
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction={warmup_fraction} must lie in [0, 1)")
    f = min(max(fraction, 0.0), 1.0)
    if f < warmup_fraction:
        return base_lr * f / warmup_fraction
    # The product's cosine, with this race's floor: the rate itself decays to `final_ratio` of the peak
    # (the stages' schedule decays a factor to 0.1), so the race's numbers are what they were.
    progress = (f - warmup_fraction) / (1.0 - warmup_fraction)
    return cosine_decay(progress, peak=base_lr, floor=base_lr * final_ratio)


def step_lr_for_budget(base_lr: float, fraction: float, *, epochs: int = 500, step_size: int = 100,
                       gamma: float = 0.5) -> float:
    """PDEBench's ``StepLR(step_size=100, gamma=0.5)`` over its 500 epochs, stretched onto the budget.

    The budget fraction stands for the epoch (``fraction * epochs``), so the budget sees the same
    halvings at the same fractions as PDEBench's run: 4, at 0.2, 0.4, 0.6 and 0.8 (the fifth would
    fall after the last epoch, so fraction 1 keeps the fourth). Returns the learning rate.
    """
    epoch = math.floor(min(max(fraction, 0.0), 1.0) * epochs)
    return base_lr * gamma ** min(epoch // step_size, (epochs - 1) // step_size)


def _schedule(name: str, final_ratio: float, warmup_fraction: float) -> Callable[[float, float], float]:
    """``(base_lr, fraction) -> lr`` for a name of `SCHEDULES`."""
    if name == "cosine":
        return lambda base, f: cosine_lr(base, f, final_ratio, warmup_fraction)
    if name == "step":
        return step_lr_for_budget
    if name == "constant":
        return lambda base, f: base
    raise ValueError(f"schedule={name!r}; known: {list(SCHEDULES)}")


class CurvePoint(NamedTuple):
    """One validation of a run."""

    train_s: float
    """Training seconds spent when it was taken."""
    value: float
    """The validation score (nRMSE: lower is better)."""


class _Average:
    """Exponential moving average of a model's parameters, in a copy of the model.

    Buffers (BatchNorm's running statistics) are copied, not averaged: they are themselves an
    average, of the live weights' activations.
    """

    def __init__(self, model: nn.Module, decay: float):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.updates = decay, 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        weight = 1.0 - ema_decay_at(self.decay, self.updates)
        for mine, theirs in zip(self.model.parameters(), model.parameters()):
            mine.lerp_(theirs, weight)
        for mine, theirs in zip(self.model.buffers(), model.buffers()):
            mine.copy_(theirs)
        self.updates += 1


@contextlib.contextmanager
def _seeded(seed: int | None, model: nn.Module) -> Iterator[None]:
    """Fork the RNGs the model uses and seed them (dropout, ...); nothing when ``seed`` is None."""
    if seed is None:
        yield
        return
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _step(model, next_batch, loss_fn, optimizer, average, clip_grad_norm, on_cuda: bool) -> float:
    """One optimiser step (plus the EMA update); returns the loss."""
    loss: Tensor = loss_fn(model, next_batch())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip_grad_norm is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    optimizer.step()
    if average is not None:
        average.update(model)
    if on_cuda:
        torch.cuda.synchronize()  # a CPU-GPU sync point: the clock must see the step's GPU work done
    return loss.item()


class _Kept:
    """The weights of the lowest validation score offered so far (a copy on the weights' device)."""

    def __init__(self) -> None:
        self.score, self.state = math.inf, None

    @torch.no_grad()
    def offer(self, net: nn.Module, score: float) -> None:
        if score < self.score:  # NaN never is
            self.score, self.state = score, copy.deepcopy(net.state_dict())

    def restore(self, net: nn.Module) -> None:
        if self.state is not None:
            net.load_state_dict(self.state)


@torch.no_grad()
def _validated(validate: Callable[[nn.Module], float], net: nn.Module, model: nn.Module, spent: float) -> CurvePoint:
    """Score ``net`` (the live model or its average) in eval mode; the live model goes back to training."""
    net.eval()
    point = CurvePoint(spent, float(validate(net)))
    model.train()
    return point


# long: one loop with its stopping rules in view; the step and the validation are helpers above.
def train_budgeted(model: nn.Module, next_batch: Callable[[], Any], loss_fn: Callable[[nn.Module, Any], Tensor],
                   budget_s: float, lr: float, *, clock: Callable[[], float] = time.perf_counter,
                   validate: Callable[[nn.Module], float] | None = None, validate_every_s: float | None = None,
                   ema_decay: float | None = None, schedule: str = "cosine", final_ratio: float = 0.0,
                   warmup_fraction: float = 0.0, weight_decay: float = 0.0, decoupled: bool = True,
                   clip_grad_norm: float | None = None, seed: int | None = None,
                   on_step: Callable[[int, float, float, float], None] | None = None,
                   keep_best: bool = False) -> tuple[nn.Module, list[CurvePoint]]:
    """Train ``model`` until the next step would not fit in ``budget_s`` seconds of training.

    Args:
        model: on its device, in any mode; trained in place.
        next_batch: ``() -> batch``, timed as training (loading is part of a model's cost).
        loss_fn: ``(model, batch) -> scalar loss``.
        budget_s: training seconds allowed. Before each step after the first, `predicted_step_s`
            must fit in what is left; the first step always runs (there is nothing to predict from:
            a warning says when it alone overran).
        lr: base learning rate; each step uses ``schedule`` at the budget fraction spent before it.
        clock: seconds, as ``time.perf_counter`` (tests pass a fake).
        validate: ``(model) -> score`` (lower is better), called in eval mode under ``no_grad``,
            off the training clock, every ``validate_every_s`` training seconds (default: budget /
            `VALIDATIONS`) and once at the end.
        ema_decay: keep an exponential moving average of the weights (`ema_decay_at`); validation
            and the returned model use it.
        schedule, final_ratio, warmup_fraction: the learning-rate schedule (`SCHEDULES`; the
            ratio and warm-up are `cosine_lr`'s).
        weight_decay, decoupled: AdamW's decoupled weight decay, or Adam's L2 (PDEBench: Adam, 1e-4).
        clip_grad_norm: clip the gradients' global norm to this value, when given.
        seed: seed for the RNGs the model draws from while training (dropout), in a fork: the
            caller's RNG state is untouched.
        on_step: ``(step, train_s, lr, loss)`` after each step, off the clock (logging).
        keep_best: return the weights of the curve's lowest validation score (the first of equal
            ones) instead of the last: PDEBench's training scripts keep that checkpoint. Needs
            ``validate``; the copy is taken off the clock.

    Returns:
        The trained model (the average when ``ema_decay`` is given; with ``keep_best`` the
        weights it had at its best validation), in eval mode, and the
        validation curve (empty without ``validate``). A non-finite loss ends training early, with a warning.
    """
    budget = BudgetClock(budget_s, clock)
    if not lr > 0 or (ema_decay is not None and not 0.0 < ema_decay < 1.0):
        raise ValueError(f"lr={lr} must be > 0 and ema_decay={ema_decay} in (0, 1) or None")
    every = budget_s / VALIDATIONS if validate_every_s is None else validate_every_s
    if not every > 0 or (keep_best and validate is None):
        raise ValueError(f"validate_every_s={validate_every_s} must be > 0, and keep_best needs validate")
    lr_at = _schedule(schedule, final_ratio, warmup_fraction)
    optimizer = (torch.optim.AdamW if decoupled else torch.optim.Adam)(
        [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    average = None if ema_decay is None else _Average(model, ema_decay)
    net = model if average is None else average.model
    on_cuda = any(p.is_cuda for p in model.parameters())
    curve: list[CurvePoint] = []
    step_times: list[float] = []
    validate_at = every
    kept = _Kept() if keep_best else None

    def validated_now() -> None:  # off the clock: a point on the curve, the weights kept if it is the lowest
        curve.append(_validated(validate, net, model, budget.spent))
        if kept is not None:
            kept.offer(net, curve[-1].value)

    model.train()
    with _seeded(seed, model):
        while not step_times or predicted_step_s(step_times) <= budget.remaining:
            before, step_lr = budget.spent, lr_at(lr, budget.fraction)
            for group in optimizer.param_groups:
                group["lr"] = step_lr
            with budget.training():
                loss = _step(model, next_batch, loss_fn, optimizer, average, clip_grad_norm, on_cuda)
            step_times.append(budget.spent - before)
            if on_step is not None:
                on_step(len(step_times), budget.spent, step_lr, loss)
            if not math.isfinite(loss):
                warnings.warn(f"loss {loss} at step {len(step_times)}: training stopped", stacklevel=2)
                break
            if validate is not None and budget.spent >= validate_at:
                validated_now()
                validate_at = every * (math.floor(budget.spent / every) + 1)  # a long step skips, not repeats
    if validate is not None and (not curve or curve[-1].train_s != budget.spent):
        validated_now()
    if kept is not None:
        kept.restore(net)
    if budget.spent > budget.budget_s:
        warnings.warn(f"training took {budget.spent:.3g} s of a {budget_s:.3g} s budget: a step ran slower "
                      f"than predicted (steps: {len(step_times)})", stacklevel=2)
    return net.eval(), curve


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
