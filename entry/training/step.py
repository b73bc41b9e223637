"""One optimizer step of a built stage, the unit every stage's training and the benchmarks share.

Per optimizer step, every rank does the same collectives in the same order:
  micro-steps (FSDP2 all-gathers / reduce-scatters or DDP all-reduces, gradient sync on the
  last micro-step only) -> global gradient norm -> ONE all_reduce of [non-finite flag, stop flag,
  loss, grad norm, metrics], read back once: the step's only device-to-host sync
  -> optimizer step or a skip that all ranks agree on.
What happens between steps (metric lines, validation, checkpoints, resume) is entry.training.loop's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core.schedule import ema_decay_at
from entry.distributed import hooks
from entry.distributed.process_group import DistInfo, all_reduce_mean
from entry.distributed.sharding import gradient_sync
from entry.stages.parts import StageParts, update_average


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
    """Context factory for every training forward (entry.distributed.precision.compute_autocast: bf16 autocast
    on every layout for precision bf16)."""
    progress: bool = False
    validate_every: int = 0
    """Optimizer steps between validations (0: none); with a `validate`, one also follows the last step."""
    ema_decay: float = 0.0
    """Decay of `StageParts.ema`'s average (it warms up: `core.schedule.ema_decay_at`)."""
    keep_best: bool = False
    """Export the weights of every improving validation to `best_weights_dir(run_dir)` (select=best)."""
    max_train_s: float = 0.0
    """Training seconds (`train_wall_s`: validation excluded, resumed attempts included) after which
    the stage ends as after its last step: it stops before a step that would not fit, judged by the
    step before it (0: no cap). The schedule stays annealed to `steps` unless `anneal_to_time`."""
    anneal_to_time: bool = False
    """With `max_train_s`: the schedule (`CosineSchedule`) decays to its floor by the end of the time
    budget or of `steps`, whichever comes first (`training.anneal_to: time`). One process only: each
    rank's clock would give its replica another learning rate."""
    config_hash: str = ""
    """What a checkpoint must have been written for to be resumed (entry.training.runner: the stage's
    resume hash and the provenance of its inputs), stored in each checkpoint: a run never resumes
    the checkpoints of a config that computes something else, or of other data or upstream weights."""


def micro_batches(per_rank_batch: int, accum_steps: int, oom_count: int, stage: str) -> tuple[int, int]:
    """(micro-batch, accum_steps) after `oom_count` halvings; the product stays `per_rank_batch`."""
    accum = accum_steps * 2 ** oom_count
    if per_rank_batch % accum:
        raise RuntimeError(
            f"{stage}: after {oom_count} out-of-memory restart(s) the per-rank batch {per_rank_batch} "
            f"cannot be split into {accum} micro-batches; lower {stage}.batch_size, use more GPUs, "
            f"set training.cpu_offload=true, or shrink the model")
    return per_rank_batch // accum, accum


def micro_batch(batch, micro: int, index: int):
    return batch[index * micro:(index + 1) * micro]


@dataclass
class StepPhase:
    """What the current optimizer step is doing, so a failure (a collective that timed out, say)
    names it; forward hooks armed through entry.distributed.hooks.model_ready read `step`."""

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
    out_of_time: bool
    """Some rank's training clock left no room for another step (`LoopSettings.max_train_s`): every
    rank ends the stage after this step."""
    values: list[float]
    """[loss, grad norm, *metrics], averaged over micro-batches and ranks."""
    names: list[str]
    """Names of ``values``."""


