"""The race's training recipes and their choice on validation at each sweep rung (issue 51: every
model at its best on every rung).

A recipe is what a run is trained with besides its budget and seed (`Recipe`): the loss (one_step,
rollout, pushforward, pdebench_pushforward: `bench.race_train.PEER_LOSSES`), the learning rate, the batch of trajectories, the
optimiser and its weight decay, the schedule, and the training loop's help (per-channel
normalisation fitted on the training split, warm-up, gradient clipping, EMA).

A peer's candidates at a sweep rung (``--sweep-rungs``, default rungs 1 and 4 of the ladder):

- ``authors``: its authors' published recipe (`AUTHORS`) scaled to the budget (a StepLR's epochs
  stretched onto it: `entry.training.budgeted.step_lr_for_budget`), its rate swept;
- ``loop``: the race's default recipe with our training loop's help, once for each loss of
  ``--peer-loss`` and batch of ``--batches``: normalised (`bench.race_train`), AdamW with weight
  decay 1e-4, warm-up over `LOOP_WARMUP` of the budget then a cosine annealed to it, gradient
  norm clipped to `LOOP_CLIP`, the race's ``--ema``; its rate swept;
- the recipe the model chose at the sweep rung below, rate included, retrained at this budget
  (so its score here is never worse than that recipe's, up to seed noise).

Each rate sweep is the template's rate times ``--lr-sweep``, bracketed
(`bench.budget.bracketed_sweep`). A peer's trials at a sweep rung: ``|factors| x (1 + |losses| x
|batches|)``, plus the bracket's extensions, plus the lower rung's recipe (a trial already run is
reused: one key per recipe). Seed `SWEEP_SEED`, each trial recorded; the winner has the lowest
validation nRMSE of the weights it keeps (a diverged run never wins; on a tie the first tried).
Ours keeps its config's recipe (it has the loop's help already), its rate swept the same way, with
its lower rung's rate offered. A rung above the last sweep rung reuses the highest swept rung's
choice; every choice is recorded as ``<model>@<rung>@recipe`` (candidates, their validation, the
winner, the recipe offered from below).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from bench.budget import bracketed_sweep
from bench.result_store import finished, reuse_or_run

SWEEP_SEED = 0
"""The seed of every sweep trial (the chosen trial is then that rung's seed-0 run)."""
LOOP_WARMUP = 0.05
"""The loop template's warm-up: this fraction of the budget, then the cosine."""
LOOP_CLIP = 1.0
"""The loop template's gradient clip (global norm), as the stages' ``training.grad_clip`` default."""
LOOP_WEIGHT_DECAY = 1e-4
"""The loop template's AdamW weight decay (PDEBench's 1e-4)."""
PUSHFORWARD_UNROLL = 3
"""Steps of the pushforward loss: two rolled out without gradient, the third trained."""
PDEBENCH_UNROLL = 20
"""PDEBench's U-Net's ``unroll_step``: its pushforward back-propagates through the last 20 steps."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    """How one run trains, besides its budget and seed. Ours' (``name="config"``) sets only the
    rate and the EMA (the race's ``--ema``): the rest is its config's, and its other fields are
    not read."""

    name: str
    """``authors`` (`AUTHORS`), ``loop`` (`loop_recipe`) or ``config`` (ours: its config's)."""
    loss: str
    """A peer's loss (`bench.race_train.PEER_LOSSES`); ``config`` for ours."""
    lr: float
    """Base learning rate (the schedule's peak)."""
    batch: int | None = None
    """Trajectories per step; None for ours (its config's)."""
    optimizer: str = "adamw"
    """``adam`` (L2 weight decay, PDEBench's) or ``adamw`` (decoupled)."""
    weight_decay: float = LOOP_WEIGHT_DECAY
    """The optimiser's weight decay."""
    schedule: str = "cosine"
    """``cosine`` annealed to the budget, or ``step``: StepLR(100, 0.5) over 500 epochs stretched onto it."""
    normalise: bool = False
    """Per-channel mean and std fitted on the training split (its time on the model's clock)."""
    warmup: float = 0.0
    """Linear warm-up over this fraction of the budget (cosine only)."""
    clip: float | None = None
    """Gradient global-norm clip, or None."""
    ema: float | None = None
    """Weight-average decay, or None."""

    def key(self) -> str:
        """A name unique over the fields a race varies (the store key of its trial, `trial_key`)."""
        batch = "" if self.batch is None else f":b{self.batch}"
        ema = "" if self.ema is None else f":ema{self.ema:g}"
        return f"{self.name}:{self.loss}{batch}{ema}:lr={self.lr:.6g}"

    def as_dict(self) -> dict:
        """The recipe as a record's JSON object (`from_dict` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Recipe:
        """The recipe of `as_dict`'s object."""
        return cls(**d)


AUTHORS = {
    # PDEBench (pdebench/models/config/args): Adam 1e-3, weight decay 1e-4, StepLR(100, 0.5) over 500
    # epochs, batch 50; its FNO trains on the free rollout, its U-Net on the rollout with gradient
    # through the last unroll_step = 20 steps (pushforward: true).
    "fno": Recipe(name="authors", loss="rollout", lr=1e-3, batch=50, optimizer="adam", schedule="step"),
    "unet": Recipe(name="authors", loss="pdebench_pushforward", lr=1e-3, batch=50, optimizer="adam",
                   schedule="step"),
    # neuraloperator's config (config/opt.py, navier_stokes_config.py): AdamW 3e-4, weight decay 1e-4,
    # StepLR(100, 0.5), batch 8, inputs and outputs encoded (normalised); a one-step map. Its H1 loss is
    # not ours to offer: the one-step MSE stands in for it.
    "neuralop_fno": Recipe(name="authors", loss="one_step", lr=3e-4, batch=8, schedule="step", normalise=True),
    # No published recipe: the race's former default (free rollout, AdamW at the usual peak rate of
    # small ViTs, 3e-4, cosine annealed to the budget, PDEBench's batch).
    "plain_transformer": Recipe(name="authors", loss="rollout", lr=3e-4, batch=50),
}
"""Each peer's published recipe: the ``authors`` template, centre of its rate sweep."""


def loop_recipe(model: str, loss: str, batch: int, ema: float | None) -> Recipe:
    """The ``loop`` template of peer ``model``: our training loop's help with ``loss`` and ``batch``,
    at the rate of its authors' recipe (the centre of its sweep)."""
    return Recipe(name="loop", loss=loss, lr=AUTHORS[model].lr, batch=batch, normalise=True, warmup=LOOP_WARMUP,
                  clip=LOOP_CLIP, ema=ema)


def peer_templates(model: str, losses: list[str], batches: list[int], ema: float | None) -> list[Recipe]:
    """The templates whose rates a peer's sweep tries: its authors' recipe, then the loop's for each
    loss and batch (module docstring)."""
    return [AUTHORS[model], *(loop_recipe(model, loss, b, ema) for loss in losses for b in batches)]


def trial_key(model: str, rung: float, recipe: Recipe) -> str:
    """Store key of ``model``'s sweep trial of ``recipe`` at ``rung``."""
    return f"{model}@{rung:g}@{recipe.key()}"


def choice_key(model: str, rung: float) -> str:
    """Store key of ``model``'s recipe choice at sweep rung ``rung``."""
    return f"{model}@{rung:g}@recipe"


def sweep_rungs(rungs: list[float], asked: list[float]) -> list[float]:
    """The rungs of ``rungs`` that run a sweep: those of ``asked`` among them, and always the lowest."""
    rungs = sorted(rungs)
    return sorted({rungs[0], *(r for r in rungs if any(math.isclose(r, a) for a in asked))})


def chooser(rung: float, swept: list[float]) -> float:
    """The sweep rung whose choice ``rung`` trains with: itself, or the highest sweep rung below it."""
    return max(r for r in swept if r <= rung)


def kept_score(result: dict | None) -> float:
    """The validation nRMSE of the weights a run kept (older records: its last); inf for a run
    without one (skipped: its budget below its fixed cost) or a diverged one."""
    score = None if result is None else result.get("val_nrmse_kept", result.get("val_nrmse_final"))
    return math.inf if score is None or not math.isfinite(score) else score


def choose_at_rung(store, model: str, rung: float, run: Callable[[Recipe, int], dict], templates: list[Recipe],
                   factors: list[float], extensions: int, lower: Recipe | None, at: dict) -> Recipe:
    """The recipe of ``model`` at sweep rung ``rung``: each of ``templates`` at its rate times
    ``factors`` (bracketed, ``extensions`` more at most), and ``lower`` (the lower sweep rung's
    choice, if any), each trained by ``run(recipe, seed)`` at seed `SWEEP_SEED` and recorded under
    `trial_key`; the lowest `kept_score` wins. The choice is recorded under `choice_key` with ``at``
    (task, rung, budget, selection) and read back on a re-run. Returns the winner."""
    def sweep() -> dict:
        tried: dict[str, tuple[Recipe, float]] = {}

        def trial(recipe: Recipe) -> float:
            key = trial_key(model, rung, recipe)
            result = reuse_or_run(store, key, SWEEP_SEED, lambda: run(recipe, SWEEP_SEED))
            tried.setdefault(key, (recipe, kept_score(result)))
            return tried[key][1]

        for template in templates:
            bracketed_sweep(lambda lr, t=template: trial(dataclasses.replace(t, lr=lr)), template.lr, factors,
                            extensions=extensions)
        if lower is not None:
            trial(lower)  # a template's trial of the same recipe is reused, not run again
        finite = [(score, i, key) for i, (key, (_, score)) in enumerate(tried.items()) if math.isfinite(score)]
        if not finite:
            raise RuntimeError(f"{model} at rung {rung:g}: no candidate recipe gave a finite validation score")
        _, _, best = min(finite)
        return at | {"chosen": tried[best][0].as_dict(), "chosen_key": best,
                     "lower": None if lower is None else lower.as_dict(),
                     "templates": [t.as_dict() for t in templates], "factors": factors, "extensions": extensions,
                     "candidates": [{"key": k, "recipe": r.as_dict(), "val_nrmse_kept": None if math.isinf(s) else s}
                                    for k, (r, s) in tried.items()]}

    return Recipe.from_dict(reuse_or_run(store, choice_key(model, rung), SWEEP_SEED, sweep)["chosen"])


def recorded_choice(store, model: str, rung: float) -> dict | None:
    """The recorded choice of ``model`` at sweep rung ``rung`` (`choose_at_rung`), or None."""
    return finished(store, choice_key(model, rung), SWEEP_SEED)
