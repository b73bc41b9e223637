"""`python -m bench.accuracy --config CFG [--set k=v] [--seeds K] [--fno-wall-s S | --fno-epochs N] [--no-fno] [--no-peers] [--out DIR]`

Surrogate accuracy and time to accuracy, ours against a Fourier Neural Operator written after
PDEBench's set-up (`bench/fno_baseline.py`), on the same files and the same split:

1. Data: the config's tasks (generated when missing and allowed), split as PDEBench's single-file
   loaders do (test = the first `data.split.test_fraction` of each file); validation is a slice of
   the training part (`pipelines/split.py`), the only data model selection reads.
2. Ours: every training stage the config selects (autoencoder, cache, operator, diffusion,
   consistency, steady), run in this process and timed from build to exported weights. A stage
   already complete for this config hash is reused with the wall time recorded when it ran.
   The operator and steady stages validate every `evaluation.val_every` steps (metrics.jsonl).
3. FNO: one per task, trained for the same wall-clock budget as our reported model (the variant
   with the lowest validation nRMSE; every stage it uses counted), or `--fno-wall-s` /
   `--fno-epochs`; validated every `--fno-val-every` epochs; with `evaluation.select: best` it
   keeps its best validation epoch as ours keeps its best validation step. neuraloperator's FNO
   (`bench/peers.py`, extra `peers`) is trained the same way on the same budget when installed;
   without the package the result says it was skipped.
4. Test scores of every model and variant, with `core.evaluation.MetricSums`: full-rollout nRMSE
   over predicted steps (`nrmse`) and with the given steps counted as PDEBench 2022 did
   (`nrmse_pdebench2022`), one-step nRMSE, cRMSE, bRMSE, fRMSE bands; training wall time; the
   training wall time at which the validation nRMSE first reached PDEBench's published FNO value
   (`bench/reference/pdebench.json`, arXiv table); inference time per rollout. Per task the error
   budget: the codec's reconstruction nRMSE on the test frames and a trivial reference
   (persistence; the training-mean solution for steady tasks); and when our reported model's
   validation nRMSE first reached the FNO's final one (`time_to_fno`, the FNO's budget over it).
5. `--seeds K` repeats 2-4 with training seeds `training.seed + k` (run folders `<run>-seed<k>`;
   data and split fixed) and reports per model mean, std (ddof 1), min, max and per-seed values.

Writes `<out>/<device>-<date>-accuracy-<run_name>.json` (`summary`: across seeds; `runs`: one
tree per seed), Markdown tables beside it, a plot of validation nRMSE against training wall time
and one rollout plot per task (first seed). `--report A.json ...`
prints the tables of earlier results, and each multi-task model's nRMSE over the single-task
model's for the same task. Runs in one process (world size 1); GPU when there is one.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import torch
from torch import Tensor

from bench.data_throughput import device_slug, git_commit
from bench.epoch_time import sync_device
from entry.cli import exits_on_user_error, parse_config
from entry.config import ConfigError, config_hash
from entry.config_schema import Config
from pipelines.fields import SAMPLE_ID_STRIDE

from bench.accuracy_report import across_seeds, markdown_table, print_reports, seeds_table, write_plots

REFERENCE = Path(__file__).parent / "reference" / "pdebench.json"
PUBLISHED_SOURCE = "arXiv:2210.07182"
"""The published FNO values the targets use: the arXiv tables (the supplement's are recorded too)."""
STAGE_TIMES = "bench_stage_times.json"
"""Per-stage wall seconds, kept in the run folder so a reused stage keeps its measured time."""
TRAINING = ("autoencoder", "cache", "operator", "diffusion", "consistency", "steady")
VARIANT_STAGES = {"operator": ("autoencoder", "cache", "operator"),
                  "operator+diffusion": ("autoencoder", "cache", "operator", "diffusion"),
                  "operator+consistency": ("autoencoder", "cache", "operator", "diffusion", "consistency"),
                  "steady": ("autoencoder", "cache", "steady")}
"""Stages whose wall time a variant's training time counts (the consistency student needs the teacher)."""
TIMED_REPEATS = 3


# ------------------------------------------------------------------------------------------ data


@dataclass
class TaskFields:
    """One task's fields for the baseline and the scores: ``[N, T, C, *S]`` float32 on the CPU.

    Steady tasks are stored as two frames (coefficient, solution) with one given frame, so the
    FNO maps frame 0 to frame 1 exactly as it steps a time-dependent task.
    """

    key: str
    index: int
    steady: bool
    given: int
    dt: float
    train: Tensor
    val: Tensor
    test: Tensor


def _read(cfg: Config, i: int, rows: np.ndarray, steady: bool) -> tuple[Tensor, float]:
    from pipelines.pdebench_io import open_pdebench

    from entry.data import task_path

    task = cfg.data.tasks[i]
    with open_pdebench(task_path(cfg, task), task=task.name) as f:
        d = f.read(rows, reduce_x=task.reduce_x, reduce_t=task.reduce_t)
    u = torch.from_numpy(d.u)
    if steady:
        return torch.stack([torch.from_numpy(d.coefficient), u[:, 0]], dim=1), 0.0
    dt = float(d.t[1] - d.t[0]) if d.t is not None and len(d.t) > 1 else 0.0
    return u, dt


def load_task_fields(cfg: Config, i: int) -> TaskFields:
    """Train, validation (the first `evaluation.val_samples`) and test fields of task ``i``."""
    from pipelines.tasks import get_task

    from entry.data import task_split
    from entry.evaluate import task_key

    task = cfg.data.tasks[i]
    steady = get_task(task.name).steady
    parts = {}
    dt = 0.0
    for split in ("train", "val", "test"):
        rows, _ = task_split(cfg, i, split)
        if split == "val":
            rows = rows[:cfg.evaluation.val_samples]  # the rows validation during training scores
        if split == "test" and cfg.evaluation.max_test_samples:
            rows = rows[:cfg.evaluation.max_test_samples]
        if rows.size == 0:
            raise ConfigError(f"data.tasks[{i}] ({task.name}): the {split} split is empty; raise "
                              f"data.tasks[{i}].samples (or data.split.*_fraction)")
        parts[split], dt = _read(cfg, i, rows, steady)
    return TaskFields(task_key(cfg, i), i, steady, 1 if steady else task.initial_step, dt, **parts)


# ------------------------------------------------------------------------------------ reference


def reference_values(task: str, param: float) -> dict:
    """PDEBench FNO values for one task: ``published`` (arXiv table, given steps scored) and
    ``stretch`` (re-trained, predicted steps only), each ``{nrmse, convention, source, verified}``
    or absent."""
    entries = orjson.loads(REFERENCE.read_bytes())["entries"]
    out = {}
    for e in entries:
        if e["model"] != "FNO" or e["task"] != task or not math.isclose(e["param"], param):
            continue
        slot = None
        if e["convention"] == "pdebench2022" and PUBLISHED_SOURCE in e["source"]:
            slot = "published"
        elif e["convention"] == "predicted_steps_only":
            slot = "stretch"
        if slot is not None:
            out[slot] = {k: e[k] for k in ("nrmse", "convention", "source", "verified")}
    return out


def time_to_reach(curve: list[tuple[float, float]], target: float | None) -> float | None:
    """First wall time of ``curve`` [(seconds, nRMSE)] at which nRMSE <= ``target`` (None: never)."""
    if target is None:
        return None
    for seconds, value in curve:
        if value <= target:
            return seconds
    return None


# ------------------------------------------------------------------------------------------ ours


def train_ours(cfg: Config, info, logger) -> dict[str, float]:
    """Run the config's training stages in order; returns stage -> wall seconds (reused stages
    keep the time recorded when they ran)."""
    from entry.pipeline import applicable, run_cache, stage_definition
    from entry.run_files import run_dir_for
    from entry.runner import execute_stage, stage_hash, stage_is_complete

    run_dir = run_dir_for(cfg)
    times_file = run_dir / STAGE_TIMES
    recorded = orjson.loads(times_file.read_bytes()) if times_file.is_file() else {}
    seconds: dict[str, float] = {}
    ran = False  # once a stage is retrained, every later one is too: they read its output
    for name in cfg.stages:
        if name not in TRAINING or not applicable(cfg, name):
            continue
        known = recorded.get(name, {})
        if not ran and known.get("stage_hash") == stage_hash(cfg, name) and (
                name == "cache" or stage_is_complete(run_dir, name, cfg)):
            seconds[name] = known["seconds"]
            logger.info(f"accuracy: stage {name} complete, reusing it ({seconds[name]:.1f} s when it ran)")
            continue
        ran = True
        sync_device(info.device)
        t0 = time.perf_counter()
        if name == "cache":
            run_cache(cfg, info, logger)
        else:
            code = execute_stage(cfg, info, stage_definition(name), resume=False)
            if code != 0:
                raise RuntimeError(f"stage {name} stopped with exit code {code}")
        sync_device(info.device)
        seconds[name] = time.perf_counter() - t0
        recorded[name] = {"stage_hash": stage_hash(cfg, name), "seconds": seconds[name]}
        times_file.write_bytes(orjson.dumps(recorded))
        logger.info(f"accuracy: stage {name} took {seconds[name]:.1f} s")
    return seconds


def validation_curves(cfg: Config, stage_seconds: dict[str, float]) -> dict[str, dict[str, list]]:
    """Task key -> variant -> [(training wall seconds, validation nRMSE)] from metrics.jsonl.

    The time of a validation point is the wall time of the stages before its stage plus the
    stage's own training time at that step (``train_wall_s``, validation excluded).
    """
    from entry.run_files import run_dir_for

    path = run_dir_for(cfg) / "metrics.jsonl"
    curves: dict[str, dict[str, list]] = {}
    if not path.is_file():
        return curves
    points: dict[str, list[tuple[int, dict]]] = {"operator": [], "steady": []}
    for line in path.read_bytes().splitlines():
        rec = orjson.loads(line)
        if rec.get("stage") not in points or "val_nrmse" not in rec:
            continue
        pts = points[rec["stage"]]
        # A resumed or re-run stage logs its steps again: the newest line of a step replaces it
        # and everything after it.
        while pts and pts[-1][0] >= rec["step"]:
            pts.pop()
        pts.append((rec["step"], rec))
    for stage, pts in points.items():
        before = sum(stage_seconds.get(s, 0.0) for s in VARIANT_STAGES[stage][:-1])
        for _, rec in pts:
            for k, v in rec.items():
                if k.startswith("val_nrmse/") and v is not None:
                    curves.setdefault(k.split("/", 1)[1], {}).setdefault(stage, []).append(
                        (before + rec["train_wall_s"], v))
    return curves


def latent_models(cfg: Config, info):
    """(autoencoder, variant name -> latent step function) of the trained run, for every task kind."""
    from entry.evaluate import load_models, required_weights, variants
    from entry.run_files import run_dir_for

    models = load_models(cfg, required_weights(cfg, run_dir_for(cfg)), info)
    return models["autoencoder"], lambda steady, i: variants(cfg, models, steady)


def score_latent(fields: TaskFields, u_NTCS: Tensor, ae, step_fn, device: torch.device, keep: int = 0):
    """MetricSums of a latent model on ``u`` (steady: frame 0 is the coefficient)."""
    from core.evaluation import MetricSums, accumulate_task

    t = 1 if fields.steady else u_NTCS.shape[1]
    sums = MetricSums.zeros(u_NTCS.shape[2], t, 0 if fields.steady else fields.given, fields.steady, device)
    for s in range(0, u_NTCS.shape[0], 16):
        u = u_NTCS[s:s + 16].to(device)
        kw = dict(coefficient_NCS=u[:, 0], keep=max(keep - s, 0)) if fields.steady else dict(keep=max(keep - s, 0))
        ids = torch.arange(s, s + u.shape[0]) + fields.index * SAMPLE_ID_STRIDE  # noise per sample
        accumulate_task(sums, u[:, 1:] if fields.steady else u, encode=ae.encode, step_fn=step_fn,
                        decode=ae.decode, dt=fields.dt, task_id=fields.index, sample_id_N=ids, **kw)
    return sums


def time_latent_rollout(fields: TaskFields, u_BTCS: Tensor, ae, step_fn, device: torch.device) -> float:
    """Seconds per trajectory of encode -> rollout -> decode, batch of ``u``'s size, after a warm-up."""
    from core.rollout import decode_trajectory, rollout

    u = u_BTCS.to(device)
    b = u.shape[0]
    dt = torch.full((b,), fields.dt, device=device)
    tid = torch.full((b,), fields.index, dtype=torch.int64, device=device)
    grid = tuple(u.shape[3:])
    step = step_fn(torch.arange(b), torch.full((b,), -1))

    @torch.no_grad()
    def once():
        if fields.steady:
            return ae.decode(step(ae.encode(u[:, 0]), dt * 0, tid), grid)
        z = rollout(step, ae.encode(u[:, fields.given - 1]), dt, tid, u.shape[1] - fields.given)
        return decode_trajectory(ae.decode, z[:, 1:], grid)

    return _time_per_item(once, b, device)


def _time_per_item(fn, items: int, device: torch.device) -> float:
    fn()  # warm-up (lazy init, autotuning)
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(TIMED_REPEATS):
        fn()
    sync_device(device)
    return (time.perf_counter() - t0) / (TIMED_REPEATS * items)


# ------------------------------------------------------------------------------------------- FNO


def score_fno(model, fields: TaskFields, u_NTCS: Tensor, device: torch.device, keep: int = 0):
    """MetricSums of the FNO on ``u``: free rollout from the given frames, and one-step windows."""
    from core.evaluation import MetricSums

    from bench.fno_baseline import fno_one_step, fno_rollout

    g = fields.given
    t = u_NTCS.shape[1] - g if fields.steady else u_NTCS.shape[1]
    sums = MetricSums.zeros(u_NTCS.shape[2], t, 0 if fields.steady else g, fields.steady, device)
    model.eval()
    with torch.no_grad():
        for s in range(0, u_NTCS.shape[0], 16):
            u = u_NTCS[s:s + 16].to(device)
            pred = fno_rollout(model, u, g)
            if fields.steady:  # score the solution frame only, as ours
                pred, u, one = pred[:, g:], u[:, g:], None
            else:
                one = fno_one_step(model, u, g)[:, 1:]
            sums.add(pred.transpose(1, 2), u.transpose(1, 2), None if one is None else one.transpose(1, 2))
            for j in range(min(max(keep - s, 0), u.shape[0])):
                sums.samples.append((pred[j].float().cpu(), u[j].float().cpu()))
    return sums


def time_fno_rollout(model, fields: TaskFields, u_BTCS: Tensor, device: torch.device) -> float:
    from bench.fno_baseline import fno_rollout

    u = u_BTCS.to(device)
    with torch.no_grad():
        return _time_per_item(lambda: fno_rollout(model, u, fields.given), u.shape[0], device)


# --------------------------------------------------------------------------------------- command


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, default=1,
                   help="repeat the whole comparison with K training seeds (training.seed, training.seed + 1, "
                        "...; the data split stays fixed) and report mean and spread per model")
    p.add_argument("--fno-wall-s", type=float, default=None,
                   help="FNO training budget in seconds per task (default: our reported model's training time)")
    p.add_argument("--fno-epochs", type=int, default=None, help="train the FNO for this many epochs instead")
    p.add_argument("--fno-val-every", type=int, default=1, help="FNO validation interval in epochs")
    p.add_argument("--fno-batch", type=int, default=50, help="FNO batch size (PDEBench: 50)")
    p.add_argument("--no-fno", action="store_true", help="skip the baselines (default for multi-task configs "
                   "unless --fno-wall-s or --fno-epochs is given)")
    p.add_argument("--no-peers", action="store_true",
                   help="skip neuraloperator's FNO (skipped anyway, with a message, when it is not installed)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="result folder")
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                   help="print the tables of earlier results (and multi-task ratios) and exit")


