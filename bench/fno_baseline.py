# long file: PDEBench's FNO recipe in one place (model building, its losses: one step, free rollout, pushforward; its training and scoring), which change together
"""FNO baseline trained and rolled out as PDEBench does (groundwork for ``bench.accuracy``).

Legend: N samples, B batch, T time steps, C channels, S spatial axes (X or X, Y).
Trajectories are ``u_BTCS`` = ``[B, T, C, *S]`` (`pipelines.task_data.Trajectories.u`);
`core.metrics` wants ``[B, C, T, *S]``.

PDEBench facts used (pdebench/PDEBench):
- ``pdebench/models/fno/train.py`` (``training_type='autoregressive'``): the model sees
  the last ``initial_step`` frames and predicts the next; the prediction is appended and
  fed back (``xx = cat(xx[..., 1:, :], im)``) up to ``t_train`` (capped at T). Training
  back-propagates through this whole free-running rollout: no teacher forcing, no
  detach, no pushforward trick (``pushforward``/``unroll_step`` in the configs belong to
  its U-Net). The loss is the sum over predicted steps of ``MSELoss(reduction='mean')``
  on the batch-flattened frame. Adam(lr, weight_decay=1e-4); StepLR stepped once per
  epoch; the loader shuffles.
- ``pdebench/models/config/args/config_*.yaml``: modes 12, width 20, initial_step 10,
  batch_size 50, learning_rate 1e-3, scheduler_step 100, scheduler_gamma 0.5, epochs 500.

Ours, on purpose: training runs through the product's budgeted loop (`train_fno`), so a
wall-clock budget ends before a step that would not fit (not after the epoch that crosses it) and
anneals PDEBench's step schedule onto itself, as for every model of `bench.race`; validation
nRMSE (`core.metrics.nrmse`) scores predicted steps only (``given_steps=initial_step``; PDEBench's
issue #41), on a set the caller passes (docs/design.md, "Data flow": a slice of the training part,
never the test set).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from core.metrics import nrmse
from core.models.fno import FNO1d, FNO2d
from entry.training.budgeted import step_lr_for_budget, train_budgeted

__all__ = ["EpochRecord", "build_fno", "fno_one_step", "fno_rollout", "fno_rollout_loss", "fno_validate", "pushforward_loss",
           "train_fno"]

PDEBENCH_EPOCHS = 500
"""PDEBench's epochs (its configs' ``epochs``): a wall-clock run stretches its step schedule onto them."""


def _stack(window_BTCS: Tensor) -> Tensor:
    """[B, t, C, *S] -> [B, t * C, *S], time-major as PDEBench stacks ``[..., t, v]``."""
    return window_BTCS.flatten(1, 2)


def _as_float_tensor(u) -> Tensor:
    """A tensor or numpy array -> float32 tensor (no copy when it already is one)."""
    return (u if isinstance(u, Tensor) else torch.from_numpy(np.asarray(u))).float()


def _check(u_BTCS: Tensor, initial_step: int) -> None:
    if u_BTCS.ndim not in (4, 5):
        raise ValueError(f"expected u [B, T, C, X(, Y)], got {tuple(u_BTCS.shape)}")
    if not 1 <= initial_step <= u_BTCS.shape[1]:
        raise ValueError(f"initial_step={initial_step} must lie in [1, T={u_BTCS.shape[1]}]")


def fno_rollout(model: nn.Module, u_BTCS: Tensor, initial_step: int, *, t_stop: int | None = None,
                grad_from: int = 0) -> Tensor:
    """Autoregressive rollout: frames ``t < initial_step`` copied from ``u``, the rest predicted.

    Each prediction is fed back as the newest input frame (PDEBench's ``xx`` window).
    Gradients flow through the rollout unless the caller disables them.

    Args:
        model: maps ``[B, C * initial_step, *S] -> [B, C, *S]`` (`FNO1d`/`FNO2d`).
        u_BTCS: ``[B, T, C, *S]``; only frames ``< initial_step`` are read.
        initial_step: frames given.
        t_stop: frames in the result (default T); PDEBench's ``t_train``.
        grad_from: frames before this one are predicted without gradient (PDEBench's pushforward:
            its U-Net back-propagates through the last ``unroll_step`` predictions only).

    Returns:
        ``[B, t_stop, C, *S]``.
    """
    _check(u_BTCS, initial_step)
    t_stop = u_BTCS.shape[1] if t_stop is None else t_stop
    if not initial_step <= t_stop <= u_BTCS.shape[1]:
        raise ValueError(f"t_stop={t_stop} must lie in [initial_step={initial_step}, T={u_BTCS.shape[1]}]")
    frames = list(u_BTCS[:, :initial_step].unbind(1))
    grad = torch.is_grad_enabled()
    for t in range(initial_step, t_stop):
        window = torch.stack(frames[-initial_step:], dim=1)
        with torch.set_grad_enabled(grad and t >= grad_from):
            frames.append(model(_stack(window)))
    return torch.stack(frames, dim=1)


@torch.no_grad()
def fno_one_step(model: nn.Module, u_BTCS: Tensor, initial_step: int) -> Tensor:
    """Each frame ``t >= initial_step`` predicted from the ``initial_step`` true frames before it.

    Returns ``[B, T, C, *S]``; frames ``t < initial_step`` are zeros (nothing predicts them:
    score only ``t >= initial_step``).
    """
    _check(u_BTCS, initial_step)
    b, t = u_BTCS.shape[:2]
    out = torch.zeros_like(u_BTCS)
    if t > initial_step:
        windows = u_BTCS.unfold(1, initial_step, 1)[:, : t - initial_step]  # [B, t - g, C, *S, g]
        windows = windows.movedim(-1, 2).flatten(0, 1)  # [B * (t - g), g, C, *S]
        out[:, initial_step:] = model(_stack(windows)).unflatten(0, (b, t - initial_step))
    return out


def fno_rollout_loss(model: nn.Module, u_BTCS: Tensor, initial_step: int, *, t_train: int | None = None,
                     unroll: int | None = None) -> Tensor:
    """PDEBench's training loss on a batch of trajectories: the full free-running rollout (no
    teacher forcing), ``sum_{t = initial_step}^{t_train - 1} mean((pred_t - u_t)^2)``, each term
    the MSE over the batch and all points, as PDEBench's ``loss += loss_fn(im, y)``.

    Args:
        u_BTCS: ``[B, T, C, *S]`` on the model's device.
        t_train: last step + 1 trained (default T; PDEBench caps its ``t_train`` at T).
        unroll: PDEBench's U-Net pushforward (``pushforward: true``, ``unroll_step``): the steps
            before ``t_train - unroll`` are rolled out without gradient and left out of the sum.

    Raises:
        ValueError: no step to predict (``initial_step >= t_train``).
    """
    t_train = u_BTCS.shape[1] if t_train is None else min(t_train, u_BTCS.shape[1])
    if initial_step >= t_train:
        raise ValueError(f"initial_step={initial_step} leaves no step to predict before t_train={t_train}")
    first = initial_step if unroll is None else max(initial_step, t_train - unroll)
    pred = fno_rollout(model, u_BTCS, initial_step, t_stop=t_train, grad_from=first)
    err = (pred[:, first:] - u_BTCS[:, first:t_train]).square()
    # mean over batch and space per step, summed over steps
    return err.flatten(2).mean(dim=(0, 2)).sum()


def one_step_loss(model: nn.Module, u_BTCS: Tensor, initial_step: int, *, generator: torch.Generator) -> Tensor:
    """The teacher-forced one-step loss (what our operator trains on, offered to the peers): from
    each trajectory one window of ``initial_step`` true frames at a random start, the MSE of the
    model's next frame against the true one, over the batch and all points.

    Args:
        u_BTCS: ``[B, T, C, *S]`` on the model's device, T > initial_step.
        generator: a CPU generator drawing the window starts (the run's seed).
    """
    _check(u_BTCS, initial_step)
    B, T = u_BTCS.shape[:2]
    if T <= initial_step:
        raise ValueError(f"initial_step={initial_step} leaves no frame to predict in T={T}")
    start = torch.randint(0, T - initial_step, (B,), generator=generator).to(u_BTCS.device)
    rows = torch.arange(B, device=u_BTCS.device)[:, None]
    window = u_BTCS[rows, start[:, None] + torch.arange(initial_step + 1, device=u_BTCS.device)]
    return (model(_stack(window[:, :initial_step])) - window[:, initial_step]).square().mean()


def pushforward_loss(model: nn.Module, u_BTCS: Tensor, initial_step: int, *, unroll: int,
                     generator: torch.Generator) -> Tensor:
    """The pushforward loss (Brandstetter et al. 2022; PDEBench trains its U-Net with a pushforward
    unroll): from each trajectory one window of ``initial_step`` true frames at a random start,
    ``unroll - 1`` steps rolled out without gradient, then one step trained against the true frame
    after them (MSE over the batch and all points), so the model learns from its own drifted inputs
    at the cost of one backward step.

    Args:
        u_BTCS: ``[B, T, C, *S]`` on the model's device, T >= initial_step + unroll.
        unroll: steps from the true window to the trained one (1: the one-step loss).
        generator: a CPU generator drawing the window starts (the run's seed).
    """
    _check(u_BTCS, initial_step)
    B, T = u_BTCS.shape[:2]
    k = min(unroll, T - initial_step)  # a short trajectory unrolls what it has
    if k < 1:
        raise ValueError(f"initial_step={initial_step} leaves no frame to predict in T={T}")
    start = torch.randint(0, T - initial_step - k + 1, (B,), generator=generator).to(u_BTCS.device)
    rows = torch.arange(B, device=u_BTCS.device)[:, None]
    window = u_BTCS[rows, start[:, None] + torch.arange(initial_step + k, device=u_BTCS.device)]
    frames = list(window[:, :initial_step].unbind(1))
    with torch.no_grad():  # the pushforward: the model's own inputs, no gradient through them
        for _ in range(k - 1):
            frames.append(model(_stack(torch.stack(frames[-initial_step:], dim=1))))
    pred = model(_stack(torch.stack(frames[-initial_step:], dim=1)))
    return (pred - window[:, -1]).square().mean()


@torch.no_grad()
def fno_validate(model: nn.Module, u_NTCS: Tensor, initial_step: int, *, batch_size: int = 50,
                 device: torch.device | str = "cpu") -> float:
    """nRMSE of the full rollout over the predicted steps only (``given_steps=initial_step``)."""
    _check(u_NTCS, initial_step)
    if initial_step >= u_NTCS.shape[1]:
        raise ValueError(f"initial_step={initial_step} leaves no step to score in T={u_NTCS.shape[1]}")
    model.eval()
    preds = [fno_rollout(model, u_NTCS[i:i + batch_size].to(device), initial_step).cpu()
             for i in range(0, u_NTCS.shape[0], batch_size)]
    pred = torch.cat(preds)
    return nrmse(pred.transpose(1, 2), u_NTCS.cpu().transpose(1, 2), given_steps=initial_step).item()


def build_fno(u_NTCS: Tensor, initial_step: int, *, modes: int = 12, width: int = 20, seed: int = 0) -> nn.Module:
    """`FNO1d` or `FNO2d` for the data's spatial rank, initialised from ``seed`` only.

    The global RNG is seeded inside ``fork_rng``, so the caller's RNG state is untouched.
    """
    cls = {4: FNO1d, 5: FNO2d}.get(u_NTCS.ndim)
    if cls is None:
        raise ValueError(f"expected u [N, T, C, X(, Y)], got {tuple(u_NTCS.shape)}")
    with torch.random.fork_rng(devices=[]):  # parameters are drawn on the CPU
        torch.manual_seed(seed)
        return cls(initial_step, channels=u_NTCS.shape[2], modes=modes, width=width)


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochRecord:
    """One line of `train_fno`'s history."""

    epoch: int
    """0-based."""
    wall_s: float
    """Seconds since training started, at the end of this epoch (validation excluded)."""
    train_loss: float
    """Mean over the epoch's batches of `fno_rollout_loss` (summed over steps)."""
    lr: float
    """Learning rate used in this epoch."""
    val_nrmse: float | None
    """`fno_validate` after this epoch, or None when not evaluated."""


def _check_budget(epochs: int | None, wall_seconds: float | None, batch_size: int, val_every: int,
                  best_without_val: bool, n_train: int) -> None:
    if n_train == 0:
        raise ValueError("no training samples")
    if epochs is None and wall_seconds is None:
        raise ValueError("give epochs or wall_seconds")
    if epochs is not None and epochs < 1:
        raise ValueError(f"epochs={epochs} must be >= 1")
    if wall_seconds is not None and not wall_seconds > 0:
        raise ValueError(f"wall_seconds={wall_seconds} must be > 0")
    if best_without_val:
        raise ValueError("keep_best needs u_val_NTCS")
    if batch_size < 1 or val_every < 1:
        raise ValueError(f"batch_size={batch_size} and val_every={val_every} must be >= 1")


def _epoch_batches(u: Tensor, batch_size: int, shuffle: torch.Generator, device) -> Callable[[], Tensor]:
    """``() -> batch``: PDEBench's loader, epoch after epoch, each a fresh shuffle of ``u`` in batches
    of ``batch_size`` (the last of an epoch smaller when ``batch_size`` does not divide N)."""
    pending: list[Tensor] = []

    def next_batch() -> Tensor:
        if not pending:
            pending.extend(reversed(torch.randperm(u.shape[0], generator=shuffle).split(batch_size)))
        return u[pending.pop()].to(device, non_blocking=True)

    return next_batch


def _history(steps: list[tuple], validated: dict[int, float], per_epoch: int) -> list[EpochRecord]:
    """One `EpochRecord` per epoch begun, from `train_budgeted`'s ``(step, train_s, lr, loss)`` per
    step and ``{steps done: validation nRMSE}``."""
    records = []
    for epoch, first in enumerate(range(0, len(steps), per_epoch)):
        chunk = steps[first:first + per_epoch]
        records.append(EpochRecord(epoch=epoch, wall_s=chunk[-1][1], train_loss=float(np.mean([s[3] for s in chunk])),
                                   lr=chunk[0][2], val_nrmse=validated.get(first + len(chunk))))
    return records


def train_fno(u_train_NTCS, *, initial_step: int, epochs: int | None = None, wall_seconds: float | None = None,
              batch_size: int = 50, lr: float = 1e-3, weight_decay: float = 1e-4, step_size: int = 100,
              gamma: float = 0.5, modes: int = 12, width: int = 20, t_train: int | None = None,
              u_val_NTCS=None, val_every: int = 1, seed: int = 0, keep_best: bool = False,
              device: torch.device | str = "cpu", build=None) -> tuple[nn.Module, list[EpochRecord]]:
    """Train an FNO as PDEBench does, for ``epochs`` or ``wall_seconds`` of training, through the
    product's budgeted loop (`entry.training.budgeted.train_budgeted`, each step the stages'
    `train_step`): PDEBench's free-rollout loss (`fno_rollout_loss`), Adam with L2 weight decay,
    its step schedule (`step_lr_for_budget`) and its shuffling loader.

    Args:
        u_train_NTCS: ``[N, T, C, *S]`` trajectories (tensor or numpy array).
        initial_step: frames given (PDEBench configs: 10).
        epochs / wall_seconds: stop after this many epochs / before a step that would not fit
            in this many training seconds (validation excluded; whichever comes first; at least
            one is required). The schedule halves the rate every ``step_size`` of ``epochs``
            epochs, as PDEBench's ``StepLR`` stepped per epoch; on a wall-clock budget alone it
            is PDEBench's 500 epochs stretched onto the budget (`PDEBENCH_EPOCHS`).
        batch_size, lr, weight_decay, step_size, gamma, modes, width: PDEBench's defaults.
        t_train: steps trained per trajectory (default T).
        u_val_NTCS: optional validation trajectories, scored every ``val_every`` epochs
            and after the last step.
        seed: model initialisation (`build_fno`) and batch shuffling.
        keep_best: return the weights of the epoch with the lowest validation nRMSE
            (model selection on the validation set; needs ``u_val_NTCS``) instead of the last.
        device: where the model and batches live.
        build: ``build(u_train_NTCS, initial_step, seed=seed) -> nn.Module``, another model with
            the FNO's interface (``[B, C * initial_step, *S] -> [B, C, *S]``) trained the same way
            (default: `build_fno` with ``modes`` and ``width``).

    Returns:
        The trained model (in eval mode) and one `EpochRecord` per epoch begun (a wall-clock
        budget may end inside an epoch).
    """
    u = _as_float_tensor(u_train_NTCS)
    _check_budget(epochs, wall_seconds, batch_size, val_every, keep_best and u_val_NTCS is None, u.shape[0])
    _check(u, initial_step)
    val = None if u_val_NTCS is None else _as_float_tensor(u_val_NTCS)
    device = torch.device(device)
    model = (build_fno(u, initial_step, modes=modes, width=width, seed=seed) if build is None
             else build(u, initial_step, seed=seed)).to(device)
    per_epoch = math.ceil(u.shape[0] / batch_size)
    steps: list[tuple] = []
    validated: dict[int, float] = {}

    def validate(net: nn.Module) -> float:
        validated[len(steps)] = fno_validate(net, val, initial_step, batch_size=batch_size, device=device)
        return validated[len(steps)]

    model, _ = train_budgeted(
        model, _epoch_batches(u, batch_size, torch.Generator().manual_seed(seed), device),
        lambda net, batch: fno_rollout_loss(net, batch, initial_step, t_train=t_train),
        math.inf if wall_seconds is None else wall_seconds, lr,
        validate=None if val is None else validate, validate_every_steps=val_every * per_epoch,
        schedule=functools.partial(step_lr_for_budget, epochs=epochs or PDEBENCH_EPOCHS, step_size=step_size,
                                   gamma=gamma),
        weight_decay=weight_decay, decoupled=False, seed=seed,
        max_steps=None if epochs is None else epochs * per_epoch, on_step=lambda *step: steps.append(step),
        keep_best=keep_best)
    return model, _history(steps, validated, per_epoch)
