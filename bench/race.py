# long file: the race's command (manual, peers, ours through entry.pipeline), which change together
"""`python -m bench.race --config CFG [--set k=v] [--task-index I] --base-s B [--rungs 1,4,16]
[--models fno,unet,plain_transformer[,neuralop_fno][,ours]] [--seeds 0,1,2] [--seeds-at-top 0]
[--lr-sweep 0.3,1,3] [--lr-extensions 2] [--peer-loss rollout|one_step|rollout,one_step] [--ema DECAY|0] [--batch 50] [--val-every-s S] [--out FILE.jsonl] [--report FILE.md]
[--select last|best] [--ablation NAME KEY=VALUE [KEY=VALUE ...]] ...`

A fair race (issue 31): every model trained at its best for the same wall-clock budgets, a ladder
``B * rung`` seconds of training, on task ``I`` of the config (its files and split, as
bench.accuracy reads them: `bench.accuracy_scores.load_task_fields`). Reports test nRMSE
against budget and the training time at which each model's validation nRMSE reached fixed
targets (`bench.budget.TARGETS`).

Peers (fno, unet, plain_transformer, neuralop_fno: ``[B, C * initial_step, *S] -> [B, C, *S]``)
are trained by the product's budgeted loop (`entry.training.budgeted.train_budgeted`, each step the
stages' `train_step`; bench/ has no training loop of its own): only training time counts (validation is off the
clock), the learning rate follows a cosine annealed to the fraction of the budget spent (so every
rung ends annealed: a short budget is not a truncated long one), no step starts that would not
fit. The step is PDEBench's (`bench.fno_baseline`): batches of ``--batch`` training trajectories,
the given frames rolled out freely to the end, the loss summed over predicted steps; with
``--peer-loss one_step`` it is the teacher-forced one-step loss ours trains on instead (one random
window per trajectory: tens of times more steps per second); with ``--peer-loss rollout,one_step``
each peer's loss is chosen with its learning rate, the pair with the best validation. Each
peer's learning rate is its default (`PEERS`) times the best of ``--lr-sweep``, extended beyond
an edge while the best lies there (`bench.budget.bracketed_sweep`: ``--lr-extensions`` more rates at most), chosen
once on validation at the lowest rung with seed 0 and used at every rung and seed; that seed-0 lowest-rung
result is the chosen trial itself (the same model, budget, seed and rate). The plain transformer
is sized to the parameter count of our operator as the config builds it
(`core.models.plain_transformer.plain_transformer_args`). ``--ema`` gives every model the same
weight average (0: none); validation and test score the average. ``--select best`` gives every
model the weights of its lowest validation (PDEBench's scripts keep that checkpoint; ours:
``evaluation.select=best``) instead of its last; the sweep then compares the kept weights'
validation. A store's records all share one selection (a store of the other is refused).

``ours`` runs `python -m entry.pipeline` (stages autoencoder, cache, operator or steady, in a
subprocess each): a probe run of `PROBE_STEPS` steps measures our fixed cost (the stages before
the trained one, whole stage seconds from the pipeline summary: codec fit included) and our
seconds per step; each rung then trains under ``training.max_train_s`` = the budget less
`OURS_FIXED_SLACK` more than the probe's fixed cost (no step starts that would pass it) with
``training.anneal_to=time``: its cosine decays over that time budget, or over ``<stage>.steps`` =
`OURS_STEP_CAP` times the steps the probe says fit if those run out first, so it ends annealed on
a machine slower or faster than the probe's (`OURS_NOTE`); warm-up capped at a tenth of the
estimate, ``evaluation.select=last`` as the peers keep their last weights, ``training.seed`` the
race's seed. Its learning rate is the config's
times the best of the same ``--lr-sweep`` (and extensions), chosen like a peer's at the lowest rung
with seed 0. Its training time is the fixed cost plus the stage's ``train_wall_s`` (validation
excluded); the result records the steps that ran and whether it stayed within the budget (a fixed
cost above the allowance can still take it over: the report counts such runs). Single-task configs
only; each run has its own run folder ``<run_name>-race-r<rung>-s<seed>`` (an unfinished one is
started afresh).

``--ablation NAME KEY=VALUE ...`` (repeatable) adds the model ``ours-NAME``: ours with those config
overrides (e.g. ``no_stencil operator.pdet.token_conv=false``: one part of our design taken out),
probed for its own step time and trained on every rung like ours, at ours' chosen learning rate
(one change at a time: the ablation is not swept again). Its records carry the overrides; a store
holding ``ours-NAME`` made with others is refused.

Every result is one JSON line of ``--out`` (default bench/results/race-<task>.jsonl) keyed
``<model>@<rung>`` and seed (`bench.result_store`): a re-run trains only what is missing (a file
holding another task's or budget's records for those keys is refused). The
Markdown report (``--report``, default beside ``--out``) and its plot are `bench.race_report`'s:
per rung and model, test nRMSE over predicted steps (mean ± std over seeds, n), its ratio to the
best peer, and time to each target ("not reached" when no seed reached it).

Legend: N trajectories, B batch, T time steps, C channels, S spatial axes.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch
from torch import Tensor, nn

from bench.accuracy_scores import TaskFields, latent_models, load_task_fields, score_fno, score_latent
from bench.budget import VALIDATIONS, best_lr, bracketed_sweep, time_to_targets, train_budgeted
from bench.data_throughput import device_slug, git_commit
from bench.fno_baseline import build_fno, fno_rollout_loss, fno_validate, one_step_loss
from bench.peers import build_neuralop_fno, neuralop_available
from bench.race_report import OURS_NOTE, report, write_plot
from bench.result_store import finished, reuse_or_run
from core.models.plain_transformer import plain_transformer_args
from core.models.registry import build
from entry.config.cli import exits_on_user_error, load_resolved, parse_config
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.files import ensure_data
from entry.distributed.process_group import close_distributed, init_distributed
from entry.evaluation.task_frames import given_and_stride, task_label
from entry.stages.record import stage_spec
from entry.storage.run_folder import run_dir_for, stage_done_file

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("fno", "unet", "plain_transformer", "neuralop_fno", "ours")
SWEEP_SEED = 0
"""The learning-rate sweep's seed."""
PROBE_STEPS = 20
"""Steps of ours' probe run (the first is timed apart: it carries compilation and warm-up)."""
OURS_LOSSES = ["config"]
"""Ours trains on its config's loss: one recipe, its rate swept as the peers' are."""
OURS_STEP_CAP = 2.0
"""Ours' step count as a multiple of the probe's estimate: a cap that a machine slower than the
probe's never reaches (the time budget anneals and stops the stage), nor one faster by less than
this (a 20-step probe's estimate was off by up to 25% on a shared machine: at 1.25x the cap ended
Burgers runs at 86-88% of their budget)."""
OURS_FIXED_SLACK = 0.5
"""Ours' stage gets the budget less 1.5x the probe's fixed cost: the codec fit and the cache took
2.0 s in the advection probe and 2.5 s in a run after it, which took 4 of 6 runs 0.04-0.47 s past
their 60 s budget; the allowance keeps every run within it, at the price of ~1 s of ours' training."""
STEP_ANNEALED = "annealed to a step count estimated from the budget"
"""The schedule of ours' first races: annealed to the probe's estimate, stopped unannealed when the
machine ran slower. A store of such runs is refused (`check_store`)."""


