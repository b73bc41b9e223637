"""The generic training loop every stage uses: a step function, its models, a loader, an optimizer.

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
non-zero and torchrun stops the job (DESIGN.md, distributed rule 2).

`train_wall_s` counts the wall seconds spent training the stage (data, steps, checkpoints),
validation excluded, across resumed attempts; it is written into every metrics line.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import torch
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from entry import checkpoint as ckpt
from entry import faults
from entry.distributed import DistInfo, all_reduce_mean
from entry.resume import ResumePoint, find_resume_point
from entry.run_files import show_progress
from entry.sharding import gradient_sync, shard_units, unwrap

EXIT_PREEMPTED = 143


class NonFiniteError(RuntimeError):
    """Raised on every rank together when too many optimizer steps in a row were non-finite."""


class Preempted(Exception):
    """Raised on every rank together after a SIGTERM, once a checkpoint is written."""


@dataclass
class StageParts:
    """What a stage hands to the loop."""

    name: str
    model: nn.Module
    step_fn: Callable
    step_cfg: Any
    loader: Any
    optimizer: torch.optim.Optimizer | None
    """None only for a model with nothing to train (then `steps` must be 0)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    frozen: dict[str, nn.Module] = field(default_factory=dict)
    after_step: Callable[[], None] | None = None
    validate: Callable[[nn.Module], dict[str, float]] | None = None
    """`validate(model) -> {task_key: validation nRMSE}`; the loop calls it on every rank under
    no_grad and eval mode, so it must run the same forwards everywhere (FSDP2 forwards gather)."""
    val_extras: dict[str, float] = field(default_factory=dict)
    """Fixed numbers logged with every validation (the frozen codec's reconstruction nRMSE of the
    validation frames, `val_recon_nrmse/<task>`: the floor under `val_nrmse`)."""


@dataclass(frozen=True)
class LoopSettings:
    """Numbers the loop needs, resolved from the config by the entry."""

    steps: int
    per_rank_batch: int
    accum_steps: int
    grad_clip: float
    max_skips_in_a_row: int
    checkpoint_every: int
    keep_checkpoints: int
    log_every: int
    seed: int
    autocast: Callable[[], Any] = contextlib.nullcontext
    """Context factory for every training forward (entry.precision.compute_autocast: bf16 autocast
    on every layout for precision bf16)."""
    progress: bool = False
    validate_every: int = 0
    """Optimizer steps between validations (0: none); with a `validate`, one also follows the last step."""
    keep_best: bool = False
    """Export the weights of every improving validation to `best_weights_dir(run_dir)` (select=best)."""
    config_hash: str = ""
    """What a checkpoint must have been written for to be resumed (entry.runner: the stage's
    resume hash and the provenance of its inputs), stored in each checkpoint: a run never resumes
    the checkpoints of a config that computes something else, or of other data or upstream weights."""


def best_weights_dir(run_dir: Path) -> Path:
    """Folder of the best-so-far weights and their records (entry.checkpoint.save_best_weights)."""
    return run_dir / "weights"


def oom_record_dir(run_dir: Path) -> Path:
    return run_dir / "oom_records"


def count_oom_records(run_dir: Path, stage: str) -> int:
    """Out-of-memory records left by failed attempts of `stage` (each halves the micro-batch)."""
    folder = oom_record_dir(run_dir)
    if not folder.is_dir():
        return 0
    # Several ranks may record the same failed attempt: count attempts, not files.
    return len({p.stem.rsplit("-attempt", 1)[-1] for p in folder.glob(f"{stage}-rank*-attempt*.json")})


def micro_batches(per_rank_batch: int, accum_steps: int, oom_count: int, stage: str) -> tuple[int, int]:
    """(micro-batch, accum_steps) after `oom_count` halvings; the product stays `per_rank_batch`."""
    accum = accum_steps * 2 ** oom_count
    if per_rank_batch % accum:
        raise RuntimeError(
            f"{stage}: after {oom_count} out-of-memory restart(s) the per-rank batch {per_rank_batch} "
            f"cannot be split into {accum} micro-batches; lower {stage}.batch_size, use more GPUs, "
            f"set training.cpu_offload=true, or shrink the model")
    return per_rank_batch // accum, accum