def _summary(sums, train_s: float | None, curve: list, target: float | None, infer_s: float) -> dict:
    return {"test": sums.summary(), "train_wall_s": train_s, "val_curve": curve,
            "val_nrmse_final": curve[-1][1] if curve else None,
            "time_to_published_s": time_to_reach(curve, target), "inference_s_per_rollout": infer_s}


def error_budget(f: TaskFields, ae, device: torch.device) -> dict:
    """What limits a latent model on the test frames: the codec's reconstruction nRMSE
    (decode(encode(u)) of the scored frames) and the trivial reference, scored as entry.evaluate
    scores it: persistence (the last given frame repeated) for time-dependent tasks, the
    training-mean solution (of the training fields already in memory) for steady ones."""
    from core.evaluation import MetricSums, accumulate_reconstruction

    from entry.evaluate import IdentityCodec, mean_solution_step, persistence_step

    u = f.test[:, 1:] if f.steady else f.test
    codec = MetricSums.zeros(u.shape[2], u.shape[1], 0 if f.steady else f.given, f.steady, device)
    for s in range(0, u.shape[0], 16):
        accumulate_reconstruction(codec, u[s:s + 16].to(device), encode=ae.encode, decode=ae.decode)
    if f.steady:
        name, predict = "mean_solution", mean_solution_step(f.train[:, 1].mean(0).to(device))
    else:
        name, predict = "persistence", persistence_step
    ref = score_latent(f, f.test, IdentityCodec, lambda ids, t: predict, device)
    return {"codec_reconstruction_nrmse": codec.summary()["nrmse"], "references": {name: ref.summary()}}


