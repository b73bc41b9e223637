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

Ours, on purpose: validation nRMSE (`core.metrics.nrmse`) scores predicted steps only
(``given_steps=initial_step``; PDEBench's issue #41), on a set the caller passes (docs/design.md, "Data flow":
a slice of the training part, never the test set).
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from core.metrics import nrmse
from core.models.fno import FNO1d, FNO2d

__all__ = ["EpochRecord", "build_fno", "fno_one_step", "fno_rollout", "fno_train_step", "fno_validate", "train_fno"]


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


def fno_rollout(model: nn.Module, u_BTCS: Tensor, initial_step: int, *, t_stop: int | None = None) -> Tensor:
    """Autoregressive rollout: frames ``t < initial_step`` copied from ``u``, the rest predicted.

    Each prediction is fed back as the newest input frame (PDEBench's ``xx`` window).
    Gradients flow through the rollout unless the caller disables them.

    Args:
        model: maps ``[B, C * initial_step, *S] -> [B, C, *S]`` (`FNO1d`/`FNO2d`).
        u_BTCS: ``[B, T, C, *S]``; only frames ``< initial_step`` are read.
        initial_step: frames given.
        t_stop: frames in the result (default T); PDEBench's ``t_train``.

    Returns:
        ``[B, t_stop, C, *S]``.
    """
    _check(u_BTCS, initial_step)
    t_stop = u_BTCS.shape[1] if t_stop is None else t_stop
    if not initial_step <= t_stop <= u_BTCS.shape[1]:
        raise ValueError(f"t_stop={t_stop} must lie in [initial_step={initial_step}, T={u_BTCS.shape[1]}]")
    frames = list(u_BTCS[:, :initial_step].unbind(1))
    for _ in range(initial_step, t_stop):
        window = torch.stack(frames[-initial_step:], dim=1)
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


def fno_rollout_loss(model: nn.Module, u_BTCS: Tensor, initial_step: int, *, t_train: int | None = None) -> Tensor:
    """PDEBench's training loss on a batch of trajectories: the full free-running rollout (no
    teacher forcing), ``sum_{t = initial_step}^{t_train - 1} mean((pred_t - u_t)^2)``, each term
    the MSE over the batch and all points, as PDEBench's ``loss += loss_fn(im, y)``.

    Args:
        u_BTCS: ``[B, T, C, *S]`` on the model's device.
        t_train: last step + 1 trained (default T; PDEBench caps its ``t_train`` at T).

    Raises:
        ValueError: no step to predict (``initial_step >= t_train``).
    """
    t_train = u_BTCS.shape[1] if t_train is None else min(t_train, u_BTCS.shape[1])
    if initial_step >= t_train:
        raise ValueError(f"initial_step={initial_step} leaves no step to predict before t_train={t_train}")
    pred = fno_rollout(model, u_BTCS, initial_step, t_stop=t_train)
    err = (pred[:, initial_step:] - u_BTCS[:, initial_step:t_train]).square()
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


def fno_train_step(model: nn.Module, u_BTCS: Tensor, initial_step: int, optimizer: torch.optim.Optimizer,
                   *, t_train: int | None = None) -> float:
    """One PDEBench training step on a batch of trajectories (`fno_rollout_loss`, back-propagated
    end to end); returns the loss."""
    model.train()
    loss = fno_rollout_loss(model, u_BTCS, initial_step, t_train=t_train)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()  # a CPU-GPU sync point, once per step as in PDEBench


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
    """Mean over the epoch's batches of `fno_train_step`'s loss (summed over steps)."""
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


def _train_epoch(model: nn.Module, u: Tensor, initial_step: int, optimizer, batch_size: int,
                 shuffle: torch.Generator, t_train: int | None, device) -> list[float]:
    """One pass over ``u`` in shuffled batches (PDEBench's loader shuffles); the step losses."""
    order = torch.randperm(u.shape[0], generator=shuffle)
    return [fno_train_step(model, u[idx].to(device, non_blocking=True), initial_step, optimizer, t_train=t_train)
            for idx in order.split(batch_size)]


