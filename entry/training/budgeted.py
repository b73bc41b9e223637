# long file: one module holds the budgeted run's rules (clock, stop rule, schedules, the loop), which change together
"""Training a model for a wall-clock budget: the one implementation, each step the product's
`entry.training.step.train_step` (issue 31, "a fair race"; issue 48: bench/ trains through it).

Fair means the same rules for every model: only training time counts (data, forward, backward,
optimiser, EMA; validation does not); the learning rate is annealed to the budget (a function of
the fraction of the budget spent, so a short budget still ends annealed, as a long one does); the
run stops before a step that would not fit instead of overrunning; every model gets the same
options (EMA, schedule). Each piece is pure or takes what it touches (the clock, the batches, the
loss, the validation), so tests drive it with a fake clock.

The stop rule is the stage loop's (`entry.training.loop`, ``training.max_train_s``): no step starts
that its prediction says would end past the budget. They judge by different step times on
purpose: a stage decides one step ahead, by the step before (its flag rides on that step's one
all_reduce, so every rank agrees without another collective, and its step times include checkpoint
writes, which a maximum over all steps would carry into every later prediction); a budgeted run is
one process with no checkpoints, so it decides right before each step, by `predicted_step_s` over
all its steps (cautious: the slowest plus the spread).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from core.schedule import cosine_decay
from entry.distributed.process_group import DistInfo
from entry.stages.parts import StageParts
from entry.training.step import LoopSettings, train_step

SCHEDULES = ("cosine", "step", "constant")
"""Learning-rate schedules `train_budgeted` knows by name, all functions of the budget fraction."""
VALIDATIONS = 10
"""Validations per run when `train_budgeted` is not given ``validate_every_s`` (plus one at the end)."""


class BudgetClock:
    """Training time spent against a budget. Only time inside ``with clock.training():`` counts.

    Args:
        budget_s: seconds of training allowed (> 0; ``math.inf``: no time budget).
        clock: seconds as a float, monotone (default ``time.perf_counter``; tests pass a fake).
    """

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.perf_counter):
        if not budget_s > 0:
            raise ValueError(f"budget_s={budget_s} must be > 0")
        self.budget_s, self._clock, self._spent, self._since = float(budget_s), clock, 0.0, None

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Count the time of the block (also when it raises); ``spent`` moves when it ends."""
        self._since = self._clock()
        try:
            yield
        finally:
            self._spent += self._clock() - self._since
            self._since = None

    @property
    def spent(self) -> float:
        """Seconds counted so far (finished ``training()`` blocks)."""
        return self._spent

    @property
    def fraction_now(self) -> float:
        """`fraction`, counting the block in progress up to now (one clock reading)."""
        running = 0.0 if self._since is None else self._clock() - self._since
        return min(1.0, (self._spent + running) / self.budget_s)

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
    # The stages' cosine, with this floor: the rate itself decays to `final_ratio` of the peak
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
    # The tolerance: a step count's fraction k / (epochs * n) times epochs may round just below
    # the whole epoch k / n it stands for, which would halve one step late.
    epoch = math.floor(min(max(fraction, 0.0), 1.0) * epochs + 1e-9)
    return base_lr * gamma ** min(epoch // step_size, (epochs - 1) // step_size)


def budget_schedule(name: str, final_ratio: float = 0.0, warmup_fraction: float = 0.0
                    ) -> Callable[[float, float], float]:
    """``(base_lr, fraction) -> lr`` for a name of `SCHEDULES` (the ratio and warm-up are `cosine_lr`'s)."""
    if name == "cosine":
        return lambda base, f: cosine_lr(base, f, final_ratio, warmup_fraction)
    if name == "step":
        return step_lr_for_budget
    if name == "constant":
        return lambda base, f: base
    raise ValueError(f"schedule={name!r}; known: {list(SCHEDULES)}")


class BudgetLR(torch.optim.lr_scheduler.LRScheduler):
    """A learning rate that follows the fraction of the budget spent: ``lr_at(base_lr, fraction)``.

    `train_step` steps it after each optimizer step, inside the step's timed block, so the next
    step's rate is read from the clock as this one's update ends (``fraction_now``). With
    ``max_steps`` the fraction is also the steps done over ``max_steps``, whichever is larger
    (as the stages' `CosineSchedule` follows whichever of steps and time runs out first).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, lr_at: Callable[[float, float], float],
                 fraction_now: Callable[[], float], max_steps: int | None = None):
        self._lr_at, self._fraction_now, self._max_steps = lr_at, fraction_now, max_steps
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        fraction = self._fraction_now()
        if self._max_steps:
            fraction = max(fraction, self.last_epoch / self._max_steps)  # last_epoch: steps taken
        return [self._lr_at(base, fraction) for base in self.base_lrs]


class CurvePoint(NamedTuple):
    """One validation of a run."""

    train_s: float
    """Training seconds spent when it was taken."""
    value: float
    """The validation score (nRMSE: lower is better)."""


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


@torch.no_grad()
def _validated(validate: Callable[[nn.Module], float], net: nn.Module, model: nn.Module, spent: float) -> CurvePoint:
    """Score ``net`` (the live model or its average) in eval mode; the live model goes back to training."""
    net.eval()
    point = CurvePoint(spent, float(validate(net)))
    model.train()
    return point


def _loss_step(loss_fn: Callable[[nn.Module, Any], Tensor]) -> Callable:
    """A `StageParts.step_fn` of a loss ``(model, batch) -> loss``. Its batch is a list holding the
    one batch (`train_step` slices micro-batches off it; one micro-batch of one item is that list);
    no metrics besides the loss."""
    def step(model, named_params, batch, *, cfg, generator):
        return loss_fn(model, batch[0]), {}

    return step


def _copy_buffers(average: nn.Module, model: nn.Module) -> Callable[[], None]:
    """After each step: the average's buffers (BatchNorm's running statistics) copied from the model,
    not averaged: they are themselves an average, of the live weights' activations."""
    @torch.no_grad()
    def copy_() -> None:
        for mine, theirs in zip(average.buffers(), model.buffers()):
            mine.copy_(theirs)

    return copy_