def score_ours(f: TaskFields, ae, variants: dict, stage_s: dict, curves: dict,
               target: float | None, device: torch.device) -> tuple[dict, str, dict]:
    """Score every variant of ours on task ``f``: -> (model name -> summary, the reported model
    (lowest validation nRMSE), model name -> (prediction, truth) of test sample 0)."""
    models, val_scores, samples = {}, {}, {}
    for name, step_fn in variants.items():
        train_s = sum(stage_s.get(s, 0.0) for s in VARIANT_STAGES[name])
        val = score_latent(f, f.val, ae, step_fn, device).summary()["nrmse"]
        val_scores[name] = val
        curve = list(curves.get(f.key, {}).get(name, []))
        if not curve or curve[-1][0] < train_s:  # the finished model, validated here
            curve.append((train_s, val))
        test = score_latent(f, f.test, ae, step_fn, device, keep=1)
        infer = time_latent_rollout(f, f.test[:16], ae, step_fn, device)
        models[f"ours/{name}"] = _summary(test, train_s, curve, target, infer) | {"val_nrmse_selected": val}
        samples[f"ours/{name}"] = test.samples[0]
    return models, f"ours/{min(val_scores, key=val_scores.get)}", samples


def baselines(cfg: Config, f: TaskFields, args, budget: float, target: float | None,
              device: torch.device, logger) -> tuple[dict, dict, dict]:
    """Train and score our PDEBench-style FNO and, when installed, neuraloperator's FNO on task
    ``f`` for ``budget`` seconds (or ``--fno-epochs``), selected as ours is. -> (model name ->
    summary, model name -> sample-0 (prediction, truth), what was skipped and why)."""
    from bench.fno_baseline import train_fno
    from bench.peers import build_neuralop_fno, neuralop_available, neuralop_config

    builders = {"fno": None}
    skipped = {}
    if args.no_peers:
        skipped["neuralop_fno"] = "--no-peers"
    elif not neuralop_available():
        skipped["neuralop_fno"] = "package neuraloperator not installed (pip install -e '.[peers]')"
        logger.info(f"accuracy: skipped neuraloperator's FNO: {skipped['neuralop_fno']}")
    else:
        builders["neuralop_fno"] = build_neuralop_fno
    models, samples = {}, {}
    keep_best = cfg.evaluation.select == "best"  # select the baselines as ours is selected
    for name, build in builders.items():
        logger.info(f"accuracy: {name} on {f.key}, " + (f"{args.fno_epochs} epochs" if args.fno_epochs
                                                        else f"{budget:.1f} s budget"))
        model, history = train_fno(f.train, initial_step=f.given, epochs=args.fno_epochs,
                                   wall_seconds=None if args.fno_epochs else budget, batch_size=args.fno_batch,
                                   u_val_NTCS=f.val, val_every=args.fno_val_every, seed=cfg.training.seed,
                                   keep_best=keep_best, device=device, build=build)
        curve = [(h.wall_s, h.val_nrmse) for h in history if h.val_nrmse is not None]
        test = score_fno(model, f, f.test, device, keep=1)
        infer = time_fno_rollout(model, f, f.test[:16], device)
        models[name] = _summary(test, history[-1].wall_s, curve, target, infer) | {
            "epochs": len(history), "val_nrmse_selected": min(v for _, v in curve) if keep_best else curve[-1][1]}
        if build is not None:
            models[name]["config"] = neuralop_config(model)
        samples[name] = test.samples[0]
    return models, samples, skipped


