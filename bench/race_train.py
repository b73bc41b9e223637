"""One peer's run of the race under a `bench.race_recipes.Recipe`: its loss, optimiser, schedule,
batches and the training loop's help, trained by the product's budgeted loop
(`entry.training.budgeted.train_budgeted`), scored here.

Per-channel normalisation (``recipe.normalise``): each channel's mean and std over the training
split (all trajectories, frames and points), fitted inside the run's budget (the fit and the
normalised copy of the training split are timed and taken off the budget the loop gets, and
counted in the run's ``train_s``). The model trains on normalised frames (its loss weighs every
channel alike); validation and test wrap it (`Normalised`) so that it maps physical frames to
physical frames, scored as every model is.

Legend: N trajectories, B batch, T time steps, C channels, S spatial axes, G given frames.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from bench.accuracy_scores import TaskFields, score_fno
from bench.budget import time_to_targets, train_budgeted
from bench.fno_baseline import fno_rollout_loss, fno_validate, one_step_loss, pushforward_loss
from bench.race_recipes import PDEBENCH_UNROLL, PUSHFORWARD_UNROLL, Recipe

PEER_LOSSES = ("one_step", "rollout", "pushforward", "pdebench_pushforward")
"""The peers' training losses: the teacher-forced one step (`bench.fno_baseline.one_step_loss`,
what our operator trains on), PDEBench's free rollout (`fno_rollout_loss`), a pushforward unroll
of `PUSHFORWARD_UNROLL` steps from a random window (`pushforward_loss`), and PDEBench's U-Net's
pushforward: the free rollout with gradient through its last `PDEBENCH_UNROLL` steps only."""


class Normalised(nn.Module):
    """``model`` between per-channel normalisation and its inverse: ``[B, G * C, *S]`` physical
    frames (time-major, as `bench.fno_baseline` stacks them) in, ``[B, C, *S]`` physical out."""

    def __init__(self, model: nn.Module, mean_C: Tensor, std_C: Tensor):
        super().__init__()
        self.model = model
        self.register_buffer("mean_C", mean_C)
        self.register_buffer("std_C", std_C)

    def forward(self, x: Tensor) -> Tensor:
        c = self.mean_C.numel()
        shape = (1, c) + (1,) * (x.ndim - 2)
        mean, std = self.mean_C.view(shape), self.std_C.view(shape)
        g = x.shape[1] // c
        x = ((x.unflatten(1, (g, c)) - mean.unsqueeze(1)) / std.unsqueeze(1)).flatten(1, 2)
        return self.model(x) * std + mean


def fit_normaliser(u_NTCS: Tensor) -> tuple[Tensor, Tensor]:
    """Each channel's mean and std over trajectories, frames and points of ``u`` ([C] each); a
    constant channel's std is 1 (nothing to scale)."""
    dims = [d for d in range(u_NTCS.ndim) if d != 2]
    mean, std = u_NTCS.mean(dim=dims), u_NTCS.std(dim=dims)
    return mean, torch.where(std > 1e-12, std, torch.ones_like(std))


def batch_stream(u_NTCS: Tensor, batch: int, device: torch.device, *, generator: torch.Generator
                 ) -> Callable[[], Tensor]:
    """``() -> [B, T, C, *S]`` on ``device``: shuffled epochs, every batch full (B = min(batch, N)),
    so a BatchNorm peer never sees a batch of one; an epoch's tail goes on into the next."""
    b = min(batch, u_NTCS.shape[0])
    pending: list[Tensor] = []

    def next_batch() -> Tensor:
        while sum(len(p) for p in pending) < b:
            pending.append(torch.randperm(u_NTCS.shape[0], generator=generator))
        order = torch.cat(pending)
        pending[:] = [order[b:]]
        return u_NTCS[order[:b]].to(device, non_blocking=True)

    return next_batch


def peer_loss(loss: str, given: int, *, seed: int) -> Callable[[nn.Module, Tensor], Tensor]:
    """``(model, u_BTCS) -> loss`` of a name of `PEER_LOSSES`; a window's starts drawn from ``seed``."""
    windows = torch.Generator().manual_seed(seed + 1)
    if loss == "rollout":
        return lambda m, u: fno_rollout_loss(m, u, given)
    if loss == "one_step":
        return lambda m, u: one_step_loss(m, u, given, generator=windows)
    if loss == "pdebench_pushforward":
        return lambda m, u: fno_rollout_loss(m, u, given, unroll=PDEBENCH_UNROLL)
    if loss == "pushforward":
        return lambda m, u: pushforward_loss(m, u, given, unroll=PUSHFORWARD_UNROLL, generator=windows)
    raise ValueError(f"loss={loss!r}; known: {list(PEER_LOSSES)}")