def budgeted_parts(model: nn.Module, loss_fn: Callable[[nn.Module, Any], Tensor], scheduler: BudgetLR,
                   ema_decay: float | None) -> StageParts:
    """The `StageParts` of a budgeted run: ``loss_fn`` as its step, ``scheduler``'s optimizer, and with
    ``ema_decay`` a moving average (a copy of the model, never trained) updated by `train_step`."""
    average = None if ema_decay is None else copy.deepcopy(model).eval().requires_grad_(False)
    return StageParts("budgeted", model, _loss_step(loss_fn), None, None, scheduler.optimizer, scheduler,
                      ema=average, after_step=None if average is None else _copy_buffers(average, model))


def _settings(clip_grad_norm: float | None, ema_decay: float | None, seed: int | None) -> LoopSettings:
    """What `train_step` reads of a `LoopSettings` (the clip, the average's decay, the step generator's
    seed; autocast off); the stage loop's other fields do not apply to a budgeted run."""
    return LoopSettings(steps=0, per_rank_batch=1, accum_steps=1, grad_clip=clip_grad_norm or 0.0,
                        max_skips_in_a_row=0, checkpoint_every=1, keep_checkpoints=1, log_every=1,
                        seed=seed or 0, ema_decay=ema_decay or 0.0)


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