def time_to_fno(models: dict, reported: str, budget: float | None) -> dict:
    """When our reported model's validation nRMSE first reached the FNO's final (selected)
    validation nRMSE, and the FNO's budget over that time (how many times faster ours got there)."""
    fno = models.get("fno")
    if fno is None:
        return {}
    target = fno["val_nrmse_selected"]
    reached = time_to_reach(models[reported]["val_curve"], target)
    budget = fno["train_wall_s"] if budget is None else budget
    return {"fno_final_val_nrmse": target, "ours_time_to_fno_final_s": reached,
            "fno_budget_over_ours_time": None if not reached else budget / reached}


def run(cfg: Config, args, info, logger) -> dict:
    """Train and score everything for one seed; returns the result tree (see the module
    docstring) and, per task and model, the (prediction, truth) of test sample 0 for the plots."""
    from pipelines.tasks import get_task

    from entry.data import ensure_data, resolve_task_paths
    from entry.evaluate import given_and_stride

    for i, task in enumerate(cfg.data.tasks):
        if not get_task(task.name).steady and given_and_stride(task, cfg)[1] != 1:
            raise ConfigError("bench.accuracy scores ours and the FNO on the same frames: set operator.horizon=1")
    missing = [str(p) for p in resolve_task_paths(cfg, require_existing=False) if not p.is_file()]
    t0 = time.perf_counter()
    ensure_data(cfg)
    data_s = time.perf_counter() - t0  # part of the whole run's time, not of any model's training time
    fields = [load_task_fields(cfg, i) for i in range(len(cfg.data.tasks))]
    logger.info("accuracy: " + ", ".join(f"{f.key} train/val/test {len(f.train)}/{len(f.val)}/{len(f.test)}"
                                         for f in fields))
    stage_s = train_ours(cfg, info, logger)
    curves = validation_curves(cfg, stage_s)
    ae, variants_of = latent_models(cfg, info)
    tree = {"seed": cfg.training.seed, "run_name": cfg.logging.run_name, "tasks": {}, "stage_seconds": stage_s,
            "data_generation": {"seconds": data_s, "generated": missing}}
    samples: dict[str, dict[str, tuple]] = {}
    for f in fields:
        task = cfg.data.tasks[f.index]
        ref = reference_values(task.name, task.param)
        target = ref.get("published", {}).get("nrmse")
        models, reported, samples[f.key] = score_ours(f, ae, variants_of(f.steady, f.index), stage_s, curves,
                                                      target, info.device)
        budget = args.fno_wall_s if args.fno_wall_s is not None else models[reported]["train_wall_s"]
        skip = args.no_fno or (len(fields) > 1 and args.fno_wall_s is None and args.fno_epochs is None)
        skipped = {"fno": "--no-fno or a multi-task config"} if skip else {}
        if not skip:
            more, more_samples, skipped = baselines(cfg, f, args, budget, target, info.device, logger)
            models |= more
            samples[f.key] |= more_samples
        tree["tasks"][f.key] = {"task": task.name, "param": task.param, "steady": f.steady, "given_steps": f.given,
                                "n_train": len(f.train), "n_val": len(f.val), "n_test": len(f.test),
                                "reference": ref, "error_budget": error_budget(f, ae, info.device),
                                "reported_variant": reported, "skipped": skipped,
                                "fno_budget_s": None if skip or args.fno_epochs else budget,
                                "time_to_fno": time_to_fno(models, reported, None if args.fno_epochs else budget),
                                "models": models}
    return tree, samples


