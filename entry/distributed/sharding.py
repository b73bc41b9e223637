"""Place a model for data parallelism in torchtitan's order: move to the device, compile each
block, `fully_shard` each block then the root (FSDP2), or wrap in DDP; gather a placed model's
full weights back onto rank 0."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

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


def full_state_dict(model: nn.Module, info: DistInfo) -> dict[str, torch.Tensor] | None:
    """The whole `model` (placed by `wrap_model`, or plain) as one state dict of full CPU tensors on
    rank 0, None on the other ranks. A collective under FSDP2: every rank calls it.

    Keys are torch.distributed.checkpoint's (no DDP `module.` or compiled `_orig_mod.` prefix), so
    the dict loads into a plain model. Parameters sharded by FSDP2 are gathered one at a time.
    """
    local = get_model_state_dict(model)  # this rank's shards, no collective
    full = {}
    for key, value in local.items():
        if isinstance(value, DTensor):
            value = _gather_dtensor(value)
        if info.is_main:
            full[key] = value.detach().cpu()
    return full if info.is_main else None


def _gather_dtensor(value: DTensor) -> torch.Tensor:
    """The full tensor of `value` on every rank. FSDP2's layout (rows split as `torch.chunk` splits
    them, on a 1-D mesh) goes through `all_gather_single`, the collective of FSDP2's own steps:
    torch's full state dict (DTensor.redistribute's functional collectives) is a path no training
    step takes, and the one gloo crash on record ran inside it (CI 2026-12-05: a native thread's
    SIGSEGV while rank 1 waited in `wait_tensor` exporting a resumed run's weights). Any other
    layout goes through `DTensor.full_tensor`."""
    mesh = value.device_mesh
    if mesh.ndim != 1 or tuple(value.placements) != (Shard(0),):
        return value.full_tensor()
    group = mesh.get_group()
    ranks = dist.get_world_size(group)
    rows = value.shape[0]
    chunk = -(-rows // ranks)  # torch.chunk's split: the last ranks' shards may be short or empty
    shard = value.to_local().to(mesh.device_type)  # a CPU-offloaded shard is gathered on the mesh's device
    padded = shard.new_zeros((chunk, *value.shape[1:]))
    padded[: shard.shape[0]].copy_(shard)
    out = shard.new_empty((chunk * ranks, *value.shape[1:]))
    dist.all_gather_single(out, padded, group=group)
    return out[:rows]
