"""Run one training stage as a command: set up, build, train, export, close on every exit path.

Order (DESIGN.md rule 1, with compile in torchtitan's place): process group -> run folder and
logs -> data -> model -> device -> compile each block -> shard (blocks, then the root) ->
optimizer (the stage's `build` does data to optimizer). Exit codes tell
the truth: 0 done, 2 user error (before anything is written), 143 preempted with a
checkpoint, and any crash propagates to torchrun's error file through `@record`.

Validation during training (entry/validation.py): with `evaluation.select=best` the stage
publishes the weights of its best validation instead of its last ones, and records `best_step`
and `best_val_nrmse` in its done file.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch

from entry.checkpoint import set_aside_stale
from entry.cli import parse_config
from entry.config import ConfigError, config_hash
from entry.config_schema import Config, StageConfig
from entry.distributed import DistInfo, close_distributed, init_distributed, rank0_published
from entry.run_files import MetricsSink, run_dir_for, setup_logging, write_run_header
from entry.precision import AUTO_RULE, compute_autocast, describe, resolve_for
from entry.train_loop import (EXIT_PREEMPTED, LoopSettings, NonFiniteError, Preempted, StageParts,
                               best_weights_dir, train_stage)

Build = Callable[[Config, DistInfo, Path, object], StageParts]


def stage_done_file(run_dir: Path, stage: str) -> Path:
    return run_dir / f"{stage}.done.json"


def weights_file(run_dir: Path, stage: str) -> Path:
    return run_dir / f"{stage}.pt"


_BASE_SECTIONS = ("data", "latent", "autoencoder", "training")
STAGE_SECTIONS = {
    "autoencoder": _BASE_SECTIONS,
    "cache": _BASE_SECTIONS,
    "operator": _BASE_SECTIONS + ("operator", "evaluation"),
    "diffusion": _BASE_SECTIONS + ("operator", "diffusion", "evaluation"),
    "consistency": _BASE_SECTIONS + ("operator", "diffusion", "consistency", "evaluation"),
    "steady": _BASE_SECTIONS + ("steady", "evaluation"),
}
"""Config sections each stage's result depends on, its own and its inputs' (evaluation: the
validation that picks the weights). Changing the operator does not retrain the autoencoder."""


def stage_hash(cfg: Config, stage: str) -> str:
    """Hash of the config sections `stage` depends on (`STAGE_SECTIONS`); the whole config's
    hash for a name it does not list."""
    return config_hash(cfg, sections=STAGE_SECTIONS.get(stage))


RUN_CONTROL_KEYS = {"training": ("checkpoint_every", "keep_checkpoints", "num_workers", "prefetch_factor",
                                 "timeout_s", "debug", "on_oom", "max_skips_in_a_row"),
                    "evaluation": ("rollout_steps", "plot_samples", "max_test_samples")}
"""Keys that change how a run is driven, not what it computes up to a given step."""


def resume_hash(cfg: Config, stage: str) -> str:
    """`stage_hash` without the stage's `steps` and the run-control keys: a checkpoint resumes
    across changes of these (training longer, checkpointing more often), never across others."""
    from entry.config import HASH_EXCLUDED_SECTIONS, config_to_dict, tree_hash

    sections = STAGE_SECTIONS.get(stage)
    tree = {k: v for k, v in config_to_dict(cfg).items()
            if k not in HASH_EXCLUDED_SECTIONS and (sections is None or k in sections)}
    if isinstance(tree.get(stage), dict):
        tree[stage] = {k: v for k, v in tree[stage].items() if k != "steps"}
    for section, keys in RUN_CONTROL_KEYS.items():
        if isinstance(tree.get(section), dict):
            tree[section] = {k: v for k, v in tree[section].items() if k not in keys}
    return tree_hash(tree)


def stage_is_complete(run_dir: Path, stage: str, cfg: Config) -> bool:
    """Whether `stage` finished in `run_dir` for the config sections it depends on."""
    done = stage_done_file(run_dir, stage)
    return done.is_file() and orjson.loads(done.read_bytes()).get("config_hash") == stage_hash(cfg, stage)


def _resume_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", choices=["auto", "never"], default="auto",
                        help="auto: continue from the newest complete checkpoint of this stage")


def configure_determinism(cfg: Config) -> None:
    """Deterministic kernels when the config asks for them (golden-loss and resume tests)."""
    if cfg.training.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


@dataclass(frozen=True)
class Stage:
    """A training stage as the runner and the pipeline see it."""

    name: str
    stage_cfg: Callable[[Config], StageConfig]
    build: Build


def stage_command(stage: Stage, description: str) -> Callable[..., int]:
    """The `main(argv)` of a stage's module: `run_stage` with torchrun's `@record` and exit code 2
    for user errors."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from entry.cli import exits_on_user_error

    @record
    @exits_on_user_error
    def main(argv: list[str] | None = None) -> int:
        return run_stage(argv, stage, description)

    return main


def run_stage(argv: list[str] | None, stage: Stage, description: str) -> int:
    """Command-line form: parse, initialise the process group, execute the stage, close."""
    cfg, args = parse_config(argv, description, _resume_args)
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s,
                            debug=cfg.training.debug)
    try:
        return execute_stage(cfg, info, stage, resume=args.resume == "auto")
    finally:
        close_distributed()