def kept_validation(curve, select: str) -> dict:
    """``{"select", "val_nrmse_kept"}``: the selection and the validation nRMSE of the weights it
    keeps from ``curve`` [(train_s, value)] (the last point's, or the lowest); a store's older
    records without them kept their last weights."""
    values = [v for _, v in curve]
    if not values:
        return {"select": select, "val_nrmse_kept": None}
    return {"select": select, "val_nrmse_kept": min(values) if select == "best" else values[-1]}


def targets(curve) -> dict[str, float | None]:
    """`bench.budget.time_to_targets` of ``curve``, keyed as the records write a target."""
    return {f"{t:g}": s for t, s in time_to_targets(curve).items()}


# long: one run's pieces (data, normaliser, loss, optimiser, schedule) in the order they apply
def train_peer(model: nn.Module, f: TaskFields, recipe: Recipe, *, budget_s: float, seed: int,
               val_every_s: float | None, device: torch.device, select: str = "last") -> dict:
    """Train ``model`` (a peer, built from ``seed``, on ``device``) on ``f`` under ``recipe`` for
    ``budget_s`` training seconds, keeping its last weights or (``select="best"``) those of its
    lowest validation. Returns its result: the recipe, training seconds (the normaliser's fit
    included) and steps, the validation curve and its times to `bench.budget.TARGETS`, the kept
    weights' validation, test scores (`bench.accuracy_scores.score_fno`). Validation and test roll
    out freely from physical frames."""
    clock = time.perf_counter()
    train, wrap = f.train, (lambda m: m)
    if recipe.normalise:  # on the model's clock: the fit and the normalised copy
        mean, std = fit_normaliser(f.train)
        dims = (1, 1, -1) + (1,) * (f.train.ndim - 3)
        train = (f.train - mean.view(dims)) / std.view(dims)
        mean, std = mean.to(device), std.to(device)
        wrap = lambda m: Normalised(m, mean, std)  # noqa: E731
    fit_s = time.perf_counter() - clock if recipe.normalise else 0.0
    head = {"recipe": recipe.as_dict(), "recipe_key": recipe.key(), "budget_s": budget_s, "seed": seed,
            "lr": recipe.lr, "loss": recipe.loss, "normalise_s": fit_s}
    if fit_s >= budget_s:
        return head | {"skipped": f"the normaliser's fit took {fit_s:.3g} s of a {budget_s:g} s budget"}
    steps = []
    net, curve = train_budgeted(
        model, batch_stream(train, recipe.batch, device, generator=torch.Generator().manual_seed(seed)),
        peer_loss(recipe.loss, f.given, seed=seed), budget_s - fit_s, recipe.lr, ema_decay=recipe.ema,
        schedule=recipe.schedule, warmup_fraction=recipe.warmup, clip_grad_norm=recipe.clip,
        validate=lambda m: fno_validate(wrap(m), f.val, f.given, batch_size=recipe.batch, device=device),
        validate_every_s=val_every_s, weight_decay=recipe.weight_decay, decoupled=recipe.optimizer == "adamw",
        seed=seed, on_step=lambda *step: steps.append(step), keep_best=select == "best")
    test = score_fno(wrap(net), f, f.test, device).summary()
    curve = [(fit_s + s, v) for s, v in curve]  # the clock counts the fit
    train_s = curve[-1][0]
    return head | {"schedule": recipe.schedule, "ema_decay": recipe.ema, "train_s": train_s,
                   "within_budget": train_s <= budget_s, "steps": len(steps),
                   "last_step_start_s": fit_s + steps[-2][1] if len(steps) > 1 else fit_s,
                   "params": sum(p.numel() for p in model.parameters()), "val_curve": [list(p) for p in curve],
                   "val_nrmse_final": curve[-1][1], **kept_validation(curve, select),
                   "time_to_targets": targets(curve), "test": test, "test_nrmse": test["nrmse"]}