# ----------------------------------------------------------------------------------------- peers


@dataclass(frozen=True, kw_only=True, slots=True)
class Peer:
    """A peer's recipe: how to build it and its default optimiser."""

    lr: float
    """Default learning rate, the centre of the sweep."""
    decoupled: bool
    """AdamW's decoupled weight decay (True) or Adam's L2 (PDEBench)."""
    build: Callable[[TaskFields, int, int], nn.Module]
    """``(fields, seed, params_target) -> model``, initialised from ``seed`` only."""
    weight_decay: float = 1e-4
    """PDEBench's 1e-4, for every peer."""


def _seeded(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # parameters are drawn on the CPU
        torch.manual_seed(seed)
        return make()


def _unet(f: TaskFields, seed: int, _: int) -> nn.Module:
    c, d = f.train.shape[2], f.train.ndim - 3
    return _seeded(seed, lambda: build("peer", f"unet{d}d", in_channels=c * f.given, out_channels=c))


def _plain_transformer(f: TaskFields, seed: int, params_target: int) -> nn.Module:
    c = f.train.shape[2]
    args = plain_transformer_args(params_target, in_channels=c * f.given, out_channels=c,
                                  grid=list(f.train.shape[3:]))
    return _seeded(seed, lambda: build("peer", "plain_transformer", **args))


PEERS = {
    # PDEBench's FNO and U-Net configs: Adam, learning rate 1e-3, weight decay 1e-4.
    "fno": Peer(lr=1e-3, decoupled=False, build=lambda f, seed, _: build_fno(f.train, f.given, seed=seed)),
    "unet": Peer(lr=1e-3, decoupled=False, build=_unet),
    # Trained as our FNO is in bench.accuracy.
    "neuralop_fno": Peer(lr=1e-3, decoupled=False,
                         build=lambda f, seed, _: build_neuralop_fno(f.train, f.given, seed=seed)),
    # 3e-4: the usual peak AdamW rate of small ViTs and GPTs; the default sweep spans 9e-5 to 9e-4.
    "plain_transformer": Peer(lr=3e-4, decoupled=True, build=_plain_transformer),
}


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


PEER_LOSSES = ("rollout", "one_step")
"""The peers' training losses (``--peer-loss``): PDEBench's free-running rollout
(`bench.fno_baseline.fno_rollout_loss`) or the teacher-forced one-step loss our operator trains on
(`bench.fno_baseline.one_step_loss`), many more steps per second."""


def train_peer(name: str, f: TaskFields, *, budget_s: float, lr: float, seed: int, params_target: int,
               batch: int, ema: float | None, val_every_s: float | None, device: torch.device,
               loss: str = "rollout", select: str = "last") -> dict:
    """Train peer ``name`` on ``f`` for ``budget_s`` training seconds with the loss ``loss``
    (`PEER_LOSSES`), keeping its last weights or (``select="best"``) those of its lowest validation;
    returns its result: training seconds and steps, the validation curve and its times to
    `bench.budget.TARGETS`, the kept weights' validation, test scores (`score_fno`). Validation and
    test always roll out freely."""
    peer = PEERS[name]
    model = peer.build(f, seed, params_target).to(device)
    steps = []
    windows = torch.Generator().manual_seed(seed + 1)  # the one-step loss's window starts
    batch_loss = ((lambda m, u: fno_rollout_loss(m, u, f.given)) if loss == "rollout" else
                  (lambda m, u: one_step_loss(m, u, f.given, generator=windows)))
    net, curve = train_budgeted(
        model, batch_stream(f.train, batch, device, generator=torch.Generator().manual_seed(seed)),
        batch_loss, budget_s, lr, ema_decay=ema, schedule="cosine",
        validate=lambda m: fno_validate(m, f.val, f.given, batch_size=batch, device=device),
        validate_every_s=val_every_s, weight_decay=peer.weight_decay, decoupled=peer.decoupled, seed=seed,
        on_step=lambda *step: steps.append(step), keep_best=select == "best")
    test = score_fno(net, f, f.test, device).summary()
    return {"model": name, "budget_s": budget_s, "seed": seed, "lr": lr, "loss": loss,
            "schedule": "cosine annealed to the budget",
            "ema_decay": ema, "train_s": curve[-1].train_s, "within_budget": curve[-1].train_s <= budget_s,
            "steps": len(steps), "last_step_start_s": steps[-2][1] if len(steps) > 1 else 0.0,
            "params": sum(p.numel() for p in model.parameters()), "val_curve": [list(p) for p in curve],
            "val_nrmse_final": curve[-1].value, **kept_validation(curve, select),
            "time_to_targets": _targets(curve), "test": test, "test_nrmse": test["nrmse"]}


SELECTS = ("last", "best")
"""Which weights a race run keeps: its last, or those of its lowest validation (``--select``)."""


def kept_validation(curve, select: str) -> dict:
    """``{"select", "val_nrmse_kept"}``: the selection and the validation nRMSE of the weights it
    keeps from ``curve`` [(train_s, value)] (the last point's, or the lowest); a store's older
    records without them kept their last weights."""
    values = [v for _, v in curve]
    if not values:
        return {"select": select, "val_nrmse_kept": None}
    return {"select": select, "val_nrmse_kept": min(values) if select == "best" else values[-1]}


def _kept_score(record: dict) -> float | None:
    return record.get("val_nrmse_kept", record.get("val_nrmse_final"))


def _targets(curve) -> dict[str, float | None]:
    return {f"{t:g}": s for t, s in time_to_targets(curve).items()}


def trial_key(name: str, loss: str, lr: float, losses: list[str]) -> str:
    """Store key of peer ``name``'s sweep trial at ``lr`` with ``loss``; a race of one loss keys by the
    rate alone, as stores of one loss always have."""
    return f"{name}@lr={lr:.6g}" if len(losses) == 1 else f"{name}@{loss}@lr={lr:.6g}"


def choose_recipe(store: Path, name: str, run: Callable[[str, float, int], dict], losses: list[str],
                  factors: list[float], at: dict, extensions: int, base_lr: float | None = None) -> tuple[str, float]:
    """The training loss and learning rate of model ``name``: for each of ``losses``, its default rate
    (``base_lr``, else the peer's `PEERS` one) times ``factors`` (extended while the best lies at an edge) trained by ``run(loss, lr, seed)``
    (seed `SWEEP_SEED`, each trial recorded); the pair with the lowest validation nRMSE of the weights
    each keeps (`kept_validation`). The
    choice is recorded as ``<name>@lr`` with ``at`` (where it was chosen) and read back on a re-run."""
    base = PEERS[name].lr if base_lr is None else base_lr

    def sweep_of(loss: str) -> dict[float, float]:
        def trial(lr: float) -> float:
            score = _kept_score(reuse_or_run(store, trial_key(name, loss, lr, losses), SWEEP_SEED,
                                             lambda: run(loss, lr, SWEEP_SEED)))
            return math.inf if score is None else score  # a skipped run (its budget below its fixed cost)
        return bracketed_sweep(trial, base, factors, extensions=extensions)

    def sweep() -> dict:
        scores = {loss: sweep_of(loss) for loss in losses}
        loss = min(losses, key=lambda k: min(scores[k].values()))
        table = lambda d: {f"{lr:.6g}": v for lr, v in sorted(d.items())}  # noqa: E731
        return at | {"loss": loss, "losses": losses, "lr": best_lr(scores[loss]), "base_lr": base,
                     "factors": factors, "extensions": extensions, "val_nrmse_final": table(scores[loss]),
                     "val_nrmse_final_by_loss": {k: table(v) for k, v in scores.items()}}

    choice = reuse_or_run(store, f"{name}@lr", SWEEP_SEED, sweep)
    return choice.get("loss", losses[0]), choice["lr"]


# ------------------------------------------------------------------------------------------ ours


def stage_seconds_from_log(text: str) -> dict[str, tuple[str, float]]:
    """Stage -> (status, seconds) from the last "pipeline summary:" of an entry.pipeline log
    (seconds to 0.1 s, as it prints them). A log without one is a RuntimeError."""
    if "pipeline summary:" not in text:
        raise RuntimeError("the pipeline log has no summary: the run did not finish")
    out = {}
    for line in text.rsplit("pipeline summary:", 1)[1].splitlines()[1:]:
        m = re.match(r"^\s+(\w+)\s+(.+?)\s+([0-9.]+) s$", line)
        if m is None:
            break
        out[m[1]] = (m[2], float(m[3]))
    return out


def steps_for_budget(budget_s: float, fixed_s: float, first_step_s: float, step_s: float) -> int:
    """Steps whose training fits ``budget_s``: the fixed cost, the first step (warm-up), then
    ``step_s`` per step. 0 when not even the first fits."""
    assert step_s > 0, step_s
    left = budget_s - fixed_s - first_step_s
    return 0 if left < 0 else 1 + math.floor(left / step_s)


def _ours_stage(steady: bool) -> str:
    """The stage ours trains on a steady task or a time-dependent one."""
    return "steady" if steady else "operator"


def _ours_config(args, more: list[str]) -> Config:
    return load_resolved(args.config, [*args.overrides, *more])


def run_pipeline(args, more: list[str]) -> tuple[Config, Path]:
    """Run entry.pipeline on the config with the race's ``more`` overrides in a subprocess (its
    own RNG, determinism settings and memory); returns (that run's config, its run folder).
    The folder, named by the race and unfinished (else its result would be recorded), is
    started afresh: a stage reused from an interrupted attempt would hide its time."""
    cfg = _ours_config(args, more)
    run_dir = run_dir_for(cfg)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the peers' cached blocks would otherwise stay out of the run's reach
    cmd = [sys.executable, "-m", "entry.pipeline", "--config", str(args.config)]
    cmd += [a for o in [*args.overrides, *more] for a in ("--set", o)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode == 2:
        raise ConfigError(f"ours: entry.pipeline refused the run: {(proc.stderr.strip().splitlines() or [''])[-1]}")
    if proc.returncode != 0:
        raise RuntimeError(f"ours: entry.pipeline exited {proc.returncode} (log {run_dir / 'rank0.log'}): "
                           f"{proc.stderr[-2000:]}")
    return cfg, run_dir


def ours_seconds(run_dir: Path, stage: str) -> dict[str, float]:
    """Training seconds of a finished race run of ours: each stage before ``stage`` whole (the
    pipeline summary), ``stage`` its ``train_wall_s`` (validation excluded)."""
    stages = stage_seconds_from_log((run_dir / "rank0.log").read_text())
    reused = [name for name, (status, _) in stages.items() if status != "done" and status != "not applicable"]
    if reused:
        raise RuntimeError(f"ours: stages {reused} of {run_dir} were not run here, so their time is unknown")
    seconds = {name: s for name, (status, s) in stages.items() if status == "done" and name != stage}
    done = orjson.loads(stage_done_file(run_dir, stage).read_bytes())
    return seconds | {stage: done["final_metrics"]["train_wall_s"]}


def _overrides(stage: str, steps: int, seed: int, ema: float, run_name: str, val_every: int,
               warmup: int, select: str = "last") -> list[str]:
    return [f"stages=[autoencoder,cache,{stage}]", f"{stage}.steps={steps}", f"{stage}.ema_decay={ema!r}",
            f"{stage}.warmup_steps={warmup}", f"training.seed={seed}", f"logging.run_name={run_name}",
            f"evaluation.val_every={val_every}", f"evaluation.select={select}"]


def _step_lines(run_dir: Path, stage: str) -> list[dict]:
    """The training metrics lines of ``stage`` in a run folder's metrics.jsonl, in step order."""
    return [rec for rec in map(orjson.loads, (run_dir / "metrics.jsonl").read_bytes().splitlines())
            if rec.get("stage") == stage and "loss" in rec]


def probe_ours(args, cfg: Config, f: TaskFields, name: str, ablation: tuple[str, ...] = ()) -> dict:
    """Our fixed cost and seconds per step, from a run of `PROBE_STEPS` steps without validation
    (of ours with the ``ablation`` overrides, when given: ``name`` then names the ablation's runs)."""
    stage = _ours_stage(f.steady)
    more = [*ablation, *_overrides(stage, PROBE_STEPS, SWEEP_SEED, args.ema, f"{name}-race-probe", 0,
                                   getattr(cfg, stage).warmup_steps), "logging.log_every=1"]
    _, run_dir = run_pipeline(args, more)
    seconds = ours_seconds(run_dir, stage)
    walls = [rec["train_wall_s"] for rec in _step_lines(run_dir, stage)]
    return {"probe_steps": len(walls), "fixed_s": sum(s for k, s in seconds.items() if k != stage),
            "first_step_s": walls[0], "step_s": (walls[-1] - walls[0]) / (len(walls) - 1), "run_dir": str(run_dir)}


def train_ours(args, cfg: Config, f: TaskFields, probe: dict, *, name: str, rung: float, budget_s: float,
               seed: int, lr: float, info, model: str = "ours", ablation: tuple[str, ...] = ()) -> dict:
    """Our run for one rung, seed and learning rate, annealed to what the probe's fixed cost leaves
    of ``budget_s`` (`OURS_NOTE`), trained by entry.pipeline, scored here on the test split as
    bench.accuracy scores ours. ``model`` and ``ablation``: an ablation of ours (``ours-NAME`` and
    its config overrides; ``name`` then names the ablation's runs)."""
    stage = _ours_stage(f.steady)
    fixed_s = (1 + OURS_FIXED_SLACK) * probe["fixed_s"]
    estimate = steps_for_budget(budget_s, fixed_s, probe["first_step_s"], probe["step_s"])
    head = {"model": model, **({"ablation": list(ablation)} if ablation else {}), "budget_s": budget_s, "seed": seed,
            "schedule": OURS_NOTE, "estimated_steps": estimate, "step_cap": OURS_STEP_CAP,
            "fixed_allowance_s": fixed_s, "probe": probe}
    if estimate < 1:
        return head | {"skipped": f"the budget {budget_s:g} s is below our fixed cost's allowance {fixed_s:.3g} s "
                                  f"plus a first step {probe['first_step_s']:.3g} s"}
    steps = math.ceil(OURS_STEP_CAP * estimate)
    warmup = min(getattr(cfg, stage).warmup_steps, estimate // 10)
    more = [*ablation, *_overrides(stage, steps, seed, args.ema, f"{name}-race-r{rung:g}-s{seed}-lr{lr:.3g}",
                                   max(1, estimate // VALIDATIONS), warmup, args.select)]
    # The stage's own clock may use what the fixed cost's allowance leaves of the budget, its schedule annealed to it.
    more += [f"training.max_train_s={budget_s - fixed_s!r}", "training.anneal_to=time", f"{stage}.lr={lr!r}"]
    run_cfg, run_dir = run_pipeline(args, more)
    seconds = ours_seconds(run_dir, stage)
    from bench.accuracy import validation_curves  # matplotlib and the stage runner: only ours needs them

    curve = validation_curves(run_cfg, seconds).get(f.key, {}).get(stage, [])
    ae, variants_of = latent_models(run_cfg, info)
    test = score_latent(f, f.test, ae, variants_of(f.steady, f.index)[stage], info.device).summary()
    train_s = sum(seconds.values())
    return head | {"steps": steps, "steps_run": _step_lines(run_dir, stage)[-1]["step"], "warmup_steps": warmup, "lr": getattr(run_cfg, stage).lr,
                   "ema_decay": args.ema or None, "train_s": train_s, "stage_seconds": seconds,
                   "within_budget": train_s <= budget_s, "params": _params(run_cfg, stage),
                   "val_curve": [list(p) for p in curve],
                   "val_nrmse_final": curve[-1][1] if curve else None, **kept_validation(curve, args.select),
                   "time_to_targets": _targets(curve),
                   "test": test, "test_nrmse": test["nrmse"], "run_dir": str(run_dir)}


def _params(cfg: Config, stage: str) -> int:
    """Parameters of the config's ``stage`` model (our operator, or the steady model)."""
    return sum(p.numel() for p in stage_spec(stage).model(cfg).parameters())


# ------------------------------------------------------------------------------------------- cli


def _numbers(text: str, what: str, kind=float) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{what} {text!r}: give a comma-separated list of numbers") from None
    if not values:
        raise ConfigError(f"{what} is empty: give a comma-separated list, e.g. 1,4,16")
    return values


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task-index", type=int, default=0, help="the config's task to race on")
    p.add_argument("--base-s", type=float, required=True, help="training seconds of rung 1")
    p.add_argument("--rungs", default="1,4,16", help="budgets as multiples of --base-s")
    p.add_argument("--models", default="fno,unet,plain_transformer", help=f"any of {', '.join(MODELS)}")
    p.add_argument("--seeds", default="0", help="training seeds (model initialisation, batches)")
    p.add_argument("--seeds-at-top", default=None, help="seeds at the highest rung (default: --seeds)")
    p.add_argument("--lowest-only", default="", help="models of --models trained at the lowest rung only "
                   "(e.g. neuralop_fno: a second FNO where the budget is short)")
    p.add_argument("--lr-sweep", default="0.3,1,3", help="factors of each peer's default learning rate")
    p.add_argument("--lr-extensions", type=int, default=2,
                   help="rates tried beyond an edge of the sweep while the best lies there")
    p.add_argument("--peer-loss", default="rollout",
                   help="the peers' training loss, PDEBench's free rollout or the teacher-forced one_step; a "
                        "comma list (rollout,one_step) chooses each peer's loss with its rate on validation")
    p.add_argument("--ema", type=float, default=0.0, help="weight-average decay for every model (0: none)")
    p.add_argument("--batch", type=int, default=50, help="peers' batch of trajectories (PDEBench: 50)")
    p.add_argument("--val-every-s", type=float, default=None, help="training seconds between validations "
                   f"(default: the budget / {VALIDATIONS})")
    p.add_argument("--out", type=Path, default=None,
                   help="results, JSON lines (default bench/results/race-<task>.jsonl)")
    p.add_argument("--report", type=Path, default=None, help="Markdown report (default: --out with .md)")
    p.add_argument("--select", default="last", choices=SELECTS,
                   help="every model's kept weights: its last, or those of its lowest validation (PDEBench's)")
    p.add_argument("--ablation", nargs="+", action="append", default=[], metavar="NAME KEY=VALUE",
                   help="the model ours-NAME: ours with these config overrides, at ours' rate (repeatable)")


def race_grid(models: list[str], rungs: list[float], seeds: list[int], top: list[int],
              lowest_only: list[str] = ()) -> list[tuple[float, str, list[int]]]:
    """The runs of a race as [(rung, model, seeds)], rung by rung from the lowest: ``top`` seeds at the
    highest rung, ``seeds`` below it; a model of ``lowest_only`` at the lowest rung alone."""
    rungs = sorted(rungs)
    return [(rung, model, top if rung == rungs[-1] else seeds) for rung in rungs
            for model in models if rung == rungs[0] or model not in lowest_only]


def _names(text: str) -> list[str]:
    """The names of a comma list, in order, each once."""
    return list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))


def race_keys(stage: str) -> set[str]:
    """The config keys the race sets in every run of ours (an ablation may not set them)."""
    keys = [o.split("=", 1)[0] for o in _overrides(stage, 1, 0, 0.0, "name", 1, 0)]
    return {*keys, "training.max_train_s", "training.anneal_to", f"{stage}.lr", "logging.log_every"}


def _ablations(cfg: Config, args) -> dict[str, tuple[str, ...]]:
    """``{ours-NAME: overrides}`` of the ``--ablation`` arguments, each checked against the config
    (a wrong key or value is the loader's ConfigError), or a ConfigError."""
    out = {}
    stage = _ours_stage(cfg.data.tasks[args.task_index].spec.steady)
    for name, *overrides in args.ablation:
        model = f"ours-{name}"
        if not re.fullmatch(r"[a-z0-9_]+", name) or model in out:
            raise ConfigError(f"--ablation {name}: give each ablation its own name of a-z, 0-9 and _")
        if not overrides or any("=" not in o for o in overrides):
            raise ConfigError(f"--ablation {name}: give its config overrides as KEY=VALUE after the name")
        taken = sorted({o.split("=", 1)[0] for o in overrides} & race_keys(stage))
        if taken:
            raise ConfigError(f"--ablation {name}: the race sets {', '.join(taken)} in every run of ours; "
                              "leave it out of the ablation")
        load_resolved(args.config, [*args.overrides, *overrides])
        out[model] = tuple(overrides)
    return out


def _checked(cfg: Config, args) -> tuple[list[str], list[tuple[float, str, list[int]]], list[float], list[str],
                                        dict[str, tuple[str, ...]]]:
    """(models, the race's grid (`race_grid`), sweep factors, peer losses, ablations (`_ablations`))
    from the arguments, or a ConfigError."""
    models = _names(args.models)
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise ConfigError(f"--models {args.models!r}: unknown {unknown}; choose from {', '.join(MODELS)}")
    if not 0 <= args.task_index < len(cfg.data.tasks):
        raise ConfigError(f"--task-index {args.task_index}: the config has {len(cfg.data.tasks)} task(s)")
    ablations = _ablations(cfg, args)
    if ablations and "ours" not in models:
        raise ConfigError("--ablation trains variants of ours at ours' rate: add ours to --models")
    models += list(ablations)
    lowest_only = _names(args.lowest_only)
    stray = [m for m in lowest_only if m not in models]
    if stray:
        raise ConfigError(f"--lowest-only names {', '.join(stray)}, not in --models {args.models}: add them there")
    if "neuralop_fno" in models and not neuralop_available():
        raise ConfigError("--models neuralop_fno needs the package neuraloperator (pip install -e '.[peers]')")
    rungs, factors = _numbers(args.rungs, "--rungs"), _numbers(args.lr_sweep, "--lr-sweep")
    seeds = _numbers(args.seeds, "--seeds", int)
    top = seeds if args.seeds_at_top is None else _numbers(args.seeds_at_top, "--seeds-at-top", int)
    if min(rungs) <= 0 or min(factors) <= 0 or not args.base_s > 0 or args.batch < 1 or args.lr_extensions < 0:
        raise ConfigError("--base-s, --rungs and --lr-sweep take positive numbers, --batch an integer >= 1, "
                          "--lr-extensions one >= 0")
    if not 0.0 <= args.ema < 1.0 or (args.val_every_s is not None and not args.val_every_s > 0):
        raise ConfigError(f"--ema {args.ema} must lie in [0, 1) and --val-every-s be > 0")
    if "ours" in models and (len(cfg.data.tasks) != 1 or given_and_stride(cfg.data.tasks[0], cfg)[1] != 1):
        raise ConfigError("ours in the race needs a single-task config with operator.horizon=1")
    losses = _names(args.peer_loss)
    if not losses or any(x not in PEER_LOSSES for x in losses):
        raise ConfigError(f"--peer-loss {args.peer_loss!r}: give one or more of {', '.join(PEER_LOSSES)}")
    if losses != ["rollout"] and cfg.data.tasks[args.task_index].spec.steady:
        raise ConfigError(f"--peer-loss {args.peer_loss}: a steady task's peers map coefficient to solution "
                          "in one step; leave --peer-loss out")
    return models, race_grid(models, sorted(set(rungs)), seeds, top, lowest_only), factors, losses, ablations


def check_store(store: Path, grid: list[tuple[float, str, list[int]]], base_s: float, task: str,
                losses: tuple[str, ...] | list[str] = ("rollout",),
                ablations: dict[str, tuple[str, ...]] | None = None, select: str = "last") -> None:
    """Refuse (ConfigError) a result file whose records for this race's keys were made on another
    task or budget (``<model>@<rung>`` names a multiple of --base-s), or keeping other weights
    than ``select`` (records without a selection kept their last), ours trained on another
    schedule, an ablation of ours with other overrides than ``ablations``' (model -> overrides), a
    peer's trained with a loss outside ``losses``, a peer's choice made among other losses, or a
    rung's run at a rate other than its model's recorded choice (ours' for an ablation; a choice
    made again, e.g. with more --lr-extensions, after the rungs ran): they would be reused as this
    race's."""
    losses, ablations = list(losses), ablations or {}
    keys = [(f"{m}@{r:g}", m, s, base_s * r) for r, m, seeds in grid for s in seeds]
    keys += [(f"{m}@lr", m, SWEEP_SEED, base_s * min(r for r, _, _ in grid)) for m in {m for _, m, _ in grid}]
    for key, model, seed, budget in keys:
        r = finished(store, key, seed)
        if r is None or "task" not in r:
            continue
        if r["task"] != task or not math.isclose(r["budget_s"], budget):
            raise ConfigError(f"{store} holds {key} seed {seed} for task {r['task']} at {r['budget_s']:g} s, not "
                              f"{task} at {budget:g} s: give another --out")
        if r.get("select", "last") != select:
            raise ConfigError(f"{store} holds {key} seed {seed} keeping its {r.get('select', 'last')} weights, not "
                              f"--select {select}: give another --out")
        if model in ablations and tuple(r.get("ablation", ())) != ablations[model]:
            raise ConfigError(f"{store} holds {key} seed {seed} made with the overrides {r.get('ablation')}, not "
                              f"{list(ablations[model])}: name the ablation anew, or give another --out")
        chooser = "ours" if model in ablations else model
        choice = None if key.endswith("@lr") else finished(store, f"{chooser}@lr", SWEEP_SEED)
        if choice is not None and r.get("lr") is not None and not math.isclose(r["lr"], choice["lr"]):
            raise ConfigError(f"{store} holds {key} seed {seed} trained at lr {r['lr']:.6g}, not at the recorded "
                              f"choice {choice['lr']:.6g}: remove that model's rung records, or give another --out")
        if key.startswith("ours"):
            if r.get("schedule") == STEP_ANNEALED:
                raise ConfigError(f"{store} holds {key} seed {seed} trained with another schedule ({r['schedule']}), "
                                  f"not {OURS_NOTE!r}: give another --out")
            continue
        if key.endswith("@lr"):  # a choice: among the losses it records, else its chosen trial's one
            chosen = finished(store, f"{key}={r['lr']:.6g}", SWEEP_SEED) or {}
            among = r.get("losses", [chosen.get("loss", "rollout")])
            if among != losses:
                raise ConfigError(f"{store} holds {key} chosen among the losses {','.join(among)}, not --peer-loss "
                                  f"{','.join(losses)}: give another --out")
        elif r.get("loss", "rollout") not in losses:
            raise ConfigError(f"{store} holds {key} seed {seed} trained with the {r.get('loss', 'rollout')} loss, not "
                              f"--peer-loss {','.join(losses)}: give another --out")


def race(cfg: Config, args, store: Path, models: list[str], grid: list, factors: list[float], info,
         losses: list[str] | None = None, ablations: dict[str, tuple[str, ...]] | None = None) -> str:
    """Train and record in ``store`` everything of ``grid`` [(rung, model, seeds)] missing (``ablations``:
    ours-NAME -> its overrides, `_ablations`); returns the report."""
    device = info.device
    ensure_data(cfg)
    f = load_task_fields(cfg, args.task_index)
    name = cfg.logging.run_name or Path(args.config).stem
    target = _params(cfg, _ours_stage(f.steady)) if "plain_transformer" in models else 0  # its size
    commit, dirty = git_commit()
    stamp = {"task": f.key, "device": device_slug(device), "git_commit": commit, "dirty": dirty,
             "torch": torch.__version__, "config": str(args.config), "overrides": list(args.overrides)}
    ema = args.ema or None

    losses = losses or ["rollout"]

    def run_peer(model: str, rung: float, loss: str, lr: float, seed: int) -> dict:
        print(f"race: {model} at {rung:g} x {args.base_s:g} s, {loss} loss, lr {lr:.3g}, seed {seed}", flush=True)
        out = train_peer(model, f, budget_s=args.base_s * rung, lr=lr, seed=seed, params_target=target,
                         batch=args.batch, ema=ema, val_every_s=args.val_every_s, device=device, loss=loss,
                         select=args.select)
        sized = {"params_target": target} if model == "plain_transformer" else {}
        return out | {"rung": rung} | sized | stamp

    lowest = grid[0][0]
    at = {"task": f.key, "rung": lowest, "budget_s": args.base_s * lowest, "select": args.select}
    ablations = ablations or {}
    ours_like = {"ours": (), **ablations} if "ours" in models else {}  # model -> its overrides of the config
    recipes = {m: choose_recipe(store, m, lambda loss, lr, s, m=m: run_peer(m, lowest, loss, lr, s), losses, factors,
                                at, args.lr_extensions) for m in models if m not in ours_like}

    runs_of = {m: name if m == "ours" else f"{name}-{m}" for m in ours_like}  # their run folders' prefix
    probes = {m: reuse_or_run(store, f"{m}@probe", SWEEP_SEED, lambda m=m: probe_ours(args, cfg, f, runs_of[m],
                                                                                     ours_like[m]))
              for m in ours_like}

    def run_ours(rung: float, lr: float, seed: int, model: str = "ours") -> dict:
        return train_ours(args, cfg, f, probes[model], name=runs_of[model], rung=rung, budget_s=args.base_s * rung,
                          seed=seed, lr=lr, info=info, model=model, ablation=ours_like[model]) | {"rung": rung} | stamp

    if ours_like:
        recipes["ours"] = choose_recipe(store, "ours", lambda _, lr, s: run_ours(lowest, lr, s), OURS_LOSSES,
                                        factors, at, args.lr_extensions, base_lr=getattr(cfg, _ours_stage(f.steady)).lr)

    def one(model: str, rung: float, seed: int) -> dict:
        if model in ablations:  # at ours' rate, trained at every rung and seed
            return run_ours(rung, recipes["ours"][1], seed, model)
        loss, lr = recipes[model]
        if rung == lowest and seed == SWEEP_SEED:  # the chosen sweep trial is this very run
            return finished(store, trial_key(model, loss, lr, OURS_LOSSES if model == "ours" else losses), SWEEP_SEED)
        return run_ours(rung, lr, seed) if model == "ours" else run_peer(model, rung, loss, lr, seed)

    for rung, model, seeds in grid:  # rung by rung: an interrupted race has every model at the lower rungs
        for seed in seeds:
            result = reuse_or_run(store, f"{model}@{rung:g}", seed, lambda: one(model, rung, seed))
            print(f"race: {model}@{rung:g} seed {seed}: test nRMSE {result.get('test_nrmse')}", flush=True)
    return report(store, grid, args.base_s, f.key)


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    """The command (module docstring): takes its arguments, returns the exit code (2: a user error)."""
    cfg, args = parse_config(argv, __doc__, _args)
    models, grid, factors, losses, ablations = _checked(cfg, args)
    task = task_label(cfg, args.task_index)
    store = args.out or ROOT / "bench" / "results" / f"race-{task}.jsonl"
    check_store(store, grid, args.base_s, task, losses, ablations, args.select)
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s)
    try:
        if info.world_size != 1:
            raise ConfigError("bench.race runs in one process: start it with python, not torchrun")
        text = race(cfg, args, store, models, grid, factors, info, losses, ablations)
        report_file = args.report or store.with_suffix(".md")
        report_file.parent.mkdir(parents=True, exist_ok=True)
        report_file.write_text(text + "\n")
        plot = write_plot(store, grid, args.base_s, task, report_file.with_suffix(".png"))
        print(text)
        print(f"wrote {store}, {report_file} and {plot}")
        return 0
    finally:
        close_distributed()


if __name__ == "__main__":
    sys.exit(main())
