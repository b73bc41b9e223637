"""`torchrun --nproc_per_node=N -m entry.pipeline --config CFG [--dry-run]`: the whole run.

validate config -> validate data (generated when missing and allowed) -> dry run (parameter
counts, memory estimate, time per step, ETA; with --dry-run also entry.plan's memory plan for
this world size) -> the stages `stages:` selects, in order (the evaluation once, at the end) ->
summary. A stage already complete for this config hash is
skipped, so re-running after a failure continues where it stopped. The exit code is 0 only
if every selected stage succeeded; a failure names the stage and the log with the cause,
and no success line is ever printed after one.
"""

from __future__ import annotations

import argparse
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record

from entry.cli import exits_on_user_error, parse_config
from entry.config import ConfigError, config_hash
from entry.config_schema import Config
from entry.distributed import DistInfo, close_distributed, init_distributed
from entry.run_files import (lock_run_folder, open_rank_log, run_dir_for, setup_logging, unlock_run_folder,
                             write_run_header)
from entry.runner import execute_stage, stage_hash, stage_inputs, stage_status, write_done
from entry.stages import applicable, input_stages
from entry.train_loop import EXIT_PREEMPTED


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="stop after the estimate and the memory plan (entry.plan) for this world size")
    parser.add_argument("--workers", type=int, default=1, help="processes for data generation")


def stage_definition(name: str):
    """The `Stage` a stage command (`entry.<name>`) defines and `execute_stage` runs."""
    import importlib

    return importlib.import_module(f"entry.{name}").STAGE


def prepare_data(cfg: Config, info: DistInfo, logger, workers: int) -> None:
    """Every rank: missing files generated together, each file validated once per version
    (entry.data.prepare_data_files; its waits are not under training.timeout_s)."""
    from entry.data import prepare_data_files

    prepare_data_files(cfg, info, logger, workers=workers, progress=cfg.logging.progress)


def run_cache(cfg: Config, info: DistInfo, logger) -> None:
    from entry.cache import CACHE_KINDS, CACHE_SPLITS, build_cache, cache_root
    from entry.storage import probe_storage

    storage = probe_storage(cache_root(cfg), info)  # shared: built once; node-local: once per node
    for kind in CACHE_KINDS:
        for split in CACHE_SPLITS:
            build_cache(cfg, info, logger, kind, split, storage)


def run_evaluation(cfg: Config, info: DistInfo, logger, *, small: bool):
    from entry.evaluate import evaluate_run

    return evaluate_run(cfg, info, logger, small=small)