# long: one loop with its stopping rules in view; the step and the validation are helpers above.
def train_budgeted(model: nn.Module, next_batch: Callable[[], Any], loss_fn: Callable[[nn.Module, Any], Tensor],
                   budget_s: float, lr: float, *, clock: Callable[[], float] = time.perf_counter,
                   validate: Callable[[nn.Module], float] | None = None, validate_every_s: float | None = None,
                   validate_every_steps: int | None = None, validate_first: bool = False,
                   ema_decay: float | None = None, schedule: str | Callable[[float, float], float] = "cosine",
                   final_ratio: float = 0.0, warmup_fraction: float = 0.0, weight_decay: float = 0.0,
                   decoupled: bool = True, clip_grad_norm: float | None = None, seed: int | None = None,
                   max_steps: int | None = None, on_step: Callable[[int, float, float, float], None] | None = None,
                   keep_best: bool = False) -> tuple[nn.Module, list[CurvePoint]]:
    """Train ``model`` until the next step would not fit in ``budget_s`` seconds of training.

    Args:
        model: on its device, in any mode; trained in place.
        next_batch: ``() -> batch``, timed as training (loading is part of a model's cost).
        loss_fn: ``(model, batch) -> scalar loss``.
        budget_s: training seconds allowed (``math.inf``: none; then give ``max_steps``). Before
            each step after the first, `predicted_step_s` must fit in what is left; the first step
            always runs (there is nothing to predict from: a warning says when it alone overran).
        lr: base learning rate; each step uses ``schedule`` at the budget fraction spent before it.
        clock: seconds, as ``time.perf_counter`` (tests pass a fake).
        validate: ``(model) -> score`` (lower is better), called in eval mode under ``no_grad``,
            off the training clock, every ``validate_every_s`` training seconds (default: budget /
            `VALIDATIONS`) or, given, after every ``validate_every_steps``-th step, and once at the end.
        validate_first: validate the untrained weights too (a point at 0 s, a candidate of ``keep_best``).
        ema_decay: keep an exponential moving average of the weights (`train_step`'s, warmed up by
            `core.schedule.ema_decay_at`); validation and the returned model use it.
        schedule, final_ratio, warmup_fraction: the learning-rate schedule, a name of `SCHEDULES`
            (the ratio and warm-up are `cosine_lr`'s) or ``(base_lr, fraction) -> lr``.
        weight_decay, decoupled: AdamW's decoupled weight decay, or Adam's L2 (PDEBench: Adam, 1e-4).
        clip_grad_norm: clip the gradients' global norm to this value, when given.
        seed: seed for the RNGs the model draws from while training (dropout), in a fork: the
            caller's RNG state is untouched.
        max_steps: stop after this many steps at the latest; the schedule's fraction is then the
            larger of the budget's and the steps'.
        on_step: ``(step, train_s, lr, loss)`` after each step, off the clock (logging).
        keep_best: return the weights of the curve's lowest validation score (the first of equal
            ones) instead of the last: PDEBench's training scripts keep that checkpoint. Needs
            ``validate``; the copy is taken off the clock.

    Returns:
        The trained model (the average when ``ema_decay`` is given; with ``keep_best`` the
        weights it had at its best validation), in eval mode, and the validation curve (empty
        without ``validate``). A non-finite loss or gradient ends training early, with a warning:
        `train_step` skips that step, so the weights are those before it.
    """
    budget = BudgetClock(budget_s, clock)
    if not lr > 0 or (ema_decay is not None and not 0.0 < ema_decay < 1.0):
        raise ValueError(f"lr={lr} must be > 0 and ema_decay={ema_decay} in (0, 1) or None")
    every = budget_s / VALIDATIONS if validate_every_s is None else validate_every_s
    if not every > 0 or (keep_best and validate is None):
        raise ValueError(f"validate_every_s={validate_every_s} must be > 0, and keep_best needs validate")
    if (max_steps is not None and max_steps < 1) or (validate_every_steps is not None and validate_every_steps < 1):
        raise ValueError(f"max_steps={max_steps} and validate_every_steps={validate_every_steps} must be >= 1")
    if math.isinf(budget_s) and max_steps is None:
        raise ValueError("no time budget and no max_steps: the run would never end")
    lr_at = budget_schedule(schedule, final_ratio, warmup_fraction) if isinstance(schedule, str) else schedule
    optimizer = (torch.optim.AdamW if decoupled else torch.optim.Adam)(
        [p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    parts = budgeted_parts(model, loss_fn, BudgetLR(optimizer, lr_at, lambda: budget.fraction_now, max_steps),
                           ema_decay)
    settings, net = _settings(clip_grad_norm, ema_decay, seed), model if parts.ema is None else parts.ema
    device = _device(model)
    info = DistInfo(0, 1, 0, device, None, 0)  # one process: train_step's all_reduce is the identity
    curve: list[CurvePoint] = []
    step_times: list[float] = []
    validate_at = every
    kept = _Kept() if keep_best else None

    def validated_now() -> None:  # off the clock: a point on the curve, the weights kept if it is the lowest
        curve.append(_validated(validate, net, model, budget.spent))
        if kept is not None:
            kept.offer(net, curve[-1].value)

    def due() -> bool:
        if validate_every_steps is not None:
            return len(step_times) % validate_every_steps == 0
        return budget.spent >= validate_at

    model.train()
    optimizer.zero_grad(set_to_none=True)
    if validate is not None and validate_first:
        validated_now()
    with _seeded(seed, model):
        while ((not step_times or predicted_step_s(step_times) <= budget.remaining)
               and (max_steps is None or len(step_times) < max_steps)):
            before, step_lr = budget.spent, optimizer.param_groups[0]["lr"]
            with budget.training():
                result = train_step(parts, [next_batch()], len(step_times), settings, info, micro=1, accum=1)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # a CPU-GPU sync point: the clock must see the step's GPU work done
            step_times.append(budget.spent - before)
            loss = result.values[0]
            if on_step is not None:
                on_step(len(step_times), budget.spent, step_lr, loss)
            if result.skipped:
                warnings.warn(f"non-finite loss ({loss}) or gradient at step {len(step_times)}: the step is "
                              f"skipped and training stopped", stacklevel=2)
                break
            if validate is not None and due():
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
