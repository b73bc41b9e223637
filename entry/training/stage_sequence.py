"""Stages in order: what `entry.pipeline` runs, and what a stage command builds first.

`run_stages` runs the named stages in order, skipping those complete for this config and their
current inputs; `ensure_inputs` is a stage command's first step (its data, then its input stages,
as the pipeline would); `require_inputs` is the same with `--no-deps`: it only checks, naming the
command that makes the first missing input.
"""

from __future__ import annotations

import time
from pathlib import Path

from entry.config.load import ConfigError
from entry.config.schema import STAGE_NAMES, Config
from entry.data.cache_plan import CACHE_KINDS, CACHE_SPLITS, cache_plan, cache_root
from entry.data.files import prepare_data_files, resolve_task_paths
from entry.data.latent_cache import build_cache, caches_ready
from entry.distributed.process_group import DistInfo
from entry.evaluation.scoring import evaluate_config
from entry.evaluation.task_frames import require_scored_rows
from entry.storage.probe import probe_storage, require_writable
from entry.storage.run_folder import (lock_run_folder, open_rank_log, run_dir_for, setup_logging, unlock_run_folder,
                                      write_run_header)
from entry.stages.record import EVALUATE, applicable, input_stages, stage_spec
from entry.training.estimate import check_trajectories
from entry.training.loop import EXIT_PREEMPTED
from entry.training.runner import check_world_sizes, execute_stage
from entry.training.stage_record import stage_hash, stage_inputs, stage_status, weights_file, write_done
from pipelines.work_pool import close_workers


def prepare_data(cfg: Config, info: DistInfo, logger, workers: int) -> None:
    """Every rank: missing files generated together, each file validated once per version
    (entry.data.files.prepare_data_files; its waits are not under training.timeout_s); when the
    stages evaluate, every task's scored split (`evaluation.split`) must hold a trajectory."""
    prepare_data_files(cfg, info, logger, workers=workers, progress=cfg.logging.progress)
    close_workers()  # the generators' idle workers would hold their memory through training
    if "evaluate" in cfg.stages:
        for i in range(len(cfg.data.tasks)):
            require_scored_rows(cfg, i, logger.info)  # an empty split or a huge ensemble fails now, not after training


def run_cache(cfg: Config, info: DistInfo, logger) -> None:

    storage = probe_storage(cache_root(cfg), info)  # shared: built once; node-local: once per node
    for kind in CACHE_KINDS:
        for split in CACHE_SPLITS:
            build_cache(cfg, info, logger, kind, split, storage)


def run_stages(cfg: Config, info: DistInfo, logger, names: list[str]) -> tuple[int, list[tuple[str, str, float]]]:
    """Run `names` in order, skipping those not applicable or complete for this config and its
    current inputs (the data are ready, the run folder locked and open); returns (exit code,
    (stage, status, seconds) per stage). A failure is logged naming the stage, then raised."""
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
                evaluate_config(cfg, info, small=False, logger=logger)
            else:
                code = execute_stage(cfg, info, stage_spec(name))
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
    complete for this config (entry.stages.record.input_stages), as entry.pipeline would. Returns the exit
    code (0: every input is ready). A collective under torchrun."""
    names = input_stages(cfg, stage)
    check_world_sizes(cfg, names, info.world_size)  # an input's mistake, before the first input is built
    run_dir = run_dir_for(cfg)
    logger = setup_logging(run_dir, info, f"{stage}-inputs", deferred=True)
    if "cache" in names:
        require_writable(cache_root(cfg), info, "training.cache_dir")  # before anything is written
    took = lock_run_folder(run_dir, info, create=False)
    try:
        prepare_data(cfg, info, logger, workers)
        check_trajectories(cfg, [*names, stage])  # the stage's and its inputs', before the first input trains
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
    for i, path in enumerate(resolve_task_paths(cfg, require_existing=False)):
        if not path.is_file():
            raise ConfigError(f"{stage}: data.tasks[{i}] file {path} does not exist (--no-deps); make it with "
                              f"`python -m entry.prepare_data {command_args}`")
    run_dir = run_dir_for(cfg)
    for name in input_stages(cfg, stage):
        what = missing_input(cfg, run_dir, stage, name)
        if what is not None:
            raise ConfigError(f"{stage} needs {what}, which does not exist (--no-deps): run "
                              f"`python -m entry.{name} {command_args}` first, or drop --no-deps")


def require_unselected_inputs(cfg: Config) -> None:
    """The pipeline's check of what its stages read but `cfg.stages` does not make: a `ConfigError`
    naming the first such input missing from the run folder (``stages: [operator]`` in a new folder has
    no codec), before the folder is written; the stage would refuse it only after the stages before it
    had run. A `finetune.freeze` stage is copied from the source only when it is selected too."""
    run_dir = run_dir_for(cfg)
    retrained = {n for n in cfg.stages if n != "cache" and not stage_status(run_dir, n, cfg)[0]}
    for stage in cfg.stages:
        for name in input_stages(cfg, stage):
            if name in cfg.stages:
                continue
            # An input made from a stage this run trains anew is stale whatever the folder holds.
            stale = [up for up in input_stages(cfg, name) if up in retrained]
            what = (f"the {name} of the {stale[0]} this run trains" if stale
                    else missing_input(cfg, run_dir, stage, name))
            if what is not None:
                raise ConfigError(f"{stage} needs {what}, which stages does not make: add {name} to stages "
                                  f"(in order: {', '.join(STAGE_NAMES)})" + ("" if stale else
                                  f", or run `python -m entry.{name} --config CFG` first"))


def missing_input(cfg: Config, run_dir: Path, stage: str, name: str) -> Path | None:
    """What of input ``name`` (a stage's weights, or the latent cache) `stage` reads and ``run_dir`` lacks:
    the file or cache folder, or None when it is there."""
    if name == "cache":
        # A stage trains on its kind's train split (evaluation and validation read the files).
        kinds = [] if stage == EVALUATE else [stage_spec(stage).cache_kind]
        plans = [cache_plan(cfg, k, "train") for k in kinds]
        missing = [p.folder for p in plans if p.needed and not (p.folder / "manifest.json").is_file()]
        return missing[0] if missing else None
    return None if weights_file(run_dir, name).is_file() else weights_file(run_dir, name)