def plan_in_child(cfg: Config, world_size: int) -> list[str]:
    """entry.plan's report for this run's world size (nodes from torchrun's LOCAL_WORLD_SIZE).

    In a child process: the simulation needs a process without a process group, and this one has one.
    Collective-free, so rank 0 alone runs it while the others go on.
    """
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    from entry.plan import plan_report

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    nodes = max(1, world_size // per_node) if world_size % per_node == 0 else 1
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(plan_report, cfg, world_size=world_size, nodes=nodes).result()


def run_pipeline(cfg: Config, info: DistInfo, logger, *, dry_run: bool, workers: int) -> int:
    """Every selected stage in order; returns the exit code."""
    from entry.estimate import estimate_run

    from entry.storage import require_shared

    run_dir = run_dir_for(cfg)
    logger.info(f"config ok: hash {config_hash(cfg)}, stages {list(cfg.stages)}, world size {info.world_size}")
    require_shared(run_dir, info, "logging.run_dir")
    prepare_data(cfg, info, logger, workers)
    for line in estimate_run(cfg, info):
        logger.info(f"estimate: {line}")
    if dry_run:
        if info.is_main:
            for line in plan_in_child(cfg, info.world_size):
                logger.info(line)
        logger.info("dry run: stopping after the estimate and the plan (nothing was written to the run folder)")
        return 0
    # Config and data have passed: from here on the pipeline writes the run folder.
    lock_run_folder(run_dir, info, create=True)
    open_rank_log(logger, run_dir, info)
    write_run_header(run_dir, cfg, info)
    code, timings = run_stages(cfg, info, logger, list(cfg.stages))
    if code != 0:
        return code
    if info.is_main:
        lines = [f"  {name:<12} {status:<20} {seconds:8.1f} s" for name, status, seconds in timings]
        eval_json = run_dir / "eval.json"
        summary = "\n".join(["pipeline summary:", *lines,
                             f"  results: {eval_json if eval_json.exists() else '(no evaluation selected)'}",
                             f"  plots:   {run_dir / 'plots'}"])
        logger.info(summary)
        logger.info("pipeline completed: every selected stage succeeded")
    return 0


def run_stages(cfg: Config, info: DistInfo, logger, names: list[str]) -> tuple[int, list[tuple[str, str, float]]]:
    """Run `names` in order, skipping those not applicable or complete for this config and its
    current inputs (the data are ready, the run folder locked and open); returns (exit code,
    (stage, status, seconds) per stage). A failure is logged naming the stage, then raised."""
    from entry.cache import caches_ready

    run_dir = run_dir_for(cfg)
    timings: list[tuple[str, str, float]] = []
    for name in names:
        if not applicable(cfg, name):
            timings.append((name, "not applicable", 0.0))
            continue
        if name != "evaluate":
            complete, why = stage_status(run_dir, name, cfg)
            if complete and name == "cache" and not caches_ready(cfg, info):
                # A node-local cache may be gone on some node (a fresh /dev/shm): build it again.
                complete, why = False, "the latent cache is missing on some node"
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
                code = execute_stage(cfg, info, stage_definition(name))
                if code == EXIT_PREEMPTED:
                    logger.warning(f"pipeline: preempted in stage {name}; re-run the same command to continue")
                    return code, timings
        except BaseException as e:
            logger.error(f"pipeline FAILED in stage {name}: {type(e).__name__}: {e}. The cause is in "
                         f"{run_dir / f'rank{info.rank}.log'} (and the other ranks' logs beside it).")
            raise
        timings.append((name, "done", time.perf_counter() - t0))
    return 0, timings


def ensure_inputs(cfg: Config, info: DistInfo, stage: str, *, workers: int = 1) -> int:
    """What a stage command runs first: the data, then every input stage of `stage` that is not
    complete for this config (entry.stages.input_stages), as entry.pipeline would. Returns the exit
    code (0: every input is ready). A collective under torchrun."""
    run_dir = run_dir_for(cfg)
    logger = setup_logging(run_dir, info, f"{stage}-inputs", deferred=True)
    took = lock_run_folder(run_dir, info, create=False)
    try:
        prepare_data(cfg, info, logger, workers)
        names = input_stages(cfg, stage)
        pending = [n for n in names if not stage_status(run_dir, n, cfg)[0]]
        if not pending:
            return 0
        logger.info(f"{stage}: building its inputs first: {', '.join(pending)} (--no-deps: stop instead)")
        took |= lock_run_folder(run_dir, info, create=True)
        open_rank_log(logger, run_dir, info)
        write_run_header(run_dir, cfg, info)
        return run_stages(cfg, info, logger, names)[0]
    finally:
        if took:
            unlock_run_folder(run_dir)


def require_inputs(cfg: Config, stage: str, command_args: str) -> None:
    """`--no-deps`: use what is there. A `ConfigError` naming the command that makes the first
    missing input of `stage` (a data file, an input stage's weights, the latent cache);
    `command_args` is the command line's ``--config PATH --set ...`` part, quoted in it. Whether
    what is there matches this config is the stage's own check (a stale cache is refused)."""
    from entry.cache import cache_folder, cache_needed
    from entry.data import resolve_task_paths
    from entry.runner import weights_file

    for i, path in enumerate(resolve_task_paths(cfg, require_existing=False)):
        if not path.is_file():
            raise ConfigError(f"{stage}: data.tasks[{i}] file {path} does not exist (--no-deps); make it with "
                              f"`python -m entry.prepare_data {command_args}`")
    run_dir = run_dir_for(cfg)
    for name in input_stages(cfg, stage):
        if name == "cache":
            # A stage trains on its kind's train split (evaluation and validation read the files).
            kinds = [] if stage == "evaluate" else ["steady" if stage == "steady" else "dynamic"]
            missing = [cache_folder(cfg, k, "train") for k in kinds
                       if cache_needed(cfg, k, "train") and not (cache_folder(cfg, k, "train") / "manifest.json").is_file()]
            what = missing[0] if missing else None
        else:
            what = None if weights_file(run_dir, name).is_file() else weights_file(run_dir, name)
        if what is not None:
            raise ConfigError(f"{stage} needs {what}, which does not exist (--no-deps): run "
                              f"`python -m entry.{name} {command_args}` first, or drop --no-deps")


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