def _memory_report(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu (no device memory statistics)"
    gib = 2 ** 30
    return (f"allocated {torch.cuda.memory_allocated(device) / gib:.2f} GiB, reserved "
            f"{torch.cuda.memory_reserved(device) / gib:.2f} GiB, peak {torch.cuda.max_memory_allocated(device) / gib:.2f} GiB")


class _StopFlag:
    """SIGTERM sets it; the loop agrees on it with the other ranks at the step's flag all_reduce."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)


def _split(batch, micro: int, index: int):
    return batch[index * micro:(index + 1) * micro]


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


@dataclass
class StepPhase:
    """What the current optimizer step is doing, so a failure (a collective that timed out, say)
    names it; the injected-fault hook of entry.faults reads `step`."""

    step: int = 0
    phase: str = "loading a batch"
    micro: int = 0

    def enter(self, phase: str, micro: int | None = None) -> None:
        self.phase = phase
        if micro is not None:
            self.micro = micro


@dataclass(frozen=True)
class StepResult:
    """What every rank agreed on after one optimizer step (`train_step`)."""

    skipped: bool
    """Some rank saw a non-finite loss or gradient: no rank stepped the optimizer."""
    stopping: bool
    """Some rank got SIGTERM: every rank checkpoints and stops after this step."""
    values: list[float]
    """[loss, grad norm, *metrics], averaged over micro-batches and ranks."""
    names: list[str]
    """Names of ``values``."""


def train_step(parts: StageParts, batch, step: int, settings: LoopSettings, info: DistInfo, *, micro: int,
               accum: int, stop_requested: bool = False, fault=None, now: StepPhase | None = None) -> StepResult:
    """One optimizer step of a built stage, exactly as `train_stage` takes it: forward and backward
    of ``accum`` micro-batches of ``micro`` rows of ``batch`` (already on the device), the global
    gradient norm (clipped), one all_reduce that agrees on non-finite values and SIGTERM, then the
    optimizer and scheduler step (and ``parts.after_step``), or on every rank a skip. The benchmarks
    time this function, so they time the training path itself."""
    now = StepPhase(step=step) if now is None else now
    loss_sum, metric_sum, metrics = _accumulate(parts, parts.model, batch, micro, accum, step, settings, info,
                                                fault, now)
    now.enter("the gradient-norm all_reduce")
    grad_norm = global_grad_norm([p for p in parts.model.parameters() if p.requires_grad], settings.grad_clip)
    now.enter("the all_reduce that agrees on non-finite values and SIGTERM")
    bad, stopping, values = agree_on_step(loss_sum, grad_norm, metric_sum, stop_requested, info)
    if bad:
        parts.optimizer.zero_grad(set_to_none=True)
    else:
        now.enter("the optimizer step")
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)
        parts.scheduler.step()
        if parts.after_step is not None:
            parts.after_step()
    return StepResult(bad, stopping, values, ["loss", "grad_norm", *metrics.keys()])


def train_stage(parts: StageParts, settings: LoopSettings, info: DistInfo, *, run_dir: Path, ckpt_dir: Path,
                logger, sink, on_oom: str, resume: bool = True, start: ResumePoint | None = None) -> dict[str, float]:
    """Run `settings.steps` optimizer steps of one stage; returns the last averaged metrics.

    Starts from `start` (entry.resume.find_resume_point, already loaded into the model and
    optimizer); without one, finds it here in `ckpt_dir` when `resume` is set. A resumed run
    continues step, data position, scheduler and training wall time. With `parts.validate` and
    `settings.validate_every > 0`, validates every `validate_every` steps and after the last one,
    logging `val_nrmse` lines; with `settings.keep_best`, exports the weights of each improving
    validation to `best_weights_dir(run_dir)`. Raises `NonFiniteError`, `Preempted`, or whatever
    a step (or a validation) raised; never returns after a failure.
    """
    stage = parts.name
    micro, accum = _micro_batching(run_dir, stage, settings, on_oom, logger)
    pos, start = _starting_position(parts, ckpt_dir, settings, info, logger, resume, start)
    validating = parts.validate is not None and settings.validate_every > 0
    best = _open_best(run_dir, stage, info, start, logger) if validating and settings.keep_best else None
    fault = faults.fault_from_env(stage)
    now = StepPhase(step=pos.step)
    hook = faults.arm_forward_fault(fault, shard_units(unwrap(parts.model)), info.rank, info.restart_count, now)
    stop = _StopFlag()
    _position_loader(parts.loader, pos)
    run = _StageRun(parts, settings, info, ckpt_dir, logger, sink, pos, _TrainClock(info.device, pos.wall_s), best)
    batches = iter(parts.loader)
    bar, outputs = _progress_bar(settings, info, logger, stage, pos.step)
    try:
        if validating and pos.step == 0 and settings.steps > 0:
            # The untrained model's score: the start of the validation curve (and, with
            # select=best, the weights kept if training never improves on them).
            now.enter("validation")
            run.validate(0)
        while pos.step < settings.steps:
            now.step = pos.step
            faults.before_step(fault, info.rank, pos.step, info.restart_count)
            try:
                now.enter("loading a batch", micro=0)
                batch, batches, pos.epoch = _next_batch(parts.loader, batches, pos.epoch)
                result = train_step(parts, batch.to(info.device, non_blocking=True), pos.step, settings, info,
                                    micro=micro, accum=accum, stop_requested=stop.requested, fault=fault, now=now)
                run.after_step(result, bar, validating, now)
            except (NonFiniteError, Preempted, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # DCP's CheckpointException is a BaseException: log it too
                _record_failure(e, info, stage, pos.step, now, run_dir, logger)
                raise
    finally:
        outputs.close()
        if bar is not None:
            bar.close()
        stop.restore()
        if hook is not None:
            hook.remove()
    return run.last


def _micro_batching(run_dir: Path, stage: str, settings: LoopSettings, on_oom: str, logger) -> tuple[int, int]:
    """(micro-batch, accum_steps), halved once per out-of-memory record with on_oom=shrink."""
    oom_count = count_oom_records(run_dir, stage) if on_oom == "shrink" else 0
    micro, accum = micro_batches(settings.per_rank_batch, settings.accum_steps, oom_count, stage)
    if oom_count:
        logger.info(f"{stage}: {oom_count} earlier out-of-memory record(s): micro-batch {micro}, accum_steps {accum}")
    return micro, accum


def _starting_position(parts: StageParts, ckpt_dir: Path, settings: LoopSettings, info: DistInfo, logger,
                       resume: bool, start: ResumePoint | None) -> tuple[LoopPosition, ResumePoint]:
    """The position to start from: a checkpoint's (model and optimizer already loaded, the scheduler
    loaded here) or step 0."""
    if start is None:
        start = find_resume_point(ckpt_dir, parts.model, parts.optimizer, info, logger,
                                  config_hash=settings.config_hash, resume=resume)
    if start.loop_state is None:
        return LoopPosition(), start
    state = start.loop_state
    pos = LoopPosition(step=state[ckpt.KEY_STEP], epoch=state[ckpt.KEY_EPOCH], skips=state[ckpt.KEY_SKIPS],
                       loader_state=state[ckpt.KEY_LOADER],
                       wall_s=float(state.get(ckpt.KEY_TRAIN_WALL_S, 0.0)))  # older checkpoints lack it
    parts.scheduler.load_state_dict(state[ckpt.KEY_SCHEDULER])
    logger.info(f"{parts.name}: resumed from {start.checkpoint} at step {pos.step}")
    return pos, start


def _open_best(run_dir: Path, stage: str, info: DistInfo, start: ResumePoint, logger) -> "_Best":
    best = _Best(best_weights_dir(run_dir), stage, info, resumed=start.checkpoint is not None)
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
    clock: "_TrainClock"
    best: "_Best | None"
    window: list[list[float]] = field(default_factory=list)
    """Per step since the last metric line: [loss, grad norm, *metrics]."""
    last: dict[str, float] = field(default_factory=dict)

    def after_step(self, result: StepResult, bar, validating: bool, now: StepPhase) -> None:
        pos, settings = self.pos, self.settings
        self._count_skip(result.skipped)
        pos.step += 1
        if bar is not None:
            bar.update(1)
        self.window.append(result.values)
        if pos.step % settings.log_every == 0 or pos.step == settings.steps:
            self._log_line(result.names, bar)
        # Skipped when preempting: the grace period before SIGKILL belongs to the checkpoint.
        if validating and not result.stopping and (pos.step % settings.validate_every == 0
                                                   or pos.step == settings.steps):
            now.enter("validation", micro=0)
            self.validate(pos.step)
        now.enter("writing a checkpoint (torch.distributed.checkpoint collectives)")
        if result.stopping:
            self.checkpoint()
            raise Preempted(f"{self.parts.name}: SIGTERM received; checkpoint written at step {pos.step}")
        if pos.step % settings.checkpoint_every == 0 or pos.step == settings.steps:
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
        _validate_and_log(self.parts, self.parts.model, self.info, step, self.settings.steps, self.clock,
                          self.best, self.sink, self.logger)

    def checkpoint(self) -> None:
        pos = self.pos
        state = {ckpt.KEY_STEP: pos.step, ckpt.KEY_EPOCH: pos.epoch, ckpt.KEY_SKIPS: pos.skips,
                 ckpt.KEY_LOADER: self.parts.loader.state_dict(), ckpt.KEY_SCHEDULER: self.parts.scheduler.state_dict(),
                 ckpt.KEY_TRAIN_WALL_S: self.clock.seconds(), ckpt.KEY_CONFIG_HASH: self.settings.config_hash}
        ckpt.save_checkpoint(self.ckpt_dir, self.info, self.parts.model, self.parts.optimizer, state,
                             keep=self.settings.keep_checkpoints)


class _TrainClock:
    """Wall seconds spent training, continued from `start_s` (a resumed attempt's count).

    On CUDA every reading synchronises the device first: kernels still queued would otherwise be
    counted after the reading (in validation time, say) instead of in the training they belong to.
    """

    def __init__(self, device: torch.device, start_s: float):
        self.device, self.total = device, start_s
        self._since = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a CPU-GPU sync point, once per reading
        return time.perf_counter()

    def seconds(self) -> float:
        """Training seconds up to now."""
        now = self._now()
        self.total += now - self._since
        self._since = now
        return self.total

    def skip(self) -> None:
        """Leave the time since the last reading out of the count (it was spent validating)."""
        self._since = self._now()


class _Best:
    """The best validation so far and its exported weights (evaluation.select=best).

    A resumed attempt takes the best from the record on disk, which always describes the file it
    names (entry.checkpoint.save_best_weights), even when a failed attempt wrote it after the
    checkpoint it resumes from: those weights and their score are still a real measurement, and
    the record's step and score then stay true of the file. A fresh start removes an older
    run's record.
    """

    def __init__(self, folder: Path, stage: str, info: DistInfo, *, resumed: bool):
        self.folder, self.stage, self.info = folder, stage, info
        self.step: int | None = None
        self.val_nrmse = math.inf
        record = ckpt.read_best_record(folder, stage) if resumed else None
        if record is not None:
            self.step, self.val_nrmse = int(record["step"]), float(record["val_nrmse"])
        elif not resumed:
            ckpt.clear_best_weights(folder, stage, info)

    def offer(self, model: nn.Module, step: int, val_nrmse: float) -> bool:
        """Export the weights if `val_nrmse` improves on the best (collective: every rank calls it
        with the same, all-reduced value, so all take the same branch). NaN never improves."""
        if not val_nrmse < self.val_nrmse:
            return False
        ckpt.save_best_weights(model, self.folder, self.stage, step=step, val_nrmse=val_nrmse, info=self.info)
        self.step, self.val_nrmse = step, val_nrmse
        return True


def _validation_scores(parts: StageParts, model: nn.Module, info: DistInfo) -> dict[str, float]:
    """`{"val_nrmse": mean over tasks, "val_nrmse/<task_key>": per task}`, the same on every rank.

    Runs `parts.validate` under no_grad in eval mode (back to train mode after, also on errors).
    The per-task values are averaged over ranks by one all_reduce: every rank saw the same samples,
    and this makes the numbers bitwise equal, so every rank takes the same best-weights decision.
    """
    model.eval()
    try:
        # No autocast: the final evaluation runs the exported weights in fp32, and validation is
        # there to predict its score. FSDP2's bf16 policy still gathers bf16 parameters, but its
        # root keeps the rolled-out latent state in fp32 (entry.precision), as on one device.
        with torch.no_grad():
            per_task = parts.validate(model)
    finally:
        model.train()
    if not per_task:
        raise ValueError(f"{parts.name}: validate returned no task scores")
    keys = sorted(per_task)
    values = torch.tensor([float(per_task[k]) for k in keys], dtype=torch.float64, device=info.device)
    values = all_reduce_mean(values, info).tolist()
    return {"val_nrmse": sum(values) / len(values), **{f"val_nrmse/{k}": v for k, v in zip(keys, values)}}


def _validate_and_log(parts: StageParts, model: nn.Module, info: DistInfo, step: int, steps: int,
                      clock: _TrainClock, best: _Best | None, sink, logger) -> None:
    """One validation: scores, a metrics line, the best-weights export; none of it counts as training time."""
    wall_s = clock.seconds()
    scores = _validation_scores(parts, model, info)
    improved = best is not None and best.offer(model, step, scores["val_nrmse"])
    clock.skip()
    scores |= parts.val_extras
    sink.log(step, {**scores, "train_wall_s": wall_s})
    logger.info(f"{parts.name} step {step}/{steps} " + " ".join(f"{k} {v:.4g}" for k, v in scores.items())
                + f" train_wall_s {wall_s:.1f}" + (" (best so far: weights exported)" if improved else ""))


def _next_batch(loader, batches, epoch: int):
    """The next batch, starting the next epoch (reshuffled) when this one is exhausted."""
    try:
        return next(batches), batches, epoch
    except StopIteration:
        loader.set_epoch(epoch + 1)
        batches = iter(loader)
        return next(batches), batches, epoch + 1


def _accumulate(parts: StageParts, model: nn.Module, batch, micro: int, accum: int, step: int,
                settings: LoopSettings, info: DistInfo, fault, now: StepPhase):
    """Forward and backward of every micro-batch; gradients sync on the last one only.

    Returns (mean loss, mean metric values, the last metrics TensorDict for their names).
    """
    # The same generator on every rank: per-sample noise comes from sample ids, so the math
    # does not depend on how samples are spread over ranks.
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    loss_sum = torch.zeros((), device=info.device)
    metric_sum, metrics = None, None
    for m in range(accum):
        now.enter("the forward pass (FSDP2 parameter all-gathers)", micro=m)
        with gradient_sync(model, m == accum - 1):
            with settings.autocast():  # forward only: backward ops follow the forward's dtypes
                named = dict(model.named_parameters())
                loss, metrics = parts.step_fn(model, named, _split(batch, micro, m), cfg=parts.step_cfg,
                                              generator=generator, **parts.frozen)
            loss = faults.poison_loss(fault, info.rank, step, info.restart_count, loss)
            now.enter("the backward pass (FSDP2 reduce-scatters / DDP all-reduces)")
            (loss / accum).backward()
        loss_sum += loss.detach().float() / accum
        values = torch.stack([v.detach().float() for v in metrics.values()]) / accum
        metric_sum = values if metric_sum is None else metric_sum + values
    return loss_sum, metric_sum, metrics


def agree_on_step(loss: torch.Tensor, grad_norm: torch.Tensor, metrics: torch.Tensor, stop_requested: bool,
                  info: DistInfo) -> tuple[bool, bool, list[float]]:
    """What every rank agrees on after a step's backward, with one all_reduce and one read.

    Packs [non-finite flag, SIGTERM flag, loss, grad norm, *metrics] into one fp32 tensor on the
    device, averages it over ranks and reads it back once. A flag's mean over ranks is > 0 iff
    some rank raised it, so every rank takes the same decision. Returns (skip this optimizer step,
    stop after this step, [loss, grad norm, *metrics] averaged over ranks).
    """
    bad = torch.logical_not(torch.isfinite(loss) & torch.isfinite(grad_norm)).float().reshape(1)
    # torch.full fills on the device: no host-to-device copy (a blocking one would sync).
    stop = torch.full((1,), float(stop_requested), device=loss.device)
    packed = torch.cat([bad, stop, loss.float().reshape(1), grad_norm.float().reshape(1), metrics.float()])
    # The step's one device-to-host read (a CPU-GPU sync point): the skip decision needs it on
    # the host before the optimizer step; the logged values ride along for free.
    flags_and_values = all_reduce_mean(packed, info).tolist()
    return flags_and_values[0] > 0, flags_and_values[1] > 0, flags_and_values[2:]


def global_grad_norm(params: list[torch.Tensor], clip: float) -> torch.Tensor:
    """Norm of all gradients across ranks (a collective under FSDP2), clipped in place when clip > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=params[0].device if params else None)
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False, foreach=None)
    if clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm, foreach=None)
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm


