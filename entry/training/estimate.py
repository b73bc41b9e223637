"""Dry-run estimate of a run: parameters, memory and time per step of every training stage.

Every stage is timed on random batches of its training shapes, with its training step settings,
from its record (`entry.stages.record`: the planner simulates the same probes; the cache does
not exist before the autoencoder is trained, and a step's cost does not depend on the values). Steps are timed on this rank alone, without sharding, so
the ETA leaves out communication: read it as a lower bound on many GPUs. A stage's batch larger
than its training data can fill is refused first (`check_batches`), before a batch that large is
allocated, as the stage itself would refuse it once its loader is built.
"""

from __future__ import annotations

import math
import time

import torch

from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.files import task_split
from entry.distributed.process_group import DistInfo
from entry.stages.record import selected_training_stages, stage_spec

TIMED_STEPS = 2
BYTES_PER_PARAM = 16  # fp32 weights + grads + two AdamW moments


def _time_step(step_fn, model, batch, step_cfg, frozen) -> float:
    params = dict(model.named_parameters())
    seconds = []
    for i in range(TIMED_STEPS + 1):  # the first call warms up
        t0 = time.perf_counter()
        loss, _ = step_fn(model, params, batch, cfg=step_cfg, generator=torch.Generator().manual_seed(i), **frozen)
        loss.backward()
        if batch.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return sum(seconds[1:]) / TIMED_STEPS


def _stage_probe(cfg: Config, name: str, info: DistInfo):
    """(model, step_fn, step_cfg, frozen, batch, stage_cfg) of one stage on this device, from the
    stage's record (`entry.stages.record`): the same step settings and batch shapes the planner
    simulates and training runs."""
    spec = stage_spec(name)
    probe = spec.probe(cfg)
    dev = info.device
    sc = spec.section(cfg)
    frozen = {key: make().to(dev).requires_grad_(False) for key, (make, _) in probe.frozen.items()}
    batch = probe.batch(max(1, sc.batch_size // info.world_size)).to(dev)
    return probe.make().to(dev), probe.step_fn, probe.step_cfg, frozen, batch, sc


def _train_samples(cfg: Config) -> list[tuple[int, int, int]]:
    """Per task of the config: (its steady flag, training rows, kept time steps per row), read from
    the data files' headers (no field is loaded)."""
    out = []
    for i, task in enumerate(cfg.data.tasks):
        rows, layout = task_split(cfg, i, "train")
        steady = task.spec.steady
        out.append((steady, len(rows), 1 if steady else math.ceil(layout.n_steps / task.reduce_t)))
    return out


def check_batches(cfg: Config) -> None:
    """`ConfigError` when a selected training stage's `batch_size` is larger than what its training
    data can fill (the data files must exist): the stage itself would refuse it once its loader is
    built (entry.stages.stage_build), after the stages before it have run, and the estimate would
    try to allocate a batch that large first.

    The bound is an upper one: the autoencoder draws each batch from one task's frames (a Darcy
    sample gives two: coefficient and solution); a latent stage's pairs are at most every kept step
    but the last of a dynamic trajectory, or one per steady sample.
    """
    per_task = _train_samples(cfg)
    for name in selected_training_stages(cfg):
        batch = getattr(cfg, name).batch_size
        if name == "autoencoder":
            most, what = max(rows * (2 if steady else steps) for steady, rows, steps in per_task), "frames of one task"
        else:
            most = sum(rows * (1 if steady else steps - 1) for steady, rows, steps in per_task
                       if steady == (name == "steady"))
            what = "steady sample pairs" if name == "steady" else "time-step pairs"
        if batch > most:
            raise ConfigError(f"{name}.batch_size ({batch}) is larger than the training data can fill: at most "
                              f"{most} {what} in the train split; lower it, e.g. --set {name}.batch_size="
                              f"{1 << max(0, most.bit_length() - 1)}, or generate more samples (data.tasks[i].samples)")


def estimate_run(cfg: Config, info: DistInfo) -> list[str]:
    """One line per selected training stage: parameters, memory, time per step, ETA; then the total.

    Raises `ConfigError` first when a stage's batch is larger than its data can fill (`check_batches`).
    """
    check_batches(cfg)
    lines, total = [], 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.training.seed)
        for name in selected_training_stages(cfg):
            model, step_fn, step_cfg, frozen, batch, sc = _stage_probe(cfg, name, info)
            n_params = sum(p.numel() for p in model.parameters())
            if sc.steps == 0 or not any(p.requires_grad for p in model.parameters()):
                lines.append(f"{name}: {n_params / 1e6:.3f} M parameters, no optimizer steps (fitted only)")
                del model, frozen
                continue
            if info.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(info.device)
            seconds = _time_step(step_fn, model, batch, step_cfg, frozen)
            peak = (f", peak {torch.cuda.max_memory_allocated(info.device) / 2**30:.2f} GiB measured"
                    if info.device.type == "cuda" else ", activations not measured on CPU")
            eta = seconds * sc.steps
            total += eta
            lines.append(f"{name}: {n_params / 1e6:.3f} M parameters, weights+grads+AdamW "
                         f"{n_params * BYTES_PER_PARAM / 2**20:.1f} MiB{peak}; {seconds * 1e3:.1f} ms/step at "
                         f"batch {batch.batch_size[0]} per rank -> ETA {eta:.0f} s for {sc.steps} steps")
            del model, frozen
    lines.append(f"total training ETA {total:.0f} s (compute on one rank, no communication, no compile warm-up)")
    return lines