def _validate_epoch(model: nn.Module, val: Tensor, initial_step: int, batch_size: int, device, best,
                    keep_best: bool):
    """(validation nRMSE, best): with ``keep_best``, ``best`` (score, state dict, or None) is
    replaced when the score improves on it."""
    score = fno_validate(model, val, initial_step, batch_size=batch_size, device=device)
    if keep_best and (best is None or score < best[0]):
        best = (score, copy.deepcopy(model.state_dict()))  # neuraloperator's holds metadata too
    return score, best


def train_fno(u_train_NTCS, *, initial_step: int, epochs: int | None = None, wall_seconds: float | None = None,
              batch_size: int = 50, lr: float = 1e-3, weight_decay: float = 1e-4, step_size: int = 100,
              gamma: float = 0.5, modes: int = 12, width: int = 20, t_train: int | None = None,
              u_val_NTCS=None, val_every: int = 1, seed: int = 0, keep_best: bool = False,
              device: torch.device | str = "cpu", build=None) -> tuple[nn.Module, list[EpochRecord]]:
    """Train an FNO as PDEBench does, for ``epochs`` or until ``wall_seconds`` have passed.

    Args:
        u_train_NTCS: ``[N, T, C, *S]`` trajectories (tensor or numpy array).
        initial_step: frames given (PDEBench configs: 10).
        epochs / wall_seconds: stop after this many epochs / after the epoch that crosses
            this wall time (whichever comes first; at least one is required).
        batch_size, lr, weight_decay, step_size, gamma, modes, width: PDEBench's defaults.
        t_train: steps trained per trajectory (default T).
        u_val_NTCS: optional validation trajectories, scored every ``val_every`` epochs
            and after the last one.
        seed: model initialisation (`build_fno`) and batch shuffling.
        keep_best: return the weights of the epoch with the lowest validation nRMSE
            (model selection on the validation set; needs ``u_val_NTCS``) instead of the last.
        device: where the model and batches live.
        build: ``build(u_train_NTCS, initial_step, seed=seed) -> nn.Module``, another model with
            the FNO's interface (``[B, C * initial_step, *S] -> [B, C, *S]``) trained the same way
            (default: `build_fno` with ``modes`` and ``width``).

    Returns:
        The trained model (in eval mode) and one `EpochRecord` per epoch.
    """
    u = _as_float_tensor(u_train_NTCS)
    _check_budget(epochs, wall_seconds, batch_size, val_every, keep_best and u_val_NTCS is None, u.shape[0])
    _check(u, initial_step)
    val = None if u_val_NTCS is None else _as_float_tensor(u_val_NTCS)
    device = torch.device(device)
    model = (build_fno(u, initial_step, modes=modes, width=width, seed=seed) if build is None
             else build(u, initial_step, seed=seed)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=gamma)
    shuffle = torch.Generator().manual_seed(seed)

    history: list[EpochRecord] = []
    best: tuple[float, dict[str, Tensor]] | None = None
    elapsed, max_epochs = 0.0, (math.inf if epochs is None else epochs)
    for epoch in itertools.count():  # at least one epoch; `done` ends it
        start = time.perf_counter()
        losses = _train_epoch(model, u, initial_step, optimizer, batch_size, shuffle, t_train, device)
        elapsed += time.perf_counter() - start  # .item() in each step synchronised the device
        lr_used = scheduler.get_last_lr()[0]
        scheduler.step()
        done = epoch + 1 >= max_epochs or (wall_seconds is not None and elapsed >= wall_seconds)
        score = None
        if val is not None and (done or (epoch + 1) % val_every == 0):
            score, best = _validate_epoch(model, val, initial_step, batch_size, device, best, keep_best)
        history.append(EpochRecord(epoch=epoch, wall_s=elapsed, train_loss=float(np.mean(losses)),
                                   lr=lr_used, val_nrmse=score))
        if done:
            break
    if best is not None:
        model.load_state_dict(best[1])
    model.eval()
    return model, history
