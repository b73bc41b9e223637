"""Dry-run estimate of a run: parameters, memory and time per step of every training stage.

Every stage is timed on random batches of its training shapes, with its training step settings,
from its record (`entry.stages.record`: the planner simulates the same probes; the cache does
not exist before the autoencoder is trained, and a step's cost does not depend on the values). Steps are timed on this rank alone, without sharding, so
the ETA leaves out communication: read it as a lower bound on many GPUs. A stage's step is timed
several times: the fastest is its quiet cost, and the ETA is the range from it to the median, with
a word when the spread says the machine was busy (`step_time_text`); a stage that one step says is
short is timed once (`SHORT_STAGE_S`). A stage's batch larger
than its training data can fill is refused first (`check_batches`), before a batch that large is
allocated, as the stage itself would refuse it once its loader is built; so is a trajectory too short for
the stages' horizon, unrolled steps or given steps (`check_trajectories`).
"""

from __future__ import annotations

import math
import os
import time

import torch

from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.files import task_split
from entry.distributed.process_group import DistInfo
from entry.evaluation.task_frames import scored_steps  # the evaluation's own rule, checked early
from entry.stages.record import EVALUATE, selected_training_stages, stage_spec

MIN_TIMED_STEPS = 3
MAX_TIMED_STEPS = 10
PROBE_BUDGET_S = 1.0
"""Seconds of timed steps per stage after MIN_TIMED_STEPS: a quiet step is the fastest of several
(a busy machine, another rank or the allocator's first steps slow some of them; the slowest of two
steps once said 7.3 s where training took 0.6 s), and the spread says how far to trust it. Small:
every run pays it per stage before training (the test suite runs ~100 pipelines), and three steps
already give a fastest and a median."""
SHORT_STAGE_S = 30.0
"""A stage whose first timed step, times its steps, comes to less than this is timed no further: one
step says its ETA to within seconds, and the rest of `PROBE_BUDGET_S` would be a sizeable share of
its training (the quickstart test's shortened stages trained 6-20 s and their timing took 5 s of
the run)."""
NOISY_SPREAD = 1.5
"""Median over fastest step time above which the estimate says the machine was busy."""
BYTES_PER_PARAM = 16  # fp32 weights + grads + two AdamW moments


def _time_steps(step_fn, model, batch, step_cfg, frozen, probe_s: float = PROBE_BUDGET_S,
                max_steps: int = MAX_TIMED_STEPS, stage_steps: int | None = None) -> list[float]:
    """Seconds of each timed step (after one warm-up call), sorted: at least `MIN_TIMED_STEPS`, then
    more while ``probe_s`` seconds last, at most ``max_steps``; only one where ``stage_steps`` (the
    stage's steps, None: time in full) of the first timed step come to less than `SHORT_STAGE_S`."""
    params = dict(model.named_parameters())
    seconds = []
    spent = 0.0
    for i in range(max(max_steps, MIN_TIMED_STEPS) + 1):  # the first call warms up
        if i > MIN_TIMED_STEPS and spent > probe_s:
            break
        if i == 2 and stage_steps is not None and seconds[1] * stage_steps < SHORT_STAGE_S:
            break
        t0 = time.perf_counter()
        loss, _ = step_fn(model, params, batch, cfg=step_cfg, generator=torch.Generator().manual_seed(i), **frozen)
        loss.backward()
        if batch.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        spent += seconds[-1] if i else 0.0
        model.zero_grad(set_to_none=True)
    return sorted(seconds[1:])


