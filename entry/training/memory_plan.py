"""Will a config's training fit N GPUs: the memory plan `python -m entry.plan` prints and
`entry.pipeline --dry-run` shows.

Each selected training stage's probe (entry.stages.record) is simulated for one optimizer step on
rank 0 of N ranks (entry/distributed/memory_sim.py: models on the meta device, sharded as training
shards them over a fake process group, one forward and backward of the per-rank batch under
FakeTensorMode), at the configured micro-batch and at twice it; memory is linear in the batch for
these models, so the largest batch that fits is extrapolated from the two.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from entry.config.load import ConfigError
from entry.config.schema import Config, shown
from entry.distributed.memory_sim import SIMULATED_DEVICE, StageProbe, StepMemory, simulate_step
from entry.distributed.process_group import DistInfo
from entry.models.build import latent_tokens
from entry.stages.record import selected_training_stages, stage_spec
from entry.stages.stage_build import optimizer_for

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """`"80GiB"`, `"80GB"`, `"80G"` (binary), `"81920MiB"` or a plain byte count -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    size = float(m.group(1)) * _UNITS.get(m.group(2).lower(), math.nan) if m is not None else math.nan
    if not math.isfinite(size):  # also a unit we do not know, or hundreds of digits (inf)
        raise ConfigError(f"--gpu-memory {shown(text)}: expected a size such as 80GiB, 80GB or 81920MiB")
    return int(size)


