"""One training step's memory and communication on N ranks, simulated: no GPU, no processes.

The trainable model is built on the meta device and sharded by `entry.distributed.sharding.wrap_model`,
the function training uses, over a process group of torch's "fake" backend (N ranks, this
process being rank 0; collectives return at once and move nothing). Everything is then
materialised and run under `FakeTensorMode`: tensors have shapes, dtypes and storages of the
right size, but no data and no compute, so one forward and backward of a full per-rank batch
costs the same at 8 ranks as at 1024. `LiveMemory` counts the bytes of every storage alive at
each operation (as the CUDA caching allocator would see the requests) and the bytes each
collective moves.

Rank 0 is the rank simulated: FSDP2 pads every sharded dimension to a multiple of N and gives
the padding to the last ranks, so rank 0 holds the most.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from entry.distributed.precision import compute_autocast
from entry.distributed.process_group import DistInfo
from entry.distributed.sharding import gradient_sync, wrap_model

SIMULATED_DEVICE = "cpu"
"""Fake tensors live on the CPU: a CPU-only torch cannot make fake CUDA tensors. Allocation
sizes are the same; kernels that keep extra workspace on a GPU (attention's) are not counted."""


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of `world_size` ranks as the default group (none at world size 1).

    Refuses to run beside a real process group: the simulation needs this process to itself
    (entry.pipeline runs the planner in a child process).
    """
    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("the memory simulation needs a process without a process group; run entry.plan")
    # Importing the module registers torch's "fake" backend (it ships with torch, under testing).
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class LiveMemory(TorchDispatchMode):
    """Bytes of the storages alive, their peak, and the bytes all-gathered and reduce-scattered.

    Every storage an operation returns is counted until it is freed (a weak reference sees
    that); FSDP2 frees and re-allocates its unsharded parameters by resizing their storages,
    which no dispatch mode sees, so `UntypedStorage.resize_` is wrapped while the mode is on.
    All-gather bytes are those of the gathered output (what each rank receives, its own shard
    included); reduce-scatter bytes those of the full input each rank contributes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.gathered = self.scattered = 0
        self.ops = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._resize = None

    def reset_peak(self) -> None:
        self.peak = self.live

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        size = storage.nbytes()
        if key in self._sizes:
            self.live += size - self._sizes[key]
        else:
            self.live += size
            self._refs[key] = weakref.ref(storage, lambda _, k=key: self._free(k))
        self._sizes[key] = size
        self.peak = max(self.peak, self.live)

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = original(storage, size)
            self._track(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn itself into local-tensor operations first
        self.ops += 1
        out = func(*args, **(kwargs or {}))
        namespace, name = func.namespace, func.__name__
        if namespace in ("c10d", "_c10d_functional"):
            moved = max((t.nbytes for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), default=0)
            if "allgather" in name or "all_gather" in name:
                self.gathered += moved
            elif "reduce_scatter" in name:
                self.scattered += moved
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                self._track(t.untyped_storage())
        return out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors count their local shard's)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class StageProbe:
    """What one training stage holds and runs, for the simulation.

    `make` builds the trainable model. `frozen` maps a keyword of the step function to
    (builder, sharded): a frozen copy on every rank (as `load_frozen` makes) or, when sharded, a
    second module sharded like the trainable one (the consistency stage's EMA target).
    `resident` builds frozen networks the stage holds but the step does not take (validation's
    autoencoder). `batch(b)` makes a per-rank batch of `b` samples.
    """

    name: str
    make: Callable[[], nn.Module]
    step_fn: Callable
    step_cfg: object
    batch: Callable[[int], object]
    frozen: dict[str, tuple[Callable[[], nn.Module], bool]] = field(default_factory=dict)
    resident: tuple[Callable[[], nn.Module], ...] = ()


@dataclass(frozen=True)
class StepMemory:
    """Rank 0's bytes in one optimizer step at one micro-batch size."""

    micro_batch: int
    parameters: int
    """The trainable model's parameter storage (under FSDP2 its padded local shards)."""
    frozen: int
    """Frozen networks held during training (full copies; shards for a sharded target)."""
    gradients: int
    optimizer: int
    activation_peak: int
    """Peak of forward + backward above what was alive before the forward: activations, FSDP2's
    gathered parameters and communication buffers, gradients as they form."""
    step_peak: int
    """Everything alive at that peak (parameters, optimizer state, batch ... included)."""
    optimizer_peak: int
    """Everything alive at the peak of the optimizer step."""
    all_gathered: int
    """Bytes all-gathered per optimizer step, over all its micro-steps."""
    reduce_scattered: int
    ops: int
    """Operations dispatched for the step: the simulation's cost, the same at any world size."""
    all_reduced: int = 0
    """Bytes all-reduced per optimizer step (DDP's gradients; entry.plan adds them)."""

    @property
    def total_peak(self) -> int:
        return max(self.step_peak, self.optimizer_peak)


def simulate_step(probe: StageProbe, *, world_size: int, micro_batches: tuple[int, ...], accum_steps: int,
                  parallel: str, precision: str, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
                  ) -> list[StepMemory]:
    """Simulate one optimizer step of `probe` on rank 0 of `world_size`, per size in `micro_batches`.

    `accum_steps` micro-steps make a step, as in the training loop: two are simulated (the first
    without gradient sync, the last with it) and the others counted as repeats of the first.
    `parallel` and `precision` are training's; `make_optimizer(model)` builds its optimizer, or
    returns None for a model with nothing to train (a codec that is its fitted linear path): then
    no backward and no optimizer step run, and gradients and optimizer state are 0 bytes.
    Each step is measured in the steady state of training: optimizer state allocated, gradients
    of the previous step freed. Returns one `StepMemory` per micro-batch size.
    """
    meta = DistInfo(0, world_size, 0, torch.device("meta"), "fake" if world_size > 1 else None, 0)
    with fake_world(world_size):
        with torch.device("meta"):
            model = probe.make()
            frozen = {key: make().requires_grad_(False) for key, (make, _) in probe.frozen.items()}
            resident = [make().requires_grad_(False) for make in probe.resident]
        model = wrap_model(model, meta, parallel=parallel, precision=precision)
        for key, (_, sharded) in probe.frozen.items():
            net = frozen[key]
            frozen[key] = wrap_model(net, meta, parallel=parallel, precision=precision) if sharded else net.eval()
        with FakeTensorMode(allow_non_fake_inputs=True), LiveMemory() as mem:
            for net in (model, *frozen.values(), *resident):
                net.to_empty(device=SIMULATED_DEVICE)  # FSDP2 re-points its shards at the new storages
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = make_optimizer(model)
            if optimizer is not None:
                for p in params:  # the optimizer state, as a first step allocates it
                    p.grad = torch.zeros_like(p)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            state = optimizer.state.values() if optimizer is not None else ()
            held = {"parameters": storage_bytes(params),
                    "frozen": storage_bytes([p for net in (*frozen.values(), *resident) for p in net.parameters()]),
                    "optimizer": storage_bytes([v for s in state for v in s.values() if isinstance(v, torch.Tensor)])}
            run = DistInfo(0, world_size, 0, torch.device(SIMULATED_DEVICE), meta.backend, 0)
            return [_one_step(probe, model, frozen, optimizer, mem, micro, accum_steps, run, parallel, precision, held)
                    for micro in micro_batches]


def _one_step(probe: StageProbe, model: nn.Module, frozen: dict, optimizer, mem: LiveMemory, micro: int, accum: int,
              info: DistInfo, parallel: str, precision: str, held: dict[str, int]) -> StepMemory:
    """The micro-steps (forward, backward) and the optimizer step, as entry/training/loop.py runs them."""
    batch = probe.batch(micro * accum)  # the loop moves the whole per-rank batch, then slices it
    generator = torch.Generator().manual_seed(0)
    simulated = min(accum, 2)
    before, ops = mem.live, mem.ops
    mem.reset_peak()
    moved = []
    for m in range(simulated):
        gathered, scattered = mem.gathered, mem.scattered
        with gradient_sync(model, m == simulated - 1):
            with compute_autocast(info.device, precision):  # forward only, as the loop does
                loss, _ = probe.step_fn(model, dict(model.named_parameters()), batch[m * micro:(m + 1) * micro],
                                        cfg=probe.step_cfg, generator=generator, **frozen)
            if loss.requires_grad:  # a model with nothing to train runs its forward only
                (loss / accum).backward()
        moved.append((mem.gathered - gathered, mem.scattered - scattered))
    step_peak = mem.peak
    gradients = storage_bytes([p.grad for p in model.parameters()])
    mem.reset_peak()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    optimizer_peak = mem.peak
    repeats = accum - simulated  # micro-steps that do what the first, unsynchronised one did
    return StepMemory(micro_batch=micro, gradients=gradients, activation_peak=step_peak - before, step_peak=step_peak,
                      optimizer_peak=optimizer_peak,
                      all_gathered=sum(g for g, _ in moved) + repeats * moved[0][0],
                      reduce_scattered=sum(s for _, s in moved) + repeats * moved[0][1],
                      ops=mem.ops - ops, **held)