def seed_config(cfg: Config, args, k: int) -> Config:
    """The config of repeat ``k``: training seed ``training.seed + k`` and its own run folder
    (``<run_name>-seed<k>``); data, split and everything else as given."""
    from entry.config import load_config
    from entry.precision import resolve_config

    if args.seeds == 1:
        return cfg
    name = cfg.logging.run_name or Path(args.config).stem
    more = [f"training.seed={cfg.training.seed + k}", f"logging.run_name={name}-seed{k}"]
    return resolve_config(load_config(args.config, [*args.overrides, *more]), cuda=torch.cuda.is_available())


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "--report" in argv:  # no config needed
        p = argparse.ArgumentParser()
        p.add_argument("--report", type=Path, nargs="+", required=True)
        return print_reports(p.parse_args(argv).report)
    cfg, args = parse_config(argv, __doc__, _args)
    if args.fno_epochs is not None and args.fno_epochs < 1 or args.fno_wall_s is not None and args.fno_wall_s <= 0:
        raise ConfigError("--fno-epochs needs an integer >= 1 and --fno-wall-s a positive number")
    if args.seeds < 1:
        raise ConfigError(f"--seeds {args.seeds}: give 1 or more")
    from entry.distributed import close_distributed, init_distributed
    from entry.run_files import run_dir_for, setup_logging

    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s)
    try:
        if info.world_size != 1:
            raise ConfigError("bench.accuracy runs in one process: start it with python, not torchrun")
        logger = setup_logging(run_dir_for(cfg), info, "accuracy")
        date = datetime.date.today().isoformat()
        commit, dirty = git_commit()
        runs, samples = [], None
        for k in range(args.seeds):
            tree, seed_samples = run(seed_config(cfg, args, k), args, info, logger)
            runs.append(tree)
            samples = samples or seed_samples  # plots: the first seed
        result = {"benchmark": "accuracy", "device": device_slug(info.device), "date": date, "git_commit": commit,
                  "dirty": dirty, "config": args.config, "overrides": list(args.overrides),
                  "config_hash": config_hash(cfg), "torch": torch.__version__, "seeds": args.seeds,
                  "summary": across_seeds(runs), "runs": runs}
        args.out.mkdir(parents=True, exist_ok=True)
        name = cfg.logging.run_name or Path(args.config).stem
        stem = args.out / f"{result['device']}-{date}-accuracy-{name}"
        result["plots"] = write_plots(stem, {"device": result["device"], **runs[0]}, samples)
        stem.with_suffix(".json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        text = "\n\n".join([f"## {args.seeds} seed(s): mean +- std\n\n{seeds_table(result['summary'])}"]
                            + [f"## seed {r['seed']} ({r['run_name']})\n\n{markdown_table(r)}" for r in runs])
        stem.with_suffix(".md").write_text(text + "\n")
        print(text)
        print(f"wrote {stem.with_suffix('.json')}")
        return 0
    finally:
        logging.shutdown()
        close_distributed()


if __name__ == "__main__":
    sys.exit(main())