def human(n: float) -> str:
    """Bytes in binary units, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def stage_probe(cfg: Config, name: str) -> StageProbe:
    """What training stage `name` builds, holds frozen and runs (`entry.stages.record`)."""
    spec = stage_spec(name)
    if spec.probe is None:
        raise ValueError(f"stage {name!r} trains nothing: there is no step to plan")
    return spec.probe(cfg)


def plan_stage(cfg: Config, name: str, world_size: int) -> tuple[StepMemory, StepMemory, int]:
    """Simulate stage `name` at the configured micro-batch and at twice it.

    Returns (memory at the configured micro-batch, at twice it, the configured micro-batch).
    """
    sc = getattr(cfg, name)
    accum = cfg.training.accum_steps
    per_rank = sc.batch_size // world_size
    micro = max(1, per_rank // accum)
    probe = stage_probe(cfg, name)
    # The optimizer a GPU run builds (fused AdamW): entry.stages.stage_build decides by the device type.
    gpu = DistInfo(0, world_size, 0, torch.device("cuda", 0), None, 0)
    # DDP (or none) replicates: every rank holds what one process training alone holds.
    replicated = cfg.training.parallel != "fsdp"
    at, twice = simulate_step(probe, world_size=1 if replicated else world_size, micro_batches=(micro, 2 * micro),
                              accum_steps=accum, parallel=cfg.training.parallel, precision=cfg.training.precision,
                              make_optimizer=lambda model: optimizer_for(model, sc, gpu)[0])
    if replicated and cfg.training.parallel == "ddp" and world_size > 1:
        # DDP copies every gradient into its buckets (one more copy) and all-reduces them once a step.
        at, twice = (dataclasses.replace(m, activation_peak=m.activation_peak + m.gradients,
                                         step_peak=m.step_peak + m.gradients, all_reduced=m.gradients)
                     for m in (at, twice))
    if stage_spec(name).averages and sc.ema_decay > 0:
        # The moving average is one more copy of the weights, placed and sharded like them
        # (entry.stages.stage_build.place_with_copy), held through the whole step; updated in place.
        at, twice = (dataclasses.replace(m, frozen=m.frozen + m.parameters, step_peak=m.step_peak + m.parameters,
                                         optimizer_peak=m.optimizer_peak + m.parameters)
                     for m in (at, twice))
    return at, twice, micro


def largest_micro_batch(at: StepMemory, twice: StepMemory, usable: int, *, offloaded: int = 0) -> int:
    """Largest micro-batch whose step peak fits `usable` bytes (0 if none), from the peaks at
    two micro-batch sizes (linear in the batch); `offloaded` bytes live in host memory instead."""
    per_sample = max(1.0, (twice.step_peak - at.step_peak) / (twice.micro_batch - at.micro_batch))
    fixed = at.step_peak - per_sample * at.micro_batch - offloaded
    if max(fixed, at.optimizer_peak - offloaded) > usable:
        return 0
    return max(0, int((usable - fixed) // per_sample))


def cache_bytes(cfg: Config) -> int:
    """Bytes of the latent caches (train and validation splits), as entry.data.latent_cache writes them."""
    total = 0
    for t in cfg.data.tasks:
        frames = 2 if t.spec.steady else len(range(0, t.nt, t.reduce_t))
        kept = t.samples - int(round(t.samples * cfg.data.split.test_fraction))
        total += kept * frames * latent_tokens(cfg, t.spec.spatial_dims) * cfg.latent.dim * 4
    return total


def plan_stages(cfg: Config, *, world_size: int, nodes: int = 1, gpu_memory: int = 80 * 2**30,
                usable: float = 0.9) -> dict:
    """The plan as data: `{"world_size", "nodes", "budget", "stages": {name: {...}}}` with, per
    selected training stage, rank 0's bytes (`StepMemory` fields), `micro_batch`, `fits`,
    `largest_micro_batch` (0: none fits) and `optimizer_steps` (0: a stage with nothing to train,
    such as a codec that is its fitted linear path: its forward alone is simulated)."""
    if world_size < 1 or nodes < 1 or world_size % nodes:
        raise ConfigError(f"--world-size {world_size} must be a positive multiple of --nodes {nodes}")
    budget = int(gpu_memory * usable)
    stages = {}
    for name in selected_training_stages(cfg):
        at, twice, micro = plan_stage(cfg, name, world_size)
        offloaded = at.parameters + at.gradients + at.optimizer if cfg.training.cpu_offload else 0
        stages[name] = {**dataclasses.asdict(at), "total_peak": at.total_peak - offloaded,
                        "fits": at.total_peak - offloaded <= budget,
                        "largest_micro_batch": largest_micro_batch(at, twice, budget, offloaded=offloaded),
                        # The runner skips the steps of a model with no trainable parameters.
                        "optimizer_steps": getattr(cfg, name).steps if at.parameters else 0}
    return {"world_size": world_size, "nodes": nodes, "gpu_memory": gpu_memory, "budget": budget, "stages": stages}


def plan_lines(cfg: Config, plan: dict) -> list[str]:
    """The report of `plan_stages`: a header line, then four lines per stage."""
    t, n, budget = cfg.training, plan["world_size"], plan["budget"]
    lines = [f"plan: {n} ranks ({plan['nodes']} node(s) x {n // plan['nodes']} GPU(s)), rank 0 shown (the most "
             f"loaded); GPU memory {human(plan['gpu_memory'])}, usable {human(budget)}; parallel {t.parallel}, "
             f"precision {t.precision}, accum_steps {t.accum_steps}; simulated on {SIMULATED_DEVICE} (fake tensors)"]
    if t.compile:
        lines.append("plan: training.compile=true is not simulated: activation peaks are eager's (an upper bound)")
    for name, s in plan["stages"].items():
        sc = getattr(cfg, name)
        best = s["largest_micro_batch"]
        averaged = " and moving average" if stage_spec(name).averages and sc.ema_decay > 0 else ""
        split = "" if sc.batch_size % n == 0 and sc.batch_size >= n else (
            f"; {name}.batch_size {sc.batch_size} does not split over {n} ranks: simulated at 1 per rank")
        lines += [
            f"{name}: micro-batch {s['micro_batch']} per rank (batch_size {sc.batch_size} / {n} ranks / "
            f"accum {t.accum_steps}){split}" + (f", unroll_steps {sc.unroll_steps}" if name == "operator" else "")
            + ("" if s["optimizer_steps"] else "; no optimizer step (nothing to train): the forward alone"),
            f"  parameters {human(s['parameters'])}, gradients {human(s['gradients'])}, optimizer "
            f"{human(s['optimizer'])}, frozen networks{averaged} {human(s['frozen'])}, activation peak "
            f"{human(s['activation_peak'])}" + (" (parameters, gradients, optimizer on the host: cpu_offload)"
                                                   if t.cpu_offload else ""),
            f"  total peak {human(s['total_peak'])} of {human(budget)}: {'fits' if s['fits'] else 'DOES NOT FIT'}; "
            + (f"largest micro-batch that fits {best} (global batch {best * t.accum_steps * n}: "
               f"--set {name}.batch_size={best * t.accum_steps * n})" if best else
               "nothing fits even at micro-batch 1: use more GPUs, cpu_offload, or a smaller model"),
            f"  per optimizer step: all-gathered {human(s['all_gathered'])}, reduce-scattered "
            f"{human(s['reduce_scattered'])}, all-reduced {human(s['all_reduced'])} per rank",
        ]
    if plan["nodes"] > 1:
        lines.append(f"plan: latent cache {human(cache_bytes(cfg))}: each node holds it whole when "
                     f"training.cache_dir is node-local (/dev/shm, local scratch)")
    return lines


def plan_report(cfg: Config, **kwargs) -> list[str]:
    """`plan_lines(cfg, plan_stages(cfg, **kwargs))`: the report in one call (entry.pipeline's dry run)."""
    return plan_lines(cfg, plan_stages(cfg, **kwargs))
