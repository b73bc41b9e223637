"""`torchrun --nproc_per_node=N -m entry.pipeline --config CFG [--dry-run]`: the whole run.

validate config -> validate data (generated when missing and allowed) -> dry run (a batch larger
than the data can fill is a config error here; then parameter counts, memory estimate, time per
step, ETA; with --dry-run also entry.plan's memory plan for this world size and GPU) -> the stages
`stages:` selects, in order (the evaluation once, at the end) -> summary. A stage already
complete for this config hash is skipped, so re-running after a failure continues where it
stopped. The exit code is 0 only if every selected stage succeeded; a failure names the stage
and the log with the cause, and no success line is ever printed after one.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from entry.config.cli import exits_on_user_error, parse_config
from entry.config.load import config_hash
from entry.config.schema import Config
from entry.distributed.process_group import DistInfo, close_distributed, init_distributed
from entry.storage.run_folder import (evaluation_file, lock_run_folder, open_rank_log, run_dir_for, setup_logging,
                                      unlock_run_folder, write_run_header)


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="stop after the estimate and the memory plan (entry.plan) for this world size and GPU")
    parser.add_argument("--workers", type=int, default=1, help="processes for data generation")


def plan_in_child(cfg: Config, world_size: int, gpu_memory: int | None = None) -> list[str]:
    """entry.plan's report for this run's world size (nodes from torchrun's LOCAL_WORLD_SIZE), against
    `gpu_memory` bytes per GPU (None: entry.plan's default, 80 GiB).

    In a child process: the simulation needs a process without a process group, and this one has one.
    Collective-free, so rank 0 alone runs it while the others go on.
    """
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    nodes = max(1, world_size // per_node) if world_size % per_node == 0 else 1
    budget = {} if gpu_memory is None else {"gpu_memory": gpu_memory}
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_plan_report, cfg, world_size=world_size, nodes=nodes, **budget).result()


def gpu_memory_of(device: torch.device) -> int | None:
    """Bytes of memory of `device` when it is a GPU, the one a dry run's plan must fit (a 24 GiB card
    was planned as 80 GiB: "fits" where it does not); None on a CPU."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def _plan_report(cfg: Config, **kwargs) -> list[str]:
    """entry.plan's report lines in the child; a failure comes back as a RuntimeError holding its
    traceback's text (some of torch's exceptions, the fake tensors' among them, cannot be pickled back)."""
    from entry.training.memory_plan import plan_report  # only a dry run plans (see run_pipeline)

    try:
        return plan_report(cfg, **kwargs)
    except Exception:
        raise RuntimeError(f"the memory plan failed:\n{traceback.format_exc()}") from None


def run_pipeline(cfg: Config, info: DistInfo, logger, *, dry_run: bool, workers: int) -> int:
    """Every selected stage in order; returns the exit code."""
    # Imported once the config has parsed: they load the training steps and their TensorDicts (with
    # torch._dynamo, 2 s), which a command refusing a mistyped key should not wait for.
    from entry.data.cache_plan import cache_root
    from entry.storage.probe import require_shared, require_writable
    from entry.training.estimate import estimate_run
    from entry.training.finetune import check_source
    from entry.training.runner import check_world_sizes
    from entry.training.stage_sequence import prepare_data, require_unselected_inputs, run_stages

    source_lines = check_source(cfg)  # a source that cannot serve: one line and exit 2, before data or folder
    check_world_sizes(cfg, list(cfg.stages), info.world_size)  # every stage's, before the first one writes
    run_dir = run_dir_for(cfg)
    logger.info(f"config ok: hash {config_hash(cfg)}, stages {list(cfg.stages)}, world size {info.world_size}")
    if cfg.derived:  # one block: what a config that names only its data was given, and why
        logger.info("\n".join(cfg.derived))
    if source_lines:
        logger.info("\n".join(source_lines))
    if "cache" in cfg.stages:  # before the run folder, the data or the cache is written
        require_writable(cache_root(cfg), info, "training.cache_dir")
    require_shared(run_dir, info, "logging.run_dir")
    prepare_data(cfg, info, logger, workers)
    require_unselected_inputs(cfg)  # what the stages read and do not make: there, or refused before the folder
    for line in estimate_run(cfg, info):
        logger.info(f"estimate: {line}")
    if dry_run:
        if info.is_main:
            for line in plan_in_child(cfg, info.world_size, gpu_memory_of(info.device)):
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
        eval_json = evaluation_file(run_dir, cfg)
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