def execute_stage(cfg: Config, info: DistInfo, stage: Stage, *, resume: bool = True) -> int:
    """Build the stage with `stage.build(cfg, info, run_dir, logger)`, train, export the weights and
    mark the stage complete; returns 0, or 143 after a preemption checkpoint."""
    cfg = resolve_for(cfg, info.device)  # a config from load_config may still say auto
    name = stage.name
    sc = stage.stage_cfg(cfg)
    if sc.batch_size % info.world_size:
        raise ConfigError(f"{name}.batch_size ({sc.batch_size}) must be divisible by the world size "
                          f"({info.world_size}); change it with --set {name}.batch_size=N")
    run_dir = run_dir_for(cfg)
    logger = setup_logging(run_dir, info, name)
    write_run_header(run_dir, cfg, info)
    configure_determinism(cfg)
    logger.info(f"{name}: rank {info.rank}/{info.world_size} on {info.device}, config {config_hash(cfg)}, "
                f"{describe(cfg.training)} ({AUTO_RULE}; config.json records the resolved values)")
    ckpt_dir = run_dir / "checkpoints" / name
    if resume:
        aside = set_aside_stale(ckpt_dir, resume_hash(cfg, name), info)
        rank0_published(info, wrote=True)  # no rank looks for checkpoints before rank 0 moved them
        if aside is not None:
            logger.warning(f"{name}: the checkpoints in {ckpt_dir} were written for another config; moved them "
                           f"to {aside} and starting this stage afresh")
    parts = stage.build(cfg, info, run_dir, logger)
    # Only the stages that build a `validate` (operator, steady) validate and select.
    validating = parts.validate is not None and cfg.evaluation.val_every > 0
    keep_best = validating and cfg.evaluation.select == "best"
    settings = LoopSettings(
        steps=sc.steps, per_rank_batch=sc.batch_size // info.world_size,
        accum_steps=cfg.training.accum_steps, grad_clip=cfg.training.grad_clip,
        max_skips_in_a_row=cfg.training.max_skips_in_a_row, checkpoint_every=cfg.training.checkpoint_every,
        keep_checkpoints=cfg.training.keep_checkpoints, log_every=cfg.logging.log_every,
        seed=cfg.training.seed, progress=cfg.logging.progress,
        autocast=lambda: compute_autocast(info.device, cfg.training.precision),
        validate_every=cfg.evaluation.val_every if validating else 0, keep_best=keep_best,
        config_hash=resume_hash(cfg, name))
    sink = MetricsSink(run_dir, cfg, info, name)
    exit_code = 1
    try:
        try:
            last = train_stage(parts, settings, info, run_dir=run_dir, ckpt_dir=ckpt_dir,
                               logger=logger, sink=sink, on_oom=cfg.training.on_oom, resume=resume)
        except Preempted as e:
            logger.warning(f"{e}; exiting with {EXIT_PREEMPTED}")
            exit_code = EXIT_PREEMPTED
            return EXIT_PREEMPTED
        except NonFiniteError as e:
            logger.error(str(e))  # every rank raises this together; each log says why it stops
            raise
        from entry.checkpoint import export_weights

        done = {"stage": name, "config_hash": stage_hash(cfg, name), "final_metrics": last}
        if keep_best:
            # The last weights stay beside the best ones; the stage's weights file gets the best.
            last_file = best_weights_dir(run_dir) / f"{name}_last.pt"
            if info.is_main:
                last_file.parent.mkdir(parents=True, exist_ok=True)
            export_weights(parts.model, last_file, info)
            if info.is_main:
                done |= publish_best(run_dir, name, last_file, logger)
        else:
            export_weights(parts.model, weights_file(run_dir, name), info)
        if info.is_main:
            stage_done_file(run_dir, name).write_bytes(orjson.dumps(done))
        # The next stage (in this process, under entry.pipeline) reads these weights on every rank.
        rank0_published(info, wrote=True)
        logger.info(f"{name}: finished {sc.steps} steps; weights in {weights_file(run_dir, name)}")
        exit_code = 0
        return 0
    finally:
        sink.close(exit_code)
        if hasattr(parts.loader, "close"):
            parts.loader.close()


def publish_best(run_dir: Path, stage: str, last_file: Path, logger) -> dict:
    """Rank 0: copy the best validation's weights (or `last_file` when no validation was finite)
    to the stage's weights file, atomically; returns the done-file fields `select`, `best_step`
    and `best_val_nrmse`."""
    from entry.checkpoint import read_best_record

    record = read_best_record(best_weights_dir(run_dir), stage)
    if record is None:
        logger.warning(f"{stage}: no finite validation nRMSE was recorded; publishing the last weights")
        source, fields = last_file, {"best_step": None, "best_val_nrmse": None}
    else:
        source, fields = record["file"], {"best_step": record["step"], "best_val_nrmse": record["val_nrmse"]}
        logger.info(f"{stage}: publishing the best validation's weights (step {record['step']}, "
                    f"val_nrmse {record['val_nrmse']:.4g})")
    out = weights_file(run_dir, stage)
    tmp = out.with_name(out.name + ".tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, out)  # the next stage or evaluation never sees a half-written file
    return {"select": "best", **fields}
