"""The generic training loop every stage uses: optimizer steps (entry.training.step) and what
happens between them.

Per optimizer step, every rank does the same collectives in the same order:
  micro-steps (FSDP2 all-gathers / reduce-scatters or DDP all-reduces, gradient sync on the
  last micro-step only) -> global gradient norm -> ONE all_reduce of [non-finite flag, stop flag,
  loss, grad norm, metrics], read back once: the step's only device-to-host sync
  -> optimizer step or a skip that all ranks agree on -> (every log_every) a metrics line from
  the values already read (on CUDA its clock reading adds one sync)
  -> (every validate_every, and after the last step) validation on every rank, its scores agreed
     by one all_reduce, then (select=best, on improvement) the best-weights export
  -> (every checkpoint_every) checkpoint.
An exception inside a micro-step (out of memory included) cannot be agreed on, because the
other ranks already wait inside that step's collectives: the failing rank logs the cause,
leaves an out-of-memory record for the restarted job, and re-raises so the process exits
non-zero and torchrun stops the job (docs/design.md, distributed rule 2).

`train_wall_s` counts the wall seconds spent training the stage (data, steps, checkpoints),
validation excluded, across resumed attempts; it is written into every metrics line. With
`training.max_train_s` it is also a budget: a step that would take the clock past it is not
started (judged by the step before: the time between the last two step starts), and the step
before it is the stage's last one (logged, validated, checkpointed as the last of `steps` is);
with `training.anneal_to: time` the learning rate decays over that budget too
(entry.stages.stage_build.CosineSchedule), so a stage its budget stops ends annealed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from entry.distributed import hooks
from entry.distributed.process_group import DistInfo
from entry.distributed.sharding import shard_units, unwrap
from entry.storage.run_folder import show_progress
from entry.training import checkpoint as ckpt
from entry.training.clock import TrainClock
from entry.training.failures import micro_batching, record_failure
from entry.training.model_selection import BestWeights, validate_and_log
from entry.training.resume import ResumePoint, find_resume_point
from entry.training.step import LoopSettings, StageParts, StepPhase, StepResult, train_step, validated_module
from entry.training.stop_flag import StopFlag

EXIT_PREEMPTED = 143


class NonFiniteError(RuntimeError):
    """Raised on every rank together when too many optimizer steps in a row were non-finite."""


class Preempted(Exception):
    """Raised on every rank together after a SIGTERM or SIGINT, once a checkpoint is written."""


def best_weights_dir(run_dir: Path) -> Path:
    """Folder of the best-so-far weights and their records (entry.training.checkpoint.save_best_weights)."""
    return run_dir / "weights"


@dataclass
class LoopPosition:
    """Where a stage's training stands; a checkpoint stores it and a resumed attempt continues it."""

    step: int = 0
    epoch: int = 0
    skips: int = 0
    """Non-finite optimizer steps in a row."""
    loader_state: dict[str, Any] | None = None
    wall_s: float = 0.0
    """Training seconds of earlier attempts (validation excluded)."""


