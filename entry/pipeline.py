"""`torchrun --nproc_per_node=N -m entry.pipeline --config CFG [--dry-run]`: the whole run.

validate config -> validate data (generated when missing and allowed) -> dry run (parameter
counts, memory estimate, time per step, ETA) -> the stages `stages:` selects, in order (the
evaluation once, at the end) -> summary. A stage already complete for this config hash is
skipped, so re-running after a failure continues where it stopped. The exit code is 0 only
if every selected stage succeeded; a failure names the stage and the log with the cause,
and no success line is ever printed after one.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from entry.cli import exits_on_user_error, parse_config
from entry.config import config_hash
from entry.config_schema import Config
from entry.distributed import DistInfo, close_distributed, init_distributed
from entry.run_files import (lock_run_folder, open_rank_log, run_dir_for, setup_logging, unlock_run_folder,
                             write_run_header)
from entry.runner import execute_stage, stage_hash, stage_inputs, stage_status, write_done
from entry.train_loop import EXIT_PREEMPTED

TRAINING_STAGES = ("autoencoder", "operator", "diffusion", "consistency", "steady")


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="stop after the estimate")
    parser.add_argument("--workers", type=int, default=1, help="processes for data generation")


def _stage(name: str):
    import importlib

    return importlib.import_module(f"entry.{name}").STAGE


def _has_steady(cfg: Config) -> bool:
    from pipelines.tasks import get_task

    return any(get_task(t.name).steady for t in cfg.data.tasks)


def _has_dynamic(cfg: Config) -> bool:
    from pipelines.tasks import get_task

    return any(not get_task(t.name).steady for t in cfg.data.tasks)


def applicable(cfg: Config, name: str) -> bool:
    """Stages with nothing to train on are skipped (no steady task: no steady prior, ...)."""
    if name in ("operator", "diffusion", "consistency"):
        return _has_dynamic(cfg)
    if name == "steady":
        return _has_steady(cfg)
    return True


def prepare_data(cfg: Config, info: DistInfo, logger, workers: int) -> None:
    """Rank 0 generates what is missing; then every rank validates every file."""
    from pipelines.validate import validate_file

    from entry.data import ensure_data, resolve_task_paths

    if info.is_main:
        ensure_data(cfg, workers=workers)
    if info.distributed:
        dist.barrier()  # the files exist before the other ranks read them
    for path in resolve_task_paths(cfg, require_existing=True):
        report = validate_file(path)
        if info.is_main:
            logger.info(f"data ok: {report}")


def run_cache(cfg: Config, info: DistInfo, logger) -> None:
    from entry.cache import CACHE_KINDS, CACHE_SPLITS, build_cache

    for kind in CACHE_KINDS:
        for split in CACHE_SPLITS:
            build_cache(cfg, info, logger, kind, split)


def run_evaluation(cfg: Config, info: DistInfo, logger, *, small: bool):
    from entry.evaluate import evaluate_run

    return evaluate_run(cfg, info, logger, small=small)


def run_pipeline(cfg: Config, info: DistInfo, logger, *, dry_run: bool, workers: int) -> int:
    """Every selected stage in order; returns the exit code."""
    from entry.estimate import estimate_run

    run_dir = run_dir_for(cfg)
    logger.info(f"config ok: hash {config_hash(cfg)}, stages {list(cfg.stages)}, world size {info.world_size}")
    prepare_data(cfg, info, logger, workers)
    for line in estimate_run(cfg, info):
        logger.info(f"estimate: {line}")
    if dry_run:
        logger.info("dry run: stopping after the estimate (nothing was written to the run folder)")
        return 0
    # Config and data have passed: from here on the pipeline writes the run folder.
    lock_run_folder(run_dir, info, create=True)
    open_rank_log(logger, run_dir, info)
    write_run_header(run_dir, cfg, info)
    timings: list[tuple[str, str, float]] = []
    for name in cfg.stages:
        if not applicable(cfg, name):
            timings.append((name, "not applicable", 0.0))
            continue
        if name != "evaluate":
            complete, why = stage_status(run_dir, name, cfg)
            if complete:
                logger.info(f"stage {name}: complete for config hash {stage_hash(cfg, name)} (its sections) "
                            f"and its current inputs, skipped")
                timings.append((name, "skipped (complete)", 0.0))
                continue
            (logger.warning if "unreadable" in why else logger.info)(f"stage {name}: runs because {why}")
        t0 = time.perf_counter()
        logger.info(f"stage {name}: starting")
        try:
            if name == "cache":
                inputs = stage_inputs(cfg, run_dir, name)
                run_cache(cfg, info, logger)
                if info.is_main:
                    write_done(run_dir, name, cfg, inputs)
            elif name == "evaluate":
                run_evaluation(cfg, info, logger, small=False)
            else:
                code = execute_stage(cfg, info, _stage(name))
                if code == EXIT_PREEMPTED:
                    logger.warning(f"pipeline: preempted in stage {name}; re-run the same command to continue")
                    return code
        except BaseException as e:
            logger.error(f"pipeline FAILED in stage {name}: {type(e).__name__}: {e}. The cause is in "
                         f"{run_dir / f'rank{info.rank}.log'} (and the other ranks' logs beside it).")
            raise
        timings.append((name, "done", time.perf_counter() - t0))
    if info.is_main:
        lines = [f"  {name:<12} {status:<20} {seconds:8.1f} s" for name, status, seconds in timings]
        eval_json = run_dir / "eval.json"
        summary = "\n".join(["pipeline summary:", *lines,
                             f"  results: {eval_json if eval_json.exists() else '(no evaluation selected)'}",
                             f"  plots:   {run_dir / 'plots'}"])
        logger.info(summary)
        logger.info("pipeline completed: every selected stage succeeded")
    return 0


@record
@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _args)
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s, debug=cfg.training.debug)
    try:
        run_dir = run_dir_for(cfg)
        # Held in memory until config and data have passed: a user error leaves the run folder alone.
        logger = setup_logging(run_dir, info, "pipeline", deferred=True)
        lock_run_folder(run_dir, info, create=False)
        return run_pipeline(cfg, info, logger, dry_run=args.dry_run, workers=args.workers)
    finally:
        unlock_run_folder(run_dir_for(cfg))
        close_distributed()


if __name__ == "__main__":
    sys.exit(main())
