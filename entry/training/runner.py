"""Run one training stage as a command: set up, build, train, export, close on every exit path.

Order (docs/design.md, distributed rule 1, with compile in torchtitan's place): process group -> data -> model ->
device -> compile each block -> shard (blocks, then the root) -> optimizer (the stage's `build`
does data to optimizer) -> the checkpoint to resume; only then, everything validated, the run
folder: its lock, the rank logs (held in memory until here), the header, set-aside checkpoints.
Exit codes tell the truth: 0 done, 2 user error (the run folder untouched), 143 preempted with a
checkpoint, and any crash propagates to torchrun's error file through `@record`.

Validation during training (entry/training/validation.py): with `evaluation.select=best` the stage
publishes the weights of its best validation instead of its last ones, and records `best_step`
and `best_val_nrmse` in its done file.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from entry.config.cli import USER_ERRORS
from entry.config.load import ConfigError, config_hash, tree_hash
from entry.config.recipe import AUTO_RULE, describe, recipe_problems
from entry.config.schema import Config, StageConfig
from entry.distributed.precision import compute_autocast, resolve_for
from entry.distributed.process_group import DistInfo, rank0_published
from entry.evaluation.plots import plot_training_curves
from entry.evaluation.table import untrained_start_line
from entry.storage.run_folder import (MetricsSink, lock_run_folder, open_rank_log, run_dir_for, setup_logging,
                                      unlock_run_folder, write_run_header)
from entry.training.checkpoint import (SET_ASIDE_KEPT, export_module, export_weights, read_best_record,
                                       remove_unfinished, set_aside, set_aside_folders)
from entry.models.files import publish_weights
from entry.stages.record import SPECS, StageSpec
from entry.training.finetune import check_source, frozen_source
from entry.training.loop import EXIT_PREEMPTED, NonFiniteError, Preempted, best_weights_dir, train_stage
from entry.training.resume import ResumePoint, find_resume_point
from entry.training.stage_record import resume_hash, stage_inputs, weights_file, write_done
from entry.training.step import LoopSettings, StageParts, validated_module
from entry.training.validation import with_validation

def configure_determinism(cfg: Config) -> None:
    """Deterministic kernels when the config asks for them (golden-loss and resume tests)."""
    if cfg.training.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def check_world_size(stage: StageSpec, cfg: Config, world_size: int) -> None:
    """A `ConfigError` when the stage's global batch cannot be split evenly over the ranks, or a rank's
    share into `training.accum_steps` equal micro-batches (a stage with no steps has no batches to
    split), or when its schedule would follow each rank's own clock (`training.anneal_to: time` on more
    than one rank: the replicas would step at other rates)."""
    sc = stage.section(cfg)
    if sc.steps and world_size > 1 and cfg.training.anneal_to == "time":
        raise ConfigError(f"training.anneal_to=time runs in one process (world size {world_size}): each rank's "
                          "clock would set its own learning rate; use training.anneal_to=steps")
    if sc.steps and sc.batch_size % world_size:
        raise ConfigError(f"{stage.name}.batch_size ({sc.batch_size}) must be divisible by the world size "
                          f"({world_size}); change it with --set {stage.name}.batch_size=N")
    accum = cfg.training.accum_steps
    if sc.steps and (sc.batch_size // world_size) % accum:
        raise ConfigError(f"{stage.name}.batch_size ({sc.batch_size}) gives each of {world_size} rank(s) "
                          f"{sc.batch_size // world_size} samples a step, which training.accum_steps ({accum}) "
                          f"must split into equal micro-batches; set {stage.name}.batch_size to a multiple of "
                          f"{world_size * accum}, or another training.accum_steps")


def check_world_sizes(cfg: Config, names: list[str], world_size: int) -> None:
    """`check_world_size` of every training stage among ``names`` (the pipeline's, or the inputs a stage
    command builds): a mistake in the last stage is refused before the first one writes anything."""
    for name in names:
        spec = SPECS.get(name)
        if spec is not None and spec.section is not None:  # a stage that trains
            check_world_size(spec, cfg, world_size)


def loop_settings(cfg: Config, sc: StageConfig, info: DistInfo, name: str) -> LoopSettings:
    """The training loop's numbers for stage ``name`` (stage section ``sc``) at this world size;
    validation off (the stage's build turns it on) and the stage's resume hash (its inputs'
    provenance is added once they are known)."""
    return LoopSettings(
        steps=sc.steps, per_rank_batch=sc.batch_size // info.world_size,
        accum_steps=cfg.training.accum_steps, grad_clip=cfg.training.grad_clip,
        max_skips_in_a_row=cfg.training.max_skips_in_a_row, max_train_s=cfg.training.max_train_s,
        anneal_to_time=cfg.training.anneal_to == "time",
        checkpoint_every=cfg.training.checkpoint_every,
        keep_checkpoints=cfg.training.keep_checkpoints, log_every=cfg.logging.log_every,
        seed=cfg.training.seed, progress=cfg.logging.progress,
        autocast=lambda: compute_autocast(info.device, cfg.training.precision),
        validate_every=0, keep_best=False, config_hash=resume_hash(cfg, name), ema_decay=sc.ema_decay)


def execute_stage(cfg: Config, info: DistInfo, stage: StageSpec, *, resume: bool = True) -> int:
    """Build the stage with `stage.build(cfg, info, run_dir, logger)` and its validation
    (`StageSpec.validates`), train, export the weights and mark the stage complete; returns 0, or
    143 after a preemption checkpoint.

    Nothing in the run folder changes until the config, the data, the stage's inputs and the
    checkpoint to resume from have all passed: a user error (exit 2) leaves the folder as it was.
    """
    cfg = resolve_for(cfg, info.device)  # a config from load_config may still say auto
    name = stage.name
    sc = stage.section(cfg)
    check_world_size(stage, cfg, info.world_size)
    run_dir = run_dir_for(cfg)
    ckpt_dir = run_dir / "checkpoints" / name
    logger = setup_logging(run_dir, info, name, deferred=True)
    # An existing folder is locked at once (no other job moves files while this one reads them).
    took_lock = lock_run_folder(run_dir, info, create=False)
    configure_determinism(cfg)
    logger.info(f"{name}: rank {info.rank}/{info.world_size} on {info.device}, config {config_hash(cfg)}, "
                f"{describe(cfg.training)} ({AUTO_RULE}; config.json records the resolved values)")
    if info.device.type == "cuda":
        for problem in recipe_problems(cfg.training, torch.cuda.get_device_capability(info.device)):
            logger.warning(f"{name}: {problem}")
    settings = loop_settings(cfg, sc, info, name)
    parts = None
    try:
        check_source(cfg)  # a fine-tuning source that cannot serve is refused before the folder changes
        frozen = frozen_source(cfg, name)
        if frozen is not None:
            inputs = stage_inputs(cfg, run_dir, name)
            took_lock |= lock_run_folder(run_dir, info, create=True)
            open_rank_log(logger, run_dir, info)
            write_run_header(run_dir, cfg, info)
            return _publish_frozen(cfg, info, stage, frozen, inputs, run_dir, logger)
        with _log_crashes_to_run_folder(logger, run_dir, info):
            parts = with_validation(stage, cfg, info, run_dir, stage.build(cfg, info, run_dir, logger))
            inputs = stage_inputs(cfg, run_dir, name)
            # Checkpoints resume only for the same math on the same inputs (data, upstream weights).
            settings = dataclasses.replace(settings, config_hash=tree_hash({"config": settings.config_hash,
                                                                            "inputs": inputs}))
            start = find_resume_point(ckpt_dir, parts.model, parts.optimizer, info, logger,
                                      config_hash=settings.config_hash, resume=resume, ema=parts.ema)
        # Everything has passed: from here on this command writes the run folder.
        took_lock |= lock_run_folder(run_dir, info, create=True)
        open_rank_log(logger, run_dir, info)
        write_run_header(run_dir, cfg, info)
        _prepare_checkpoints(ckpt_dir, start, info, logger)
        return _train_and_publish(cfg, info, stage, parts, settings, start, inputs, run_dir, ckpt_dir, logger)
    finally:
        if parts is not None and hasattr(parts.loader, "close"):
            parts.loader.close()
        if took_lock:  # under entry.pipeline the pipeline holds it, and keeps it
            unlock_run_folder(run_dir)


@contextlib.contextmanager
def _log_crashes_to_run_folder(logger, run_dir: Path, info: DistInfo):
    """While a stage validates, its log is held in memory; a crash (not a user error) still goes
    to the rank's log file, with the records before it."""
    try:
        yield
    except USER_ERRORS:
        raise
    except BaseException:
        open_rank_log(logger, run_dir, info)
        logger.exception("the stage failed while it was being set up")
        raise


def _prepare_checkpoints(ckpt_dir: Path, start: ResumePoint, info: DistInfo, logger) -> None:
    """Rank 0: remove dead attempts' unfinished checkpoint folders; move checkpoints this stage must
    not resume aside (never deleting the newest `SET_ASIDE_KEPT` set-aside folders)."""
    if info.is_main:
        for leftover in remove_unfinished(ckpt_dir):
            logger.info(f"removed {leftover}, an unfinished checkpoint of a dead attempt")
    if not start.set_aside:
        return
    aside, removed = set_aside(ckpt_dir, start.stale_hash, info)
    rank0_published(info, wrote=True)  # no rank writes a checkpoint before rank 0 moved the old ones
    logger.warning(f"the checkpoints in {ckpt_dir} {start.set_aside}; moved them to {aside} and starting this "
                   f"stage afresh (set-aside folders kept: {[p.name for p in set_aside_folders(ckpt_dir)]}, at most "
                   f"{SET_ASIDE_KEPT}" + (f"; removed the oldest: {[p.name for p in removed]})" if removed else ")"))


def _train_and_publish(cfg: Config, info: DistInfo, stage: StageSpec, parts: StageParts, settings: LoopSettings,
                       start: ResumePoint, inputs: dict, run_dir: Path, ckpt_dir: Path, logger) -> int:
    """Train from `start`, export the weights (the best validation's with select=best) and write
    the done file; returns 0, or 143 after a preemption checkpoint."""
    name, sc = stage.name, stage.section(cfg)
    if parts.optimizer is None and settings.steps:
        logger.warning(f"{name}: the model has no trainable parameters (latent.hidden=0: the codec is its fitted "
                       f"linear path), so {name}.steps={settings.steps} is ignored")
        settings = dataclasses.replace(settings, steps=0)
        sc = dataclasses.replace(sc, steps=0)
    # Only the stages that build a `validate` (autoencoder, operator, steady) validate and select;
    # a stage of no steps has nothing to select between.
    validating = parts.validate is not None and cfg.evaluation.val_every > 0 and sc.steps > 0
    keep_best = validating and cfg.evaluation.select == "best"
    settings = dataclasses.replace(settings, validate_every=cfg.evaluation.val_every if validating else 0,
                                   keep_best=keep_best)
    sink = MetricsSink(run_dir, cfg, info, name)
    moved = sink.supersede_after(start.step)
    if moved:
        logger.info(f"{name}: moved {moved} metrics line(s) of steps after {start.step} (an earlier attempt's) "
                    f"to {run_dir / 'metrics.superseded.jsonl'}")
    exit_code = 1
    try:
        try:
            last = train_stage(parts, settings, info, run_dir=run_dir, ckpt_dir=ckpt_dir, logger=logger, sink=sink,
                               on_oom=cfg.training.on_oom, start=start)
        except Preempted as e:
            logger.warning(f"{e}; exiting with {EXIT_PREEMPTED}")
            exit_code = EXIT_PREEMPTED
            return EXIT_PREEMPTED
        except NonFiniteError as e:
            logger.error(str(e))  # every rank raises this together; each log says why it stops
            raise
        fields = {"final_metrics": last}
        if keep_best:
            # The last weights stay beside the best ones; the stage's weights file gets the best.
            last_file = best_weights_dir(run_dir) / f"{name}_last.pt"
            if info.is_main:
                last_file.parent.mkdir(parents=True, exist_ok=True)
            export_weights(validated_module(parts), last_file, info)
            if info.is_main:
                fields |= publish_best(run_dir, name, last_file, logger)
        else:
            export_weights(validated_module(parts), weights_file(run_dir, name), info)
        if info.is_main:
            write_done(run_dir, name, cfg, inputs, fields)
            if sc.steps > 0 and cfg.logging.plots:
                curve = plot_training_curves(run_dir / "metrics.jsonl", name, run_dir / "plots" / f"{name}_loss.png")
                logger.info(f"{name}: loss curve in {curve}")
        # The next stage (in this process, under entry.pipeline) reads these weights on every rank.
        rank0_published(info, wrote=True)
        # A time budget may have ended the stage before `steps`: the log says how far it went.
        logger.info(f"{name}: finished at step {last['step']} of {sc.steps}; weights in {weights_file(run_dir, name)}")
        exit_code = 0
        return 0
    finally:
        sink.close(exit_code)


def _publish_frozen(cfg: Config, info: DistInfo, stage: StageSpec, source: Path, inputs: dict, run_dir: Path,
                    logger) -> int:
    """A stage `finetune.freeze` names: the source run's weights (and their description) copied
    into the run folder, or what its `StageSpec.frozen` makes of them, and its done file written,
    nothing trained; returns 0."""
    name = stage.name
    if info.is_main:
        made = stage.frozen(cfg, logger) if stage.frozen is not None else None
        if made is None:
            publish_weights(source, weights_file(run_dir, name))
        else:
            export_module(made, weights_file(run_dir, name))
        write_done(run_dir, name, cfg, inputs, {"frozen": True})
    rank0_published(info, wrote=True)  # the next stage reads these weights on every rank
    logger.info(f"{name}: frozen (finetune.freeze): the weights of {source}, not trained")
    return 0


def publish_best(run_dir: Path, stage: str, last_file: Path, logger) -> dict:
    """Rank 0: copy the best validation's weights (or `last_file` when no validation was finite)
    to the stage's weights file, atomically; returns the done-file fields `select`, `best_step`
    and `best_val_nrmse`."""
    record = read_best_record(best_weights_dir(run_dir), stage)
    if record is None:
        logger.warning(f"{stage}: no finite validation nRMSE was recorded; publishing the last weights")
        source, fields = last_file, {"best_step": None, "best_val_nrmse": None}
    else:
        source, fields = record["file"], {"best_step": record["step"], "best_val_nrmse": record["val_nrmse"]}
        logger.info(f"{stage}: publishing the best validation's weights (step {record['step']}, "
                    f"val_nrmse {record['val_nrmse']:.4g})")
        if record["step"] == 0:
            logger.warning(untrained_start_line(stage, record["val_nrmse"]))
    # Atomic: the next stage or evaluation never sees a half-written file.
    publish_weights(source, weights_file(run_dir, stage))
    return {"select": "best", **fields}