def train_stage(parts: StageParts, settings: LoopSettings, info: DistInfo, *, run_dir: Path, ckpt_dir: Path,
                logger, sink, on_oom: str, resume: bool = True, start: ResumePoint | None = None) -> dict[str, float]:
    """Run `settings.steps` optimizer steps of one stage (fewer when `settings.max_train_s` runs
    out first); returns the last averaged metrics with ``step``, the optimizer steps taken in all.

    Starts from `start` (entry.training.resume.find_resume_point, already loaded into the model and
    optimizer); without one, finds it here in `ckpt_dir` when `resume` is set. A resumed run
    continues step, data position, scheduler and training wall time. With `parts.validate` and
    `settings.validate_every > 0`, validates every `validate_every` steps and after the last one,
    logging `val_nrmse` lines; with `settings.keep_best`, exports the weights of each improving
    validation to `best_weights_dir(run_dir)`. Raises `NonFiniteError`, `Preempted`, or whatever
    a step (or a validation) raised; never returns after a failure.
    """
    stage = parts.name
    micro, accum = micro_batching(run_dir, stage, settings, on_oom, logger)
    pos, start = _starting_position(parts, ckpt_dir, settings, info, logger, resume, start)
    validating = parts.validate is not None and settings.validate_every > 0
    best = _open_best(run_dir, stage, info, start, logger) if validating and settings.keep_best else None
    now = StepPhase(step=pos.step)
    armed = hooks.model_ready(stage, shard_units(unwrap(parts.model)), info.rank, info.restart_count, now)
    stop = StopFlag()
    _position_loader(parts.loader, pos)
    run = _StageRun(parts, settings, info, ckpt_dir, logger, sink, pos, TrainClock(info.device, pos.wall_s), best,
                    stop)
    batches = iter(parts.loader)
    bar, outputs = _progress_bar(settings, info, logger, stage, pos.step)
    try:
        if validating and pos.step == 0 and settings.steps > 0:
            # The untrained model's score: the start of the validation curve (and, with
            # select=best, the weights kept if training never improves on them).
            now.enter("validation")
            run.validate(0)
        while pos.step < settings.steps and not run.ended_early:
            now.step = pos.step
            hooks.before_step(stage, info.rank, pos.step, info.restart_count)
            try:
                late = run.last_step_that_fits()
                now.enter("loading a batch", micro=0)
                batch, batches, pos.epoch = _next_batch(parts.loader, batches, pos.epoch)
                result = train_step(parts, batch.to(info.device, non_blocking=True), pos.step, settings, info,
                                    micro=micro, accum=accum, stop_requested=stop.requested, out_of_time=late,
                                    now=now)
                run.after_step(result, bar, validating, now)
            except (NonFiniteError, Preempted, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # DCP's CheckpointException is a BaseException: log it too
                record_failure(e, info, stage, pos.step, now, run_dir, logger)
                raise
    finally:
        outputs.close()
        if bar is not None:
            bar.close()
        stop.restore()
        for handle in armed:
            handle.remove()
    return run.last | {"step": pos.step}


def _starting_position(parts: StageParts, ckpt_dir: Path, settings: LoopSettings, info: DistInfo, logger,
                       resume: bool, start: ResumePoint | None) -> tuple[LoopPosition, ResumePoint]:
    """The position to start from: a checkpoint's (model and optimizer already loaded, the scheduler
    loaded here) or step 0."""
    if start is None:
        start = find_resume_point(ckpt_dir, parts.model, parts.optimizer, info, logger,
                                  config_hash=settings.config_hash, resume=resume, ema=parts.ema)
    if start.loop_state is None:
        return LoopPosition(), start
    state = start.loop_state
    pos = LoopPosition(step=state[ckpt.KEY_STEP], epoch=state[ckpt.KEY_EPOCH], skips=state[ckpt.KEY_SKIPS],
                       loader_state=state[ckpt.KEY_LOADER],
                       wall_s=float(state.get(ckpt.KEY_TRAIN_WALL_S, 0.0)))  # older checkpoints lack it
    parts.scheduler.load_state_dict(state[ckpt.KEY_SCHEDULER])
    logger.info(f"{parts.name}: resumed from {start.checkpoint} at step {pos.step}")
    return pos, start


def _open_best(run_dir: Path, stage: str, info: DistInfo, start: ResumePoint, logger) -> BestWeights:
    best = BestWeights(best_weights_dir(run_dir), stage, info, resumed=start.checkpoint is not None)
    if best.step is not None:
        logger.info(f"{stage}: best validation so far: val_nrmse {best.val_nrmse:.4g} at step {best.step}")
    return best


def _position_loader(loader, pos: LoopPosition) -> None:
    """Put the loader where `pos` stands (its state on resume, else the start of `pos.epoch`)."""
    if pos.loader_state is None:
        loader.set_epoch(pos.epoch)
        return
    loader.load_state_dict(pos.loader_state)
    # The loader's position decides the epoch: a checkpoint taken after an epoch's last batch
    # resumes at the next epoch, as the uninterrupted run does.
    pos.epoch = loader.epoch


def _progress_bar(settings: LoopSettings, info: DistInfo, logger, stage: str, step: int):
    """(tqdm bar or None, ExitStack to close). A bar only on a terminal of rank 0: in a log file its
    carriage-return redraws are noise, and the metric lines already say how far the stage is."""
    outputs = contextlib.ExitStack()
    if not (info.is_main and show_progress(settings.progress)):
        return None, outputs
    bar = tqdm(total=settings.steps, initial=step, desc=stage, unit="step", dynamic_ncols=True)
    outputs.enter_context(logging_redirect_tqdm(loggers=[logger]))  # log lines print above the bar
    return bar, outputs


@dataclass
class _StageRun:
    """A stage's training after each optimizer step: skip accounting, metric lines, validation,
    checkpoints."""

    parts: StageParts
    settings: LoopSettings
    info: DistInfo
    ckpt_dir: Path
    logger: Any
    sink: Any
    pos: LoopPosition
    clock: TrainClock
    best: BestWeights | None
    stop: StopFlag
    window: list[list[float]] = field(default_factory=list)
    """Per step since the last metric line: [loss, grad norm, *metrics]."""
    last: dict[str, float] = field(default_factory=dict)
    ended_early: bool = False
    """The ranks agreed the time budget has no room for another step: the stage has ended."""
    _step_started_s: float | None = None

    def last_step_that_fits(self) -> bool:
        """With `settings.max_train_s`, whether the step about to start is the last that fits: after
        it, one more step as long as the previous one would pass the budget. Reads the clock (on
        CUDA a sync) only when a budget is set."""
        budget = self.settings.max_train_s
        if budget <= 0:
            return False
        now_s = self.clock.seconds()
        previous_s = 0.0 if self._step_started_s is None else now_s - self._step_started_s
        self._step_started_s = now_s
        if self.settings.anneal_to_time and self.parts.scheduler is not None:
            # The budget spent once this step ends, judged by the step before it, as the stop rule is.
            self.parts.scheduler.time_spent = min(1.0, (now_s + previous_s) / budget)
        return now_s + 2 * previous_s >= budget

    def after_step(self, result: StepResult, bar, validating: bool, now: StepPhase) -> None:
        pos, settings = self.pos, self.settings
        self._count_skip(result.skipped)
        pos.step += 1
        if bar is not None:
            bar.update(1)
        self.window.append(result.values)
        # Out of time (and not preempted), this step is the stage's last, as step `steps` would be.
        self.ended_early = result.out_of_time and not result.stopping and pos.step < settings.steps
        last = pos.step == settings.steps or self.ended_early
        if self.ended_early:
            self.logger.info(f"{self.parts.name}: training.max_train_s={settings.max_train_s:g} leaves no room for "
                             f"another step; the stage ends at step {pos.step} of {settings.steps}")
        if pos.step % settings.log_every == 0 or last:
            self._log_line(result.names, bar)
        # Skipped when preempting: the grace period before SIGKILL belongs to the checkpoint.
        if validating and not result.stopping and (pos.step % settings.validate_every == 0 or last):
            now.enter("validation", micro=0)
            self.validate(pos.step)
        now.enter("writing a checkpoint (torch.distributed.checkpoint collectives)")
        if result.stopping:
            self.checkpoint()
            raise Preempted(f"{self.parts.name}: {self.stop.why()}; checkpoint written at step {pos.step}")
        if pos.step % settings.checkpoint_every == 0 or last:
            self.checkpoint()

    def _count_skip(self, skipped: bool) -> None:
        if not skipped:
            self.pos.skips = 0
            return
        self.pos.skips += 1
        stage, limit = self.parts.name, self.settings.max_skips_in_a_row
        self.logger.warning(f"{stage}: non-finite loss or gradient at step {self.pos.step} on some rank; "
                            f"all ranks skip this optimizer step ({self.pos.skips} in a row)")
        if self.pos.skips > limit:
            raise NonFiniteError(
                f"{stage}: {self.pos.skips} non-finite steps in a row (training.max_skips_in_a_row={limit}); "
                f"stopping. The last good checkpoint is kept in {self.ckpt_dir}. Lower the learning rate or "
                f"check the data.")

    def _log_line(self, names: list[str], bar) -> None:
        mean = [sum(column) / len(self.window) for column in zip(*self.window)]
        self.window = []
        self.last = dict(zip(names, mean))
        self.last["lr"] = self.parts.scheduler.get_last_lr()[0]
        self.last["train_wall_s"] = self.clock.seconds()
        self.sink.log(self.pos.step, self.last)
        if bar is not None:
            bar.set_postfix(loss=f"{self.last['loss']:.4g}", refresh=False)
        self.logger.info(f"{self.parts.name} step {self.pos.step}/{self.settings.steps} " +
                         " ".join(f"{k} {v:.4g}" for k, v in self.last.items()))

    def validate(self, step: int) -> None:
        validate_and_log(self.parts, validated_module(self.parts), self.info, step, self.settings.steps, self.clock,
                         self.best, self.sink, self.logger)

    def checkpoint(self) -> None:
        pos = self.pos
        state = {ckpt.KEY_STEP: pos.step, ckpt.KEY_EPOCH: pos.epoch, ckpt.KEY_SKIPS: pos.skips,
                 ckpt.KEY_LOADER: self.parts.loader.state_dict(), ckpt.KEY_SCHEDULER: self.parts.scheduler.state_dict(),
                 ckpt.KEY_TRAIN_WALL_S: self.clock.seconds(), ckpt.KEY_CONFIG_HASH: self.settings.config_hash}
        ckpt.save_checkpoint(self.ckpt_dir, self.info, self.parts.model, self.parts.optimizer, state,
                             keep=self.settings.keep_checkpoints, ema=self.parts.ema)


def _next_batch(loader, batches, epoch: int):
    """The next batch, starting the next epoch (reshuffled) when this one is exhausted."""
    try:
        return next(batches), batches, epoch
    except StopIteration:
        loader.set_epoch(epoch + 1)
        batches = iter(loader)
        return next(batches), batches, epoch + 1
