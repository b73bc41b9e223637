# long file: its docstring (a seventh of it) is the benchmark's manual: what trains, on what budget, what is scored
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
   (and for a generated 2D flow, `solver`: our solver's seconds for one trajectory at the stored
   resolution, `bench/solver_time.py`, beside each model's seconds per rollout)
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
import sys
import time
from pathlib import Path

import orjson
import torch

from bench.accuracy_report import across_seeds, markdown_table, print_reports, seeds_table, write_plots
from bench.accuracy_scores import (VARIANT_STAGES, TaskFields, error_budget, latent_models, load_task_fields,
                                   model_summary, reference_values, score_fno, score_ours, time_fno_rollout,
                                   time_to_reach)
from bench.epoch_time import sync_device
from bench.fno_baseline import train_fno
from bench.peers import build_neuralop_fno, neuralop_available, neuralop_config
from bench.provenance import record_stamp
from bench.solver_time import solver_seconds
from entry.config.cli import exits_on_user_error, load_resolved, parse_config
from entry.config.load import ConfigError, config_hash
from entry.config.schema import Config
from entry.data.files import ensure_data, resolve_task_paths
from entry.data.latent_cache import caches_ready
from entry.distributed.process_group import close_distributed, init_distributed
from entry.evaluation.task_frames import given_and_stride
from entry.stages.record import SPECS, STAGES, applicable
from entry.storage.run_folder import run_dir_for, setup_logging
from entry.training.runner import execute_stage
from entry.training.stage_record import stage_hash, stage_is_complete
from entry.training.stage_sequence import run_cache

STAGE_TIMES = "bench_stage_times.json"
"""Per-stage wall seconds, kept in the run folder so a reused stage keeps its measured time."""


# ------------------------------------------------------------------------------------------ ours


def train_ours(cfg: Config, info, logger) -> dict[str, float]:
    """Run the config's training stages in order; returns stage -> wall seconds (reused stages
    keep the time recorded when they ran)."""
    run_dir = run_dir_for(cfg)
    times_file = run_dir / STAGE_TIMES
    recorded = orjson.loads(times_file.read_bytes()) if times_file.is_file() else {}
    seconds: dict[str, float] = {}
    ran = False  # once a stage is retrained, every later one is too: they read its output
    for name in cfg.stages:
        if name not in SPECS or not applicable(cfg, name):  # every stage but evaluate
            continue
        known = recorded.get(name, {})
        # A cache folder may be shared by several runs (training.cache_dir): reuse only one that
        # still matches this run's encoder and data, as entry.pipeline does.
        if not ran and known.get("stage_hash") == stage_hash(cfg, name) and (
                caches_ready(cfg, info) if name == "cache" else stage_is_complete(run_dir, name, cfg)):
            seconds[name] = known["seconds"]
            logger.info(f"accuracy: stage {name} complete, reusing it ({seconds[name]:.1f} s when it ran)")
            continue
        ran = True
        sync_device(info.device)
        t0 = time.perf_counter()
        if name == "cache":
            run_cache(cfg, info, logger)
        else:
            code = execute_stage(cfg, info, SPECS[name], resume=False)
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
    path = run_dir_for(cfg) / "metrics.jsonl"
    curves: dict[str, dict[str, list]] = {}
    if not path.is_file():
        return curves
    # The stages validated by rollouts log the validation nRMSE a curve is drawn from.
    points: dict[str, list[tuple[int, dict]]] = {s.name: [] for s in STAGES if s.validates == "rollout"}
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


def baselines(cfg: Config, f: TaskFields, args, budget: float, target: float | None,
              device: torch.device, logger) -> tuple[dict, dict, dict]:
    """Train and score our PDEBench-style FNO and, when installed, neuraloperator's FNO on task
    ``f`` for ``budget`` seconds (or ``--fno-epochs``), selected as ours is. -> (model name ->
    summary, model name -> sample-0 (prediction, truth), what was skipped and why)."""
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
        models[name] = model_summary(test, history[-1].wall_s, curve, target, infer) | {
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
    for i, task in enumerate(cfg.data.tasks):
        if not task.spec.steady and given_and_stride(task, cfg)[1] != 1:
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
                                "solver": solver_seconds(task), "models": models}
    return tree, samples


def seed_config(cfg: Config, args, k: int) -> Config:
    """The config of repeat ``k``: training seed ``training.seed + k`` and its own run folder
    (``<run_name>-seed<k>``); data, split and everything else as given."""
    if args.seeds == 1:
        return cfg
    name = cfg.logging.run_name or Path(args.config).stem
    more = [f"training.seed={cfg.training.seed + k}", f"logging.run_name={name}-seed{k}"]
    return load_resolved(args.config, [*args.overrides, *more])


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

    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s)
    try:
        if info.world_size != 1:
            raise ConfigError("bench.accuracy runs in one process: start it with python, not torchrun")
        logger = setup_logging(run_dir_for(cfg), info, "accuracy")
        date = datetime.date.today().isoformat()
        stamp = record_stamp(info.device)
        runs, samples = [], None
        for k in range(args.seeds):
            tree, seed_samples = run(seed_config(cfg, args, k), args, info, logger)
            runs.append(tree)
            samples = samples or seed_samples  # plots: the first seed
        result = {"benchmark": "accuracy", **stamp, "date": date, "config": args.config,
                  "overrides": list(args.overrides), "config_hash": config_hash(cfg), "seeds": args.seeds,
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