def train_step(parts: StageParts, batch, step: int, settings: LoopSettings, info: DistInfo, *, micro: int,
               accum: int, stop_requested: bool = False, out_of_time: bool = False,
               now: StepPhase | None = None) -> StepResult:
    """One optimizer step of a built stage, exactly as `train_stage` takes it: forward and backward
    of ``accum`` micro-batches of ``micro`` rows of ``batch`` (already on the device), the global
    gradient norm (clipped), one all_reduce that agrees on non-finite values, SIGTERM and the time
    budget (``out_of_time``: this rank's clock has no room for another step), then the
    optimizer and scheduler step (and ``parts.after_step``), or on every rank a skip. The benchmarks
    time this function, so they time the training path itself."""
    now = StepPhase(step=step) if now is None else now
    loss_sum, metric_sum, metrics = accumulate_gradients(parts, parts.model, batch, micro, accum, step, settings,
                                                         info, now)
    now.enter("the gradient-norm all_reduce")
    grad_norm = global_grad_norm([p for p in parts.model.parameters() if p.requires_grad], settings.grad_clip)
    now.enter("the all_reduce that agrees on non-finite values and SIGTERM")
    bad, stopping, out_of_time, values = agree_on_step(loss_sum, grad_norm, metric_sum, stop_requested, info,
                                                       out_of_time=out_of_time)
    if bad:
        parts.optimizer.zero_grad(set_to_none=True)
    else:
        now.enter("the optimizer step")
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)
        parts.scheduler.step()
        if parts.ema is not None:
            update_average(parts.ema, parts.model, ema_decay_at(settings.ema_decay, step))
        if parts.after_step is not None:
            parts.after_step()
    return StepResult(bad, stopping, out_of_time, values, ["loss", "grad_norm", *metrics.keys()])


def accumulate_gradients(parts: StageParts, model: nn.Module, batch, micro: int, accum: int, step: int,
                         settings: LoopSettings, info: DistInfo, now: StepPhase):
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
                loss, metrics = parts.step_fn(model, named, micro_batch(batch, micro, m), cfg=parts.step_cfg,
                                              generator=generator, **parts.frozen)
            loss = hooks.loss(parts.name, info.rank, step, info.restart_count, loss)  # listeners (tests) may swap it
            now.enter("the backward pass (FSDP2 reduce-scatters / DDP all-reduces)")
            (loss / accum).backward()
        loss_sum += loss.detach().float() / accum
        values = [v.detach().float() for v in metrics.values()]
        # A step with no metrics besides its loss (entry.training.budgeted's) packs none.
        values = torch.stack(values) / accum if values else loss_sum.new_zeros(0)
        metric_sum = values if metric_sum is None else metric_sum + values
    return loss_sum, metric_sum, metrics


def agree_on_step(loss: torch.Tensor, grad_norm: torch.Tensor, metrics: torch.Tensor, stop_requested: bool,
                  info: DistInfo, *, out_of_time: bool = False) -> tuple[bool, bool, bool, list[float]]:
    """What every rank agrees on after a step's backward, with one all_reduce and one read.

    Packs [non-finite flag, SIGTERM flag, out-of-time flag, loss, grad norm, *metrics] into one
    fp32 tensor on the device, averages it over ranks and reads it back once. A flag's mean over
    ranks is > 0 iff some rank raised it, so every rank takes the same decision (ranks' clocks
    differ a little: the first out of time ends the stage for all). Returns (skip this optimizer
    step, stop after this step, end the stage after this step, [loss, grad norm, *metrics]
    averaged over ranks).
    """
    bad = torch.logical_not(torch.isfinite(loss) & torch.isfinite(grad_norm)).float().reshape(1)
    # torch.full fills on the device: no host-to-device copy (a blocking one would sync).
    stop = torch.full((1,), float(stop_requested), device=loss.device)
    late = torch.full((1,), float(out_of_time), device=loss.device)
    packed = torch.cat([bad, stop, late, loss.float().reshape(1), grad_norm.float().reshape(1), metrics.float()])
    # The step's one device-to-host read (a CPU-GPU sync point): the skip decision needs it on
    # the host before the optimizer step; the logged values ride along for free.
    flags_and_values = all_reduce_mean(packed, info).tolist()
    return flags_and_values[0] > 0, flags_and_values[1] > 0, flags_and_values[2] > 0, flags_and_values[3:]


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


def validated_module(parts: StageParts) -> nn.Module:
    """What validation scores, best-weights selection keeps and the stage exports: the average, if any."""
    return parts.ema if parts.ema is not None else parts.model