def step_time_text(seconds: list[float], steps: int, max_train_s: float) -> tuple[str, float, float]:
    """What the estimate says of a stage's timed steps (sorted seconds): the fastest as the quiet
    cost, the median and the spread, and the ETA range for `steps` steps (fastest to median, each
    capped by the time budget `max_train_s`, 0: none). Returns (text, low ETA, high ETA)."""
    fastest, median = seconds[0], seconds[len(seconds) // 2]
    cap = max_train_s or math.inf
    low, high = min(fastest * steps, cap), min(median * steps, cap)
    spread = median / fastest if fastest > 0 else 1.0
    text = (f"{fastest * 1e3:.1f} ms/step (one step timed: a short stage)" if len(seconds) == 1 else
            f"{fastest * 1e3:.1f} ms/step quiet (fastest of {len(seconds)}; median {median * 1e3:.1f}, slowest "
            f"{seconds[-1] * 1e3:.1f}" + (": noisy, the machine was busy, trust the range" if spread > NOISY_SPREAD
                                          else "") + ")")
    eta = f"{low:.0f} s" if round(low) == round(high) else f"{low:.0f}-{high:.0f} s"
    capped = " (capped by training.max_train_s)" if median * steps > cap else ""
    return f"{text} -> ETA {eta} for {steps} steps{capped}", low, high


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


def stage_step_seconds(cfg: Config, name: str, info: DistInfo, probe_s: float = PROBE_BUDGET_S,
                       max_steps: int = MAX_TIMED_STEPS) -> list[float]:
    """Seconds of stage ``name``'s training steps timed as the estimate times them (`_time_steps`:
    random batches of its training shapes, its step settings, on this rank; ``probe_s`` seconds of
    steps, at most ``max_steps``), sorted: the first is its quiet cost. The model is drawn from
    ``cfg.training.seed`` in a fork of the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.training.seed)
        model, step_fn, step_cfg, frozen, batch, _ = _stage_probe(cfg, name, info)
        return _time_steps(step_fn, model, batch, step_cfg, frozen, probe_s, max_steps)


def _train_samples(cfg: Config) -> list[tuple[int, int, int]]:
    """Per task of the config: (its steady flag, training rows, kept time steps per row), read from
    the data files' headers (no field is loaded)."""
    out = []
    for i, task in enumerate(cfg.data.tasks):
        rows, desc = task_split(cfg, i, "train")
        steady = task.spec.steady
        out.append((steady, len(rows), 1 if steady else math.ceil(desc.steps / task.reduce_t)))
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
        spec = stage_spec(name)
        batch = spec.section(cfg).batch_size
        if not spec.cache_kind:  # it trains on the fields
            most, what = max(rows * (2 if steady else steps) for steady, rows, steps in per_task), "frames of one task"
        else:
            kind_steady = spec.cache_kind == "steady"
            most = sum(rows * (1 if steady else steps - 1) for steady, rows, steps in per_task
                       if steady == kind_steady)
            what = "steady sample pairs" if kind_steady else "time-step pairs"
        if batch > most:
            raise ConfigError(f"{name}.batch_size ({batch}) is larger than the training data can fill: at most "
                              f"{most} {what} in the train split; lower it, e.g. --set {name}.batch_size="
                              f"{1 << max(0, most.bit_length() - 1)}, or generate more samples (data.tasks[i].samples)")


def check_trajectories(cfg: Config, names: list[str] | None = None) -> None:
    """`ConfigError` when the stages `names` (default: the config's selected ones) ask more steps of a
    trajectory than the data keep (the data files must exist): the latent stages' pairs
    ``operator.horizon`` steps apart (the operator's ``operator.unroll_steps`` of them in a row), and
    the evaluation's given steps (``data.tasks[i].initial_step``). Each stage would refuse it itself
    (`pipelines.datasets.LatentPairs`, `entry.evaluation.task_frames.scored_steps`), but only after the
    stages before it had trained."""
    names = list(cfg.stages) if names is None else names
    dynamic = [i for i, task in enumerate(cfg.data.tasks) if not task.spec.steady]
    stored = {i: task_split(cfg, i, "train")[1].steps for i in dynamic}
    kept = min((math.ceil(stored[i] / cfg.data.tasks[i].reduce_t) for i in dynamic), default=None)
    horizon = cfg.operator.horizon
    for name in selected_training_stages(cfg, names):
        spec = stage_spec(name)
        unroll = getattr(spec.section(cfg), "unroll_steps", 1)  # a section that unrolls its steps says how far
        if kept is not None and spec.cache_kind == "dynamic" and horizon * unroll >= kept:
            rows = f", {name}.unroll_steps ({unroll}) of them in a row," if unroll > 1 else ""
            raise ConfigError(f"{name}: pairs operator.horizon ({horizon}) steps apart{rows} need trajectories "
                              f"longer than {horizon * unroll} steps; the shortest task keeps {kept}: lower them")
    if EVALUATE in names:
        for i in dynamic:
            scored_steps(cfg, i, stored[i])


def estimate_run(cfg: Config, info: DistInfo) -> list[str]:
    """One line per selected training stage: parameters, memory, time per step, ETA; then the total.

    Raises `ConfigError` first when a stage's batch is larger than its data can fill (`check_batches`),
    or a trajectory is too short for what the stages ask of it (`check_trajectories`).
    """
    check_batches(cfg)
    check_trajectories(cfg)
    lines, low, high = [], 0.0, 0.0
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
            seconds = _time_steps(step_fn, model, batch, step_cfg, frozen, stage_steps=sc.steps)
            text, lo, hi = step_time_text(seconds, sc.steps, cfg.training.max_train_s)
            peak = (f", peak {torch.cuda.max_memory_allocated(info.device) / 2**30:.2f} GiB measured"
                    if info.device.type == "cuda" else ", activations not measured on CPU")
            low, high = low + lo, high + hi
            lines.append(f"{name}: {n_params / 1e6:.3f} M parameters, weights+grads+AdamW "
                         f"{n_params * BYTES_PER_PARAM / 2**20:.1f} MiB{peak}; at batch {batch.batch_size[0]} per rank "
                         f"{text}")
            del model, frozen
    total = f"{low:.0f} s" if round(low) == round(high) else f"{low:.0f}-{high:.0f} s"
    lines.append(f"total training ETA {total} (compute on one rank, no communication, no compile warm-up)"
                 + busy_note())
    return lines


def busy_note() -> str:
    """'; ...' naming the machine's load when it exceeds its cores, else '': other processes then
    set the pace, and steps timed beside them have come out both much slower and much faster than
    training's (bench/results/cpu-2core-2026-11-27-declared-data.md)."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not every platform has a load average
        return ""
    cores = os.cpu_count() or 1
    return (f"; the machine is busy (load {load:.1f} on {cores} cores): training may run several times faster or "
            f"slower than timed"
            if load > cores else "")
