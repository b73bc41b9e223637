"""A run's networks as `torch.export` programs that load with `torch.export.load` and nothing of this
project: the codec's encode and decode, one operator step and, when the run has one, one step of
the consistency sampler (its noise an input). `entry.export` writes them.

Legend: B batch, C channels, S spatial axes, L tokens, D latent dim, K noise draws.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import orjson
import torch
from torch import Tensor, nn

from core.steps.common import SampleNoise
from core.steps.consistency import consistency_sample
from entry.config.errors import InputError
from entry.inference.files import require_out
from entry.inference.surrogate import Surrogate, TaskInfo
from entry.storage.atomic import fsync_dir

PROGRAMS = ("encode", "decode", "step", "refine")
"""The files `export_run` writes, ``<name>.pt2`` each (``refine`` only for a run with a consistency model)."""
META_FILE = "meta.json"


class Encode(nn.Module):
    """``u [B, C, *S] -> z [B, L, D]``: the codec's encoder (physical units in)."""

    def __init__(self, codec: nn.Module) -> None:
        super().__init__()
        self.codec = codec

    def forward(self, u: Tensor) -> Tensor:
        return self.codec.encode(u)


class Decode(nn.Module):
    """``z [B, L, D] -> u [B, C, *S]`` on the task's grid (fixed at export)."""

    def __init__(self, codec: nn.Module, grid: tuple[int, ...]) -> None:
        super().__init__()
        self.codec, self.grid = codec, tuple(grid)

    def forward(self, z: Tensor) -> Tensor:
        return self.codec.decode(z, self.grid)


class Step(nn.Module):
    """One operator step ``(z, dt [B] float32, task_id [B] int64) -> z_next``."""

    def __init__(self, operator: nn.Module) -> None:
        super().__init__()
        self.operator = operator

    def forward(self, z: Tensor, dt: Tensor, task_id: Tensor) -> Tensor:
        return self.operator(z, dt, task_id)


class _GivenNoise(SampleNoise):
    """A noise source whose draws are given (an input of the exported program), in order."""

    def __init__(self, draws_KBLD: Tensor) -> None:  # noqa: D107 - no keys: the draws are given
        self.draws_KBLD, self.draws = draws_KBLD, 0

    def normal(self, shape_BX: tuple[int, ...], *, dtype: torch.dtype, device) -> Tensor:
        out = self.draws_KBLD[self.draws]
        self.draws += 1
        return out


class Refine(nn.Module):
    """The consistency sampler's refinement of one operator prediction, ``(z_op, dt, task_id,
    noise [K, B, L, D]) -> z``, K = its steps (1 or 2): `core.steps.consistency.consistency_sample`
    with the run's settings, drawing the given standard normals instead of its own."""

    def __init__(self, student: nn.Module, *, steps: int, sigma_min: float, sigma_mid: float | None) -> None:
        super().__init__()
        self.student, self.steps, self.sigma_min, self.sigma_mid = student, steps, sigma_min, sigma_mid

    def forward(self, z_op: Tensor, dt: Tensor, task_id: Tensor, noise: Tensor) -> Tensor:
        return consistency_sample(self.student, z_op, dt, task_id, steps=self.steps, generator=_GivenNoise(noise),
                                  sigma_min=self.sigma_min, sigma_mid=self.sigma_mid)


def programs(surrogate: Surrogate, info: TaskInfo, *, batch: int = 2) -> dict[str, torch.export.ExportedProgram]:
    """The exported programs of `surrogate` for task `info`, their batch size dynamic (>= 1; the
    example batch is `batch`). -> {name: program} (`PROGRAMS`)."""
    if info.steady:
        raise InputError(f"task {info.name} is steady; export rolls out time-dependent tasks")
    cfg, models = surrogate.config, surrogate.models
    codec = models["autoencoder"].for_task(info.index)  # the codec reads this task's fields
    b = torch.export.Dim("batch", min=1, max=1 << 20)
    u = torch.zeros(batch, len(info.channels), *info.grid, device=surrogate.device)
    with torch.no_grad():
        z = codec.encode(u)
    dt = torch.full((batch,), info.time_step, dtype=torch.float32, device=surrogate.device)
    tid = torch.full((batch,), info.index, dtype=torch.int64, device=surrogate.device)
    out = {"encode": torch.export.export(Encode(codec), (u,), dynamic_shapes=({0: b},)),
           "decode": torch.export.export(Decode(codec, info.grid), (z,), dynamic_shapes=({0: b},)),
           "step": torch.export.export(Step(models["operator"]), (z, dt, tid),
                                       dynamic_shapes=({0: b}, {0: b}, {0: b}))}
    if "consistency" in models:
        steps = cfg.consistency.sample_steps
        noise = torch.zeros(steps, *z.shape, device=surrogate.device)
        refine = Refine(models["consistency"], steps=steps, sigma_min=cfg.diffusion.sigma_min,
                        sigma_mid=cfg.consistency.sigma_mid or None)
        out["refine"] = torch.export.export(refine, (z, dt, tid, noise), dynamic_shapes=({0: b}, {0: b}, {0: b},
                                                                                         {1: b}))
    return out


def meta(surrogate: Surrogate, info: TaskInfo, names) -> dict:
    """What a user of the exported programs needs to know (written as ``meta.json``)."""
    cfg = surrogate.config
    z_shape = surrogate.models["autoencoder"].for_task(info.index).encode(
        torch.zeros(1, len(info.channels), *info.grid, device=surrogate.device)).shape[1:]
    return {"run": str(surrogate.run_dir), "task": info.name, "task_id": info.index, "channels": list(info.channels),
            "grid": list(info.grid), "time_step": info.time_step, "given_steps": info.given_steps,
            "latent_shape": list(z_shape), "programs": sorted(names),
            "refine_noise_draws": cfg.consistency.sample_steps if "refine" in names else 0,
            "torch": torch.__version__}


def export_run(surrogate: Surrogate, info: TaskInfo, out: str | Path, *, force: bool = False) -> Path:
    """Write `programs` and `meta` to the folder `out` (``<name>.pt2`` each, ``meta.json``), whole or
    not at all: they are written into a fresh folder beside `out` that is renamed into place (the old
    `out`, with `force`, is removed only after). Returns `out`."""
    out = Path(out)
    require_out(out, [out], force=force)  # before the programs are traced
    found = programs(surrogate, info)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent))
    try:
        for name, program in found.items():
            torch.export.save(program, tmp / f"{name}.pt2")
        (tmp / META_FILE).write_bytes(orjson.dumps(meta(surrogate, info, found), option=orjson.OPT_INDENT_2))
        os.chmod(tmp, 0o755)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out
