"""Place a model for data parallelism in torchtitan's order: move to the device, compile each
block, `fully_shard` each block then the root (FSDP2), or wrap in DDP."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from entry.distributed.precision import fsdp_policies
from entry.distributed.process_group import DistInfo


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The blocks FSDP2 shards one by one: a module's `blocks()` when it has them, else those of
    its descendants. Everything else stays in the root's unit: a module whose parameters are
    read directly (a positional table, say) rather than through its own forward must never be
    a unit, or its sharded parameters would reach the computation un-gathered."""
    if hasattr(module, "blocks"):
        return list(module.blocks())
    return [unit for child in module.children() for unit in shard_units(child)]


def compile_blocks(model: nn.Module) -> nn.Module:
    """`torch.compile` every shard unit (`shard_units`) in place of itself, as torchtitan does:
    each block is one small graph, reused by every block of the same shape, and FSDP2's hooks,
    added afterwards on the compiled wrapper, stay outside the graph. Returns `model`.

    The compiled wrapper holds the block as `_orig_mod`; torch.distributed.checkpoint's state
    dicts (checkpoints, exported weights) drop that prefix, so weights load into a plain model.
    """
    units = {id(unit) for unit in shard_units(model)}
    # Every (parent, name) slot holding a unit, found before any is replaced: the wrappers hold
    # their unit as a child too, and must not be visited.
    slots = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if id(child) in units]
    assert len({id(child) for _, _, child in slots}) == len(units), "a shard unit is not a child of the model"
    for parent, name, child in slots:
        parent.register_module(name, torch.compile(child))
    return model


def wrap_model(model: nn.Module, info: DistInfo, *, parallel: str, precision: str, compile: bool = False,
               cpu_offload: bool = False) -> nn.Module:
    """Return `model` moved to the device, its blocks compiled when `compile`, and wrapped as
    `parallel` asks (in place for FSDP2).

    At world size 1 the model is not wrapped (every `parallel` is the same single-device run).
    FSDP2 follows the precision contract (entry.distributed.precision.fsdp_policies): with bf16 the
    parameters are gathered in bf16, gradients reduced in fp32, and the root keeps the latent
    state in fp32.
    """
    model = model.to(info.device)
    if compile:
        compile_blocks(model)
    if not info.distributed or parallel == "none":
        return model
    if not any(p.requires_grad for p in model.parameters()):
        return model  # nothing to synchronise or shard (a codec that is its fitted linear path)
    if parallel == "ddp":
        ids = [info.device.index] if info.device.type == "cuda" else None
        # A model whose batches use only some of its parameters says so (`partial_graph`, e.g. the
        # field codec: one task's fields per batch); DDP then searches for the unused ones each step.
        return nn.parallel.DistributedDataParallel(model, device_ids=ids,
                                                   find_unused_parameters=getattr(model, "partial_graph", False))

    block_mp, root_mp = fsdp_policies(precision)
    if cpu_offload and info.device.type == "cpu":
        warnings.warn("training.cpu_offload is ignored when training on the CPU: the parameters are "
                      "already in host memory", stacklevel=2)
        cpu_offload = False
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for unit in shard_units(model):
        fully_shard(unit, mp_policy=block_mp, offload_policy=offload)
    fully_shard(model, mp_policy=root_mp, offload_policy=offload)
    return model


def is_fsdp(model: nn.Module) -> bool:
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