def _record_failure(error: BaseException, info: DistInfo, stage: str, step: int, now: StepPhase,
                    run_dir: Path, logger) -> None:
    """Log why this rank is about to exit; an out-of-memory also leaves a record for the restart."""
    memory = _memory_report(info.device)
    micro = now.micro
    kind = "out of memory" if isinstance(error, torch.OutOfMemoryError) else type(error).__name__
    logger.error(f"{stage}: {kind} on rank {info.rank} at step {step}, micro-batch {micro}, during "
                 f"{now.phase}: {error}; "
                 f"memory: {memory}. This rank exits; torchrun stops the others"
                 f"{' and restarts from the last checkpoint' if info.distributed else ''}.")
    if isinstance(error, torch.OutOfMemoryError):
        folder = oom_record_dir(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        record = {"stage": stage, "rank": info.rank, "step": step, "micro_batch": micro,
                  "attempt": info.restart_count, "memory": memory, "error": str(error)}
        (folder / f"{stage}-rank{info.rank}-attempt{info.restart_count}.json").write_bytes(orjson.dumps(record))


def cosine_schedule(optimizer: torch.optim.Optimizer, *, steps: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay to 10% of the peak."""

    def factor(i: int) -> float:
        if warmup and i < warmup:
            return (i + 1) / warmup
        progress = min(1.0, (i - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
