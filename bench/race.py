# long file: the race's command (manual, peers, ours through entry.pipeline), which change together
"""`python -m bench.race --config CFG [--set k=v] [--task-index I] --base-s B [--rungs 1,4,16]
[--sweep-rungs 1,4] [--models fno,unet,plain_transformer,neuralop_fno[,ours]] [--seeds 0,1,2]
[--seeds-at-top S] [--lr-sweep 0.3,1,3] [--lr-extensions 2] [--peer-loss one_step,pushforward]
[--batches 16,50] [--ema DECAY|0] [--val-every-s S] [--out FILE.jsonl] [--report FILE.md]
[--select last|best] [--ablation NAME KEY=VALUE [KEY=VALUE ...]] [--allow-dirty] [--report-only] ...`

A fair race (issues 31, 51): every model trained at its best for the same wall-clock budgets, a
ladder ``B * rung`` seconds of training, on task ``I`` of the config (its files and split, as
bench.accuracy reads them: `bench.accuracy_scores.load_task_fields`). Reports test nRMSE
against budget and the training time at which each model's validation nRMSE reached fixed
targets (`bench.budget.TARGETS`).

The rules:

- **Same clock.** Peers (fno, unet, plain_transformer, neuralop_fno: ``[B, C * initial_step, *S]
  -> [B, C, *S]``) train through the product's budgeted loop
  (`entry.training.budgeted.train_budgeted`, each step the stages' `train_step`; bench/ has no
  training loop of its own): only training time counts (validation is off the clock), the
  schedule is a function of the fraction of the budget spent (every rung ends annealed), no step
  starts that would not fit. A peer's normaliser fit is on its clock (`bench.race_train`); ours'
  codec fit and cache are on its. Every trained run records the machine's speed just before it
  (`bench.machine_speed`), and the report says whether the records shared one clock. A budget is
  in seconds of the machine that started the store, per model (`bench.machine_budget`): each
  model's step is timed (the median over 3 s of training) when the store starts
  (``<model>@calibration``) and before each of its trials, and a trial trains the budget times
  their ratio in wall seconds (the same steps); the report names a record whose steps per
  store-second lie more than 1.2x off its model's at the lowest rung; a store of records made
  before this rule is refused.
- **Every model at its best on every rung.** Each model's recipe (loss, learning rate, batch,
  optimiser, schedule, the loop's help) is chosen on validation at each sweep rung
  (``--sweep-rungs``, default 1 and 4; the lowest rung always sweeps), from its authors'
  published recipe, the race's default with our training loop's help (per-channel normalisation,
  warm-up, gradient clipping, ``--ema``) for each loss of ``--peer-loss`` and batch of
  ``--batches``, each with its rate swept (``--lr-sweep``, bracketed: ``--lr-extensions``), and
  its own choice at the sweep rung below; a rung above the last sweep rung reuses the highest
  swept rung's choice. The grid and its size: `bench.race_recipes`. Ours keeps its config's
  recipe, its rate swept the same way. A sweep rung's seed-0 result is its chosen trial itself
  (the same model, budget, seed and recipe). Every choice is recorded (candidates, their
  validation, the winner) and every result names its recipe.
- **Same seeds, same peers, every rung:** ``--seeds`` (default 0,1,2) at every rung
  (``--seeds-at-top`` may name others for the highest), neuraloperator's FNO among the default
  models when its package imports (skipped with a message otherwise).
- **Records a referee accepts:** the race refuses to run from a work tree with uncommitted changes
  outside bench/results/ (``--allow-dirty`` for development: its records say ``"dirty": true``
  and the report says so); every record names the commit and the raced data file's fingerprint
  (`entry.data.files.data_inputs`, as the pipeline's done files record it); a store holding
  records of this race's keys made on other data, another task or budget, another selection,
  other candidates, or from a dirty tree (for a clean race) is refused (`check_store`).

The plain transformer is sized to the parameter count of our operator as the config builds it
(`core.models.plain_transformer.plain_transformer_args`). ``--select best`` gives every model the
weights of its lowest validation (PDEBench's scripts keep that checkpoint; ours:
``evaluation.select=best``) instead of its last; the sweep then compares the kept weights'
validation.

``ours`` runs `python -m entry.pipeline` (stages autoencoder, cache, operator or steady, in a
subprocess each): a probe run of `PROBE_STEPS` steps measures our fixed cost (the stages before
the trained one, whole stage seconds from the pipeline summary: codec fit included) and our
seconds per step; each rung then trains under ``training.max_train_s`` = the budget less
`OURS_FIXED_SLACK` more than the probe's fixed cost (no step starts that would pass it) with
``training.anneal_to=time``: its cosine decays over that time budget, or over ``<stage>.steps`` =
`OURS_STEP_CAP` times the steps the probe says fit if those run out first, so it ends annealed on
a machine slower or faster than the probe's (`OURS_NOTE`); warm-up capped at a tenth of the
estimate, ``evaluation.select`` the race's ``--select``, ``training.seed`` the race's seed, its
EMA the race's ``--ema``. Its training time is the fixed cost plus the stage's ``train_wall_s``
(validation excluded); the result records the steps that ran and whether it stayed within the
budget (a fixed cost above the allowance can still take it over: the report counts such runs).
Single-task configs only; each run has its own run folder ``<run_name>-race-r<rung>-s<seed>-lr<lr>``
(an unfinished one is started afresh).

``--ablation NAME KEY=VALUE ...`` (repeatable) adds the model ``ours-NAME``: ours with those config
overrides (e.g. ``no_stencil operator.pdet.token_conv=false``: one part of our design taken out),
probed for its own step time and trained on every rung like ours, at ours' chosen learning rate
there (one change at a time: the ablation is not swept again). Its records carry the overrides; a
store holding ``ours-NAME`` made with others is refused.

Every result is one JSON line of ``--out`` (default bench/results/race-<task>.jsonl) keyed
``<model>@<rung>`` and seed (`bench.result_store`), sweep trials ``<model>@<rung>@<recipe>``,
choices ``<model>@<rung>@recipe``: a re-run trains only what is missing. The Markdown report
(``--report``, default beside ``--out``) and its plot are `bench.race_report`'s; ``--report-only``
writes them from what ``--out`` holds and trains nothing (a race of days, stopped or in progress).

Legend: N trajectories, B batch, T time steps, C channels, S spatial axes.
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import orjson
import torch
from torch import nn

from bench.accuracy_scores import TaskFields, latent_models, load_task_fields, score_latent
from bench.budget import VALIDATIONS
from bench.child_runs import forwarding_sigterm, run_child
from bench.fno_baseline import build_fno
from bench.machine_budget import (ALLOCATOR_ENV, fix_allocator, machine_clock, ours_step_seconds, peer_step_seconds,
                                  reanchor)
from bench.machine_speed import measured
from bench.peers import build_neuralop_fno, neuralop_available
from bench.provenance import ROOT, checkout_env, record_stamp, refuse_dirty
from bench.race_recipes import (SWEEP_SEED, Recipe, choose_at_rung, chooser, peer_templates, recorded_choice,
                                sweep_rungs, trial_key)
from bench.race_report import OURS_NOTE, report, write_plot
from bench.race_train import PEER_LOSSES, kept_validation, targets, train_peer
from bench.result_store import finished, record, records, reuse_or_run
from core.models.plain_transformer import plain_transformer_args
from core.models.registry import build
from entry.config.cli import exits_on_user_error, load_resolved, parse_config
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.files import data_inputs, ensure_data, task_key
from entry.distributed.process_group import close_distributed, init_distributed
from entry.evaluation.task_frames import given_and_stride, task_label
from entry.stages.record import stage_spec
from entry.storage.run_folder import run_dir_for, stage_done_file
from pipelines.work_pool import close_workers

__all__ = ["MODELS", "PEERS", "check_store", "main", "race", "race_grid"]

MODELS = ("fno", "unet", "plain_transformer", "neuralop_fno", "ours")
DEFAULT_MODELS = ("fno", "unet", "plain_transformer", "neuralop_fno")
"""``--models``' default: every peer (neuralop_fno when its package imports)."""
PROBE_STEPS = 20
"""Steps of ours' probe run (the first is timed apart: it carries compilation and warm-up)."""
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
SELECTS = ("last", "best")
"""Which weights a race run keeps: its last, or those of its lowest validation (``--select``)."""


