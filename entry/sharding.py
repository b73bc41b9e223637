"""Wrap a model for data parallelism: FSDP2 `fully_shard` per block then the root, or DDP."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from entry.distributed import DistInfo


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The blocks FSDP2 shards one by one: a module's `blocks()` when it has them, else those of
    its descendants. Everything else stays in the root's unit: a module whose parameters are
    read directly (a positional table, say) rather than through its own forward must never be
    a unit, or its sharded parameters would reach the computation un-gathered."""
    if hasattr(module, "blocks"):
        return list(module.blocks())
    return [unit for child in module.children() for unit in shard_units(child)]


def wrap_model(model: nn.Module, info: DistInfo, *, parallel: str, precision: str,
               cpu_offload: bool = False) -> nn.Module:
    """Return `model` moved to the device and wrapped as `parallel` asks (in place for FSDP2).

    At world size 1 the model is returned unwrapped. With FSDP2 and bf16 the parameters are
    cast to bf16 for compute and gradients are reduced in fp32.
    """
    model = model.to(info.device)
    if not info.distributed or parallel == "none":
        return model
    if parallel == "ddp":
        ids = [info.device.index] if info.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if precision == "bf16" else MixedPrecisionPolicy())
    if cpu_offload and info.device.type == "cpu":
        warnings.warn("training.cpu_offload is ignored when training on the CPU: the parameters are "
                      "already in host memory", stacklevel=2)
        cpu_offload = False
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for unit in shard_units(model):
        fully_shard(unit, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    return model


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def gradient_sync(model: nn.Module, enabled: bool):
    """Context for one micro-step: gradients are synchronised only when `enabled` (the last one)."""
    if is_fsdp(model):
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if isinstance(model, nn.parallel.DistributedDataParallel) and not enabled:
        return model.no_sync()
    return contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 wraps in place)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def autocast(info: DistInfo, parallel: str, precision: str):
    """bf16 autocast where FSDP2's mixed-precision policy does not already cast the parameters."""
    if precision != "bf16" or (info.distributed and parallel == "fsdp"):
        return contextlib.nullcontext()
    return torch.autocast(info.device.type, dtype=torch.bfloat16)