# ----------------------------------------------------------------------------------------- peers


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


PEERS: dict[str, Callable[[TaskFields, int, int], nn.Module]] = {
    "fno": lambda f, seed, _: build_fno(f.train, f.given, seed=seed),  # PDEBench's FNO
    "unet": _unet,  # PDEBench's U-Net
    "neuralop_fno": lambda f, seed, _: build_neuralop_fno(f.train, f.given, seed=seed),
    "plain_transformer": _plain_transformer,
}
"""Each peer's builder ``(fields, seed, params_target) -> model``, initialised from ``seed`` only;
its recipes are `bench.race_recipes`'."""


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


def ours_stage(steady: bool) -> str:
    """The stage ours trains on a steady task or a time-dependent one."""
    return "steady" if steady else "operator"


def _ours_config(args, more: list[str]) -> Config:
    return load_resolved(args.config, [*args.overrides, *more])


def run_pipeline(args, more: list[str], *, timeout_s: float | None = None, fresh: bool = True) -> tuple[Config, Path]:
    """Run entry.pipeline on the config with the race's ``more`` overrides in a subprocess (its
    own RNG, determinism settings and memory), stopped after ``timeout_s`` (None: no limit); returns
    (that run's config, its run folder).
    The folder, named by the race and unfinished (else its result would be recorded), is
    started afresh: a stage reused from an interrupted attempt would hide its time. ``fresh=False``
    (a measurement on a step budget, where time is no score) leaves it, so the pipeline resumes an
    interrupted attempt from its newest checkpoint of this config."""
    cfg = _ours_config(args, more)
    run_dir = run_dir_for(cfg)
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the peers' cached blocks would otherwise stay out of the run's reach
    cmd = [sys.executable, "-m", "entry.pipeline", "--config", str(args.config)]
    cmd += [a for o in [*args.overrides, *more] for a in ("--set", o)]
    env = {**checkout_env(), **ALLOCATOR_ENV}  # the race's one allocator policy (`bench.machine_budget`)
    proc = run_child(cmd, env=env, timeout_s=timeout_s)  # a SIGTERM to the race reaches it (`forwarding_sigterm`)
    if proc.returncode == 2:
        why = (proc.stderr.strip().splitlines() or [""])[-1]
        raise ConfigError(f"entry.pipeline refused the run {cfg.logging.run_name}: {why}")
    if proc.returncode != 0:
        raise RuntimeError(f"entry.pipeline exited {proc.returncode} (log {run_dir / 'rank0.log'}): "
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
    stage = ours_stage(f.steady)
    more = [*ablation, *_overrides(stage, PROBE_STEPS, SWEEP_SEED, args.ema, f"{name}-race-probe", 0,
                                   getattr(cfg, stage).warmup_steps), "logging.log_every=1"]
    _, run_dir = run_pipeline(args, more)
    seconds = ours_seconds(run_dir, stage)
    walls = [rec["train_wall_s"] for rec in _step_lines(run_dir, stage)]
    return {"probe_steps": len(walls), "fixed_s": sum(s for k, s in seconds.items() if k != stage),
            "first_step_s": walls[0], "step_s": (walls[-1] - walls[0]) / (len(walls) - 1),
            "total_s": sum(seconds.values()), "run_dir": str(run_dir)}


def train_ours(args, cfg: Config, f: TaskFields, probe: dict, *, name: str, rung: float, budget_s: float,
               seed: int, lr: float, info, model: str = "ours", ablation: tuple[str, ...] = ()) -> dict:
    """Our run for one rung, seed and learning rate, annealed to what the probe and the probe's fixed
    cost leave of ``budget_s`` (`OURS_NOTE`), trained by entry.pipeline, scored here on the test split
    as bench.accuracy scores ours. The probe's own seconds (its codec fit, cache and steps) are on
    ours' clock: every run of ours pays them, as if it had probed for itself. ``model`` and
    ``ablation``: an ablation of ours (``ours-NAME`` and its config overrides; ``name`` then names
    the ablation's runs)."""
    stage = ours_stage(f.steady)
    probe_s = probe["total_s"]
    fixed_s = (1 + OURS_FIXED_SLACK) * probe["fixed_s"]
    estimate = steps_for_budget(budget_s - probe_s, fixed_s, probe["first_step_s"], probe["step_s"])
    head = {"model": model, **({"ablation": list(ablation)} if ablation else {}), "budget_s": budget_s, "seed": seed,
            "schedule": OURS_NOTE, "estimated_steps": estimate, "step_cap": OURS_STEP_CAP,
            "fixed_allowance_s": fixed_s, "probe": probe, "probe_s": probe_s}
    if estimate < 1:
        return head | {"skipped": f"the budget {budget_s:g} s is below the probe's {probe_s:.3g} s, our fixed "
                                  f"cost's allowance {fixed_s:.3g} s and a first step {probe['first_step_s']:.3g} s"}
    steps = math.ceil(OURS_STEP_CAP * estimate)
    warmup = min(getattr(cfg, stage).warmup_steps, estimate // 10)
    more = [*ablation, *_overrides(stage, steps, seed, args.ema, f"{name}-race-r{rung:g}-s{seed}-lr{lr:.3g}",
                                   max(1, estimate // VALIDATIONS), warmup, args.select)]
    # The stage's own clock may use what the fixed cost's allowance leaves of the budget, its schedule annealed to it.
    more += [f"training.max_train_s={budget_s - probe_s - fixed_s!r}", "training.anneal_to=time", f"{stage}.lr={lr!r}"]
    run_cfg, run_dir = run_pipeline(args, more)
    seconds = ours_seconds(run_dir, stage)
    from bench.accuracy import validation_curves  # matplotlib and the stage runner: only ours needs them

    curve = validation_curves(run_cfg, seconds).get(f.key, {}).get(stage, [])
    ae, variants_of = latent_models(run_cfg, info)
    test = score_latent(f, f.test, ae, variants_of(f.steady, f.index)[stage], info.device).summary()
    train_s = probe_s + sum(seconds.values())
    return head | {"steps": steps, "steps_run": _step_lines(run_dir, stage)[-1]["step"], "warmup_steps": warmup, "lr": getattr(run_cfg, stage).lr,
                   "ema_decay": args.ema or None, "train_s": train_s, "stage_seconds": seconds,
                   "within_budget": train_s <= budget_s, "params": stage_params(run_cfg, stage),
                   "val_curve": [list(p) for p in curve],
                   "val_nrmse_final": curve[-1][1] if curve else None, **kept_validation(curve, args.select),
                   "time_to_targets": targets(curve),
                   "test": test, "test_nrmse": test["nrmse"], "run_dir": str(run_dir)}


def stage_params(cfg: Config, stage: str) -> int:
    """Parameters of the config's ``stage`` model (our operator, or the steady model)."""
    return sum(p.numel() for p in stage_spec(stage).model(cfg).parameters())


# ------------------------------------------------------------------------------------------- cli


def parse_numbers(text: str, what: str, kind=float) -> list:
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
    p.add_argument("--sweep-rungs", default="1,4", help="rungs of --rungs where every model's recipe is chosen "
                   "on validation (the lowest rung always; a rung above the last reuses its choice)")
    p.add_argument("--models", default=None, help=f"any of {', '.join(MODELS)} (default: "
                   f"{','.join(DEFAULT_MODELS)}, neuralop_fno when its package imports)")
    p.add_argument("--seeds", default="0,1,2", help="training seeds (model initialisation, batches) at every rung")
    p.add_argument("--seeds-at-top", default=None, help="seeds at the highest rung (default: --seeds)")
    p.add_argument("--lowest-only", default="", help="models of --models trained at the lowest rung only")
    p.add_argument("--lr-sweep", default="0.3,1,3", help="factors of each recipe's learning rate")
    p.add_argument("--lr-extensions", type=int, default=2,
                   help="rates tried beyond an edge of the sweep while the best lies there")
    p.add_argument("--peer-loss", default=None,
                   help=f"the losses of the peers' loop recipes, of {', '.join(PEER_LOSSES)} (default one_step,"
                        "pushforward; a steady task: rollout, its one step)")
    p.add_argument("--batches", default="16,50", help="the batches of the peers' loop recipes (trajectories)")
    p.add_argument("--ema", type=float, default=0.0, help="weight-average decay of ours and of the peers' loop "
                   "recipes (0: none)")
    p.add_argument("--val-every-s", type=float, default=None, help="training seconds between validations "
                   f"(default: the budget / {VALIDATIONS})")
    p.add_argument("--out", type=Path, default=None,
                   help="results, JSON lines (default bench/results/race-<task>.jsonl)")
    p.add_argument("--report", type=Path, default=None, help="Markdown report (default: --out with .md)")
    p.add_argument("--select", default="last", choices=SELECTS,
                   help="every model's kept weights: its last, or those of its lowest validation (PDEBench's)")
    p.add_argument("--ablation", nargs="+", action="append", default=[], metavar="NAME KEY=VALUE",
                   help="the model ours-NAME: ours with these config overrides, at ours' rate (repeatable)")
    p.add_argument("--reanchor-clock", action="store_true",
                   help="before racing, re-anchor each model's store step to the median of its trials' timings in "
                        "--out (bench.machine_budget.reanchor): once, for a store whose calibrations caught a spell, "
                        "on the machine its records ran on")
    p.add_argument("--allow-dirty", action="store_true", help="race from a work tree with uncommitted changes "
                   "(development only: the records and the report say so)")
    p.add_argument("--report-only", action="store_true", help="write the report and plot of what --out holds "
                   "and train nothing (a race in progress or stopped: what is missing shows as not raced)")


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
    stage = ours_stage(cfg.data.tasks[args.task_index].spec.steady)
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


class Plan(NamedTuple):
    """A race's checked arguments (`_checked`)."""

    models: list[str]
    grid: list[tuple[float, str, list[int]]]
    """[(rung, model, seeds)] (`race_grid`)."""
    swept: list[float]
    """The rungs that choose recipes (`bench.race_recipes.sweep_rungs`)."""
    factors: list[float]
    losses: list[str]
    """The peers' loop recipes' losses."""
    batches: list[int]
    ablations: dict[str, tuple[str, ...]]
    """ours-NAME -> its overrides (`_ablations`)."""


def _models(args) -> list[str]:
    """``--models``' names; by default every peer, neuralop_fno left out with a message when its
    package is missing (named in --models it is a ConfigError)."""
    if args.models is not None:
        models = _names(args.models)
        if "neuralop_fno" in models and not neuralop_available():
            raise ConfigError("--models neuralop_fno needs the package neuraloperator (pip install -e '.[peers]')")
        return models
    if neuralop_available():
        return list(DEFAULT_MODELS)
    print("race: neuralop_fno skipped: the package neuraloperator is not installed (pip install -e '.[peers]')",
          file=sys.stderr, flush=True)
    return [m for m in DEFAULT_MODELS if m != "neuralop_fno"]


# long: each argument's check in one place, in the order the help lists them
def _checked(cfg: Config, args) -> Plan:
    """The race's `Plan` from the arguments, or a ConfigError."""
    models = _models(args)
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
    rungs, factors = parse_numbers(args.rungs, "--rungs"), parse_numbers(args.lr_sweep, "--lr-sweep")
    asked, batches = parse_numbers(args.sweep_rungs, "--sweep-rungs"), parse_numbers(args.batches, "--batches", int)
    seeds = parse_numbers(args.seeds, "--seeds", int)
    top = seeds if args.seeds_at_top is None else parse_numbers(args.seeds_at_top, "--seeds-at-top", int)
    if (min(rungs) <= 0 or min(factors) <= 0 or not args.base_s > 0 or min(batches) < 1 or args.lr_extensions < 0
            or min(asked) <= 0):
        raise ConfigError("--base-s, --rungs, --sweep-rungs and --lr-sweep take positive numbers, --batches "
                          "integers >= 1, --lr-extensions one >= 0")
    if not 0.0 <= args.ema < 1.0 or (args.val_every_s is not None and not args.val_every_s > 0):
        raise ConfigError(f"--ema {args.ema} must lie in [0, 1) and --val-every-s be > 0")
    if "ours" in models and (len(cfg.data.tasks) != 1 or given_and_stride(cfg.data.tasks[0], cfg)[1] != 1):
        raise ConfigError("ours in the race needs a single-task config with operator.horizon=1")
    steady = cfg.data.tasks[args.task_index].spec.steady
    losses = _names(args.peer_loss or ("rollout" if steady else "one_step,pushforward"))
    if not losses or any(x not in PEER_LOSSES for x in losses):
        raise ConfigError(f"--peer-loss {args.peer_loss!r}: give one or more of {', '.join(PEER_LOSSES)}")
    if losses != ["rollout"] and steady:
        raise ConfigError(f"--peer-loss {args.peer_loss}: a steady task's peers map coefficient to solution "
                          "in one step; leave --peer-loss out")
    rungs = sorted(set(rungs))
    return Plan(models, race_grid(models, rungs, seeds, top, lowest_only), sweep_rungs(rungs, asked), factors,
                losses, sorted(set(batches)), ablations)


def templates_of(model: str, plan: Plan, ours_lr: float, ema: float | None) -> list[Recipe]:
    """The recipe templates whose rates ``model``'s sweep tries (`bench.race_recipes`): ours' config
    recipe at ``ours_lr``, a peer's `peer_templates`."""
    if model == "ours":
        return [Recipe(name="config", loss="config", lr=ours_lr, ema=ema)]
    return peer_templates(model, plan.losses, plan.batches, ema)


def _swept_by(plan: Plan, model: str) -> list[float]:
    """The sweep rungs ``model`` runs at (an ablation: ours')."""
    model = "ours" if model in plan.ablations else model
    return [r for r in plan.swept if any(r == g and model == m for g, m, _ in plan.grid)]


def _templates(cfg: Config, args, plan: Plan) -> dict[str, list[Recipe]]:
    """``{model: its recipe templates}`` (`templates_of`) of every model that chooses a recipe."""
    ours_lr = getattr(cfg, ours_stage(cfg.data.tasks[args.task_index].spec.steady)).lr
    return {m: templates_of(m, plan, ours_lr, args.ema or None) for m in plan.models if m not in plan.ablations}


# long: one refusal per way a store's record could pass for this race's, each with its one-line fix
def check_store(store: Path, plan: Plan, base_s: float, task: str, templates: dict[str, list[Recipe]], *,
                select: str = "last", clean: bool = True, data: str | None = None) -> None:
    """Refuse (ConfigError) a result file whose records for this race's keys (``<model>@<rung>``,
    its sweep trials and choices) could not be this race's: made on another task or budget
    (``<model>@<rung>`` names a multiple of ``base_s``), on other data (``data``: the raced file's
    fingerprint, when known; a record naming none predates the rule), from a dirty tree (for a
    ``clean`` race), keeping other weights than ``select``, an ablation of ours with other
    overrides than ``plan.ablations``', a choice made among other candidates than ``templates``
    (--peer-loss, --batches, --lr-sweep, --lr-extensions, --ema), a rung trained with another
    recipe than its model's recorded choice (or under the older rule that named none), ours on the
    older step-annealed schedule: they would be reused as this race's."""
    rungs = {f"{r:g}": r for r, _, _ in plan.grid}
    ours = {m for m in plan.models if m == "ours" or m in plan.ablations}
    for key, seed, r in recorded(store):
        model, _, rest = key.partition("@")
        rung_text, _, trial = rest.partition("@")
        if rung_text not in rungs or not any(m == model and f"{g:g}" == rung_text for g, m, _ in plan.grid):
            continue  # not this race's key
        rung, what = rungs[rung_text], f"{store} holds {key} seed {seed}"
        if "task" not in r:
            continue
        if r["task"] != task or not math.isclose(r["budget_s"], base_s * rung):
            raise ConfigError(f"{what} for task {r['task']} at {r['budget_s']:g} s, not {task} at "
                              f"{base_s * rung:g} s: give another --out")
        if data is not None and r.get("data_fingerprint") != data:
            raise ConfigError(f"{what} made on data {r.get('data_fingerprint') or 'it does not name'}, not the "
                              f"task file's {data}: give another --out")
        if clean and r.get("dirty"):
            raise ConfigError(f"{what} made from a work tree with uncommitted changes (--allow-dirty): give another "
                              "--out, or race with --allow-dirty")
        if r.get("select", "last") != select:
            raise ConfigError(f"{what} keeping its {r.get('select', 'last')} weights, not --select {select}: "
                              "give another --out")
        if model in plan.ablations and tuple(r.get("ablation", ())) != plan.ablations[model]:
            raise ConfigError(f"{what} made with the overrides {r.get('ablation')}, not "
                              f"{list(plan.ablations[model])}: name the ablation anew, or give another --out")
        if model in ours and r.get("schedule") == STEP_ANNEALED:
            raise ConfigError(f"{what} trained with another schedule ({r['schedule']}), not {OURS_NOTE!r}: "
                              "give another --out")
        if trial == "recipe" and r.get("templates") != [t.as_dict() for t in templates[model]]:
            among = [Recipe.from_dict(t).key() for t in r.get("templates") or []]
            raise ConfigError(f"{what} chosen among other candidates ({', '.join(among)}; or a recipe's settings "
                              "differ): --peer-loss, --batches or --ema differ; give another --out")
        if trial == "recipe" and r.get("factors") != plan.factors:
            raise ConfigError(f"{what} chosen with --lr-sweep {r.get('factors')}, not {plan.factors}: give another --out")
        if trial or "skipped" in r:
            continue
        chooser_model = "ours" if model in plan.ablations else model
        choice = recorded_choice(store, chooser_model, chooser(rung, _swept_by(plan, model)))
        if "recipe_key" not in r:
            raise ConfigError(f"{what} names no recipe: made under the race's older rule (one recipe chosen at the "
                              "lowest rung); give another --out")
        if choice is not None and r.get("recipe") != choice["chosen"]:
            raise ConfigError(f"{what} trained with the recipe {r['recipe_key']}, not the recorded choice "
                              f"{Recipe.from_dict(choice['chosen']).key()}: remove that model's rung records, or give "
                              "another --out")


def _yardstick(args, f: TaskFields, info, target: int, ours_like: dict[str, tuple[str, ...]]) -> Callable[[str], float]:
    """``(model) -> seconds of its training step on this machine now`` (`bench.machine_budget`): a
    peer built from the sweep seed, ours (or an ablation, ``ours_like``' overrides) as the dry-run
    estimate times its stage with the race's EMA."""
    stage = ours_stage(f.steady)

    def step_seconds(model: str) -> float:
        if model in ours_like:
            more = [*ours_like[model], f"{stage}.ema_decay={args.ema!r}"]
            return ours_step_seconds(_ours_config(args, more), stage, info)
        return peer_step_seconds(PEERS[model](f, SWEEP_SEED, target), f, info.device)

    return step_seconds


def refuse_uncalibrated(store: Path, models: list[str], allocator: dict[str, str]) -> None:
    """Refuse (ConfigError) to train into a store holding records of one of ``models`` (its probe
    included) but not that model's ``<model>@calibration``: they were trained on the wall clock of
    whatever machine ran them, before budgets were in the store's machine-seconds
    (`bench.machine_budget`), and a calibration taken now would not be that machine's. Likewise a
    store whose calibrations ran under another ``allocator`` policy than this race's."""
    found = {key: r for key, _, r in recorded(store)}
    stale = [m for m in models if f"{m}@calibration" not in found and any(k.startswith(f"{m}@") for k in found)]
    if stale:
        raise ConfigError(f"{store} holds records of {', '.join(stale)} trained before the race's budgets were "
                          "machine-relative (no <model>@calibration): give another --out, or remove the store "
                          "(git rm; git keeps it)")
    other = [m for m in models if f"{m}@calibration" in found and found[f"{m}@calibration"].get("allocator") != allocator]
    if other:
        raise ConfigError(f"{store} holds calibrations of {', '.join(other)} made under another allocator policy "
                          f"than this race's {allocator}: give another --out")


def reanchor_clock(store: Path, models: list[str], probed: list[str], stamp: dict) -> None:
    """`bench.machine_budget.reanchor` ``models``' store steps, and re-record each of ``probed``'s
    probe (``<model>@probe``) with its machine factor against the new anchor (the factor it ran at
    times old over new), so that `probe_at` still scales it by the machine's speed alone."""
    for model, (old, new) in reanchor(store, models, stamp).items():
        print(f"race: {model}: store step re-anchored from {old:.4g} s to {new:.4g} s "
              f"(the median of its trials' timings)", flush=True)
        if model in probed and (probe := finished(store, f"{model}@probe", SWEEP_SEED)) is not None:
            factor = probe.get("machine_factor", 1.0)
            record(store, f"{model}@probe", SWEEP_SEED, probe | {"machine_factor": factor * old / new,
                                                                 "machine_factor_before_reanchor": factor})


def _clock(args, store: Path, models: list[str], yardstick: Callable[[str], float], probed: list[str], stamp: dict
           ) -> Callable[[str, float], dict]:
    """The race's `machine_clock` over ``store``, its anchors first re-anchored (`reanchor_clock`)
    when ``args.reanchor_clock`` asks."""
    if args.reanchor_clock:
        reanchor_clock(store, models, probed, stamp)
    return machine_clock(store, models, yardstick, stamp)


def probe_at(probe: dict, factor: float) -> dict:
    """Ours' probe (`probe_ours`, recorded once with the ``machine_factor`` it ran at) with its
    seconds as they would take at ``factor``: what the probe charges and predicts on this machine."""
    scale = factor / probe.get("machine_factor", 1.0)
    return probe | {k: probe[k] * scale for k in ("fixed_s", "first_step_s", "step_s", "total_s") if k in probe}


def recorded(store: Path) -> list[tuple[str, int, dict]]:
    """(key, seed, payload) of every record of ``store`` (`bench.result_store.records`)."""
    return [(rec["model"], rec["seed"], rec.get("payload") or {}) for rec in records(store)]


def _stamp(cfg: Config, args, f: TaskFields, device) -> dict:
    """What every record of this race carries: its task, where it was made (`record_stamp`: device,
    processor, commit and whether the tree was dirty, torch, threads), the raced data file's
    fingerprint, the config and its overrides."""
    return {"task": f.key, **record_stamp(device),
            "data_fingerprint": data_inputs(cfg)[task_key(cfg, args.task_index)],
            "config": str(args.config), "overrides": list(args.overrides)}


def _opened(cfg: Config, args, store: Path, plan: Plan, f: TaskFields, device) -> tuple[dict, dict[str, list[Recipe]]]:
    """(what every record carries: `_stamp` and the allocator policy this process now runs under,
    every model's recipe templates) once ``store`` is checked as this race's (`check_store` with the
    data's fingerprint, `refuse_uncalibrated`)."""
    # one allocator policy for every trial of the race, recorded with each (`bench.machine_budget`)
    stamp, templates = _stamp(cfg, args, f, device) | {"allocator": fix_allocator()}, _templates(cfg, args, plan)
    check_store(store, plan, args.base_s, f.key, templates, select=args.select, clean=not args.allow_dirty,
                data=stamp["data_fingerprint"])
    refuse_uncalibrated(store, plan.models, stamp["allocator"])  # before anything is timed or trained into it
    return stamp, templates


def race(cfg: Config, args, store: Path, plan: Plan, info) -> None:
    """Train and record in ``store`` everything of ``plan.grid`` [(rung, model, seeds)] missing, each
    model's recipe chosen at its sweep rungs (`bench.race_recipes.choose_at_rung`)."""
    ensure_data(cfg)
    close_workers()  # the data are ready: idle generation workers would only hold memory
    f = load_task_fields(cfg, args.task_index)
    name = cfg.logging.run_name or Path(args.config).stem
    target = stage_params(cfg, ours_stage(f.steady)) if "plain_transformer" in plan.models else 0  # its size
    stamp, templates = _opened(cfg, args, store, plan, f, info.device)
    ours_like = {"ours": (), **plan.ablations} if "ours" in plan.models else {}  # model -> its config overrides
    runs_of = {m: name if m == "ours" else f"{name}-{m}" for m in ours_like}  # their run folders' prefix
    clock = _clock(args, store, plan.models, _yardstick(args, f, info, target, ours_like), list(ours_like), stamp)

    def run_peer(model: str, rung: float, recipe: Recipe, seed: int) -> dict:
        print(f"race: {model} at {rung:g} x {args.base_s:g} s, {recipe.key()}, seed {seed}", flush=True)
        budget = clock(model, args.base_s * rung)
        net = PEERS[model](f, seed, target).to(info.device)
        out = measured(lambda: train_peer(net, f, recipe, budget_s=budget["wall_budget_s"], seed=seed,
                                          val_every_s=args.val_every_s, device=info.device, select=args.select))
        sized = {"params_target": target} if model == "plain_transformer" else {}
        return {"model": model} | out | budget | {"rung": rung} | sized | stamp

    probes = {m: reuse_or_run(store, f"{m}@probe", SWEEP_SEED, lambda m=m: probe_ours(args, cfg, f, runs_of[m],
              ours_like[m]) | {"machine_factor": clock(m, 0.0)["machine_factor"]}) for m in ours_like}

    def run_ours(rung: float, recipe: Recipe, seed: int, model: str = "ours") -> dict:
        budget = clock(model, args.base_s * rung)
        probe = probe_at(probes[model], budget["machine_factor"])
        out = measured(lambda: train_ours(args, cfg, f, probe, name=runs_of[model], rung=rung, seed=seed,
                                          budget_s=budget["wall_budget_s"], lr=recipe.lr, info=info, model=model,
                                          ablation=ours_like[model]))
        return out | budget | {"recipe": recipe.as_dict(), "recipe_key": recipe.key(), "rung": rung} | stamp

    chosen: dict[tuple[str, float], Recipe] = {}

    def recipe_at(model: str, rung: float) -> Recipe:  # the choice of its sweep rung, made once
        swept = _swept_by(plan, model)
        at_rung = chooser(rung, swept)
        if (model, at_rung) not in chosen:
            below = [r for r in swept if r < at_rung]
            lower = recipe_at(model, below[-1]) if below else None
            at = {"task": f.key, "rung": at_rung, "budget_s": args.base_s * at_rung, "select": args.select} | stamp
            run = ((lambda recipe, s: run_ours(at_rung, recipe, s)) if model == "ours" else
                   (lambda recipe, s: run_peer(model, at_rung, recipe, s)))
            chosen[(model, at_rung)] = choose_at_rung(store, model, at_rung, run, templates[model], plan.factors,
                                                      args.lr_extensions, lower, at)
        return chosen[(model, at_rung)]

    def one(model: str, rung: float, seed: int) -> dict:
        if model in plan.ablations:  # at ours' recipe there, trained at every rung and seed
            return run_ours(rung, recipe_at("ours", rung), seed, model)
        recipe = recipe_at(model, rung)
        if chooser(rung, _swept_by(plan, model)) == rung and seed == SWEEP_SEED:  # the chosen trial is this run
            return finished(store, trial_key(model, rung, recipe), SWEEP_SEED)
        return run_ours(rung, recipe, seed) if model == "ours" else run_peer(model, rung, recipe, seed)

    for rung, model, seeds in plan.grid:  # rung by rung: an interrupted race has every model at the lower rungs
        for seed in seeds:
            result = reuse_or_run(store, f"{model}@{rung:g}", seed, lambda: one(model, rung, seed))
            print(f"race: {model}@{rung:g} seed {seed}: test nRMSE {result.get('test_nrmse')}", flush=True)


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    """The command (module docstring): takes its arguments, returns the exit code (2: a user error)."""
    cfg, args = parse_config(argv, __doc__, _args)
    plan = _checked(cfg, args)
    refuse_dirty(args.allow_dirty, "bench.race")
    task = task_label(cfg, args.task_index)
    store = args.out or ROOT / "bench" / "results" / f"race-{task}.jsonl"
    check_store(store, plan, args.base_s, task, _templates(cfg, args, plan), select=args.select,
                clean=not args.allow_dirty)
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s)
    try:
        if info.world_size != 1:
            raise ConfigError("bench.race runs in one process: start it with python, not torchrun")
        if not args.report_only:  # --report-only: what the store holds, a rung not raced yet shown as such
            with forwarding_sigterm():
                race(cfg, args, store, plan, info)
        text = report(store, plan.grid, args.base_s, task, cfg.data.tasks[args.task_index].spec.channels)
        report_file = args.report or store.with_suffix(".md")
        report_file.parent.mkdir(parents=True, exist_ok=True)
        report_file.write_text(text + "\n")
        plot = write_plot(store, plan.grid, args.base_s, task, report_file.with_suffix(".png"))
        print(text)
        print(f"wrote {store}, {report_file} and {plot}")
        return 0
    finally:
        close_distributed()


if __name__ == "__main__":
    sys.exit(main())
