"""Process-group life cycle: the only place (with entry/distributed/sharding.py) that knows about ranks.

Distributed rules 1, 5 and 8 of docs/design.md: the process group comes first, with a
finite timeout; a restarted torchrun attempt gets a store namespace of its own so it never
reads the failed attempt's rendezvous keys; `faulthandler` is on for every rank.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import gc
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from entry.config.load import ConfigError
from entry.distributed.precision import enable_tf32


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process sits: rank, world size, local rank, device and backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    restart_count: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def choose_backend(requested: str, cuda: bool) -> str:
    """`auto` is nccl with CUDA and gloo without; an explicit choice is kept."""
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    return requested


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def exit_with_agent() -> bool:
    """Under torchrun, ask the kernel to send this worker SIGTERM when its agent (the parent) dies.

    Without it, a SIGKILLed agent leaves its workers training and writing on their own. SIGTERM,
    not SIGKILL: the training loop turns it into a checkpoint that every rank writes together,
    then exits 143 (a worker outside the loop just ends). Returns whether it was armed (Linux
    under torchrun only).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return False
    # The agent died before the request took effect (an orphan is adopted by init, pid 1). Under
    # a sub-reaper the pid differs; then the store connection to the dead agent fails instead.
    if parent == 1 or os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def check_gpus_per_node(processes: int, gpus: int) -> None:
    """One GPU per process: more processes on a node than it has GPUs is a `ConfigError` naming
    both numbers and the fix (raised before any CUDA work, so the command exits 2)."""
    if processes > gpus:
        raise ConfigError(f"torchrun started {processes} processes on this node (--nproc_per_node={processes}) "
                          f"but it has {gpus} GPU(s); use --nproc_per_node={gpus} (one process per GPU), or "
                          f"hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU")


def init_distributed(*, backend: str = "auto", timeout_s: float = 300.0, debug: bool = False) -> DistInfo:
    """Initialise the process group from torchrun's environment (or none for a plain run).

    Returns this process's `DistInfo`. Also selects this rank's GPU and turns TF32 on for its
    fp32 matmuls (entry.distributed.precision.enable_tf32). Under torchrun the group is built over a `TCPStore`
    client of MASTER_ADDR:MASTER_PORT wrapped in a `PrefixStore` named by
    TORCHELASTIC_RESTART_COUNT, so a restarted attempt never reads the keys of the attempt
    that failed (docs/design.md, distributed rule 8: plain `init_process_group` failed every restart).
    """
    faulthandler.enable(all_threads=True)
    exit_with_agent()
    if debug:
        os.environ.setdefault("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
        os.environ.setdefault("NCCL_DEBUG", "INFO")
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    restart = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    cuda = torch.cuda.is_available()
    if cuda:
        check_gpus_per_node(_env_int("LOCAL_WORLD_SIZE", 1), torch.cuda.device_count())
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    enable_tf32(device)
    if world_size == 1:
        return DistInfo(0, 1, 0, device, None, restart)
    chosen = choose_backend(backend, cuda)
    timeout = datetime.timedelta(seconds=timeout_s)
    # torchrun's own agent hosts the TCPStore at MASTER_ADDR:MASTER_PORT; workers are clients.
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         world_size=world_size, is_master=False, timeout=timeout,
                         wait_for_workers=False)
    store = dist.PrefixStore(f"universal-simulator/attempt{restart}", base)
    dist.init_process_group(chosen, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if chosen == "nccl" else None)
    return DistInfo(rank, world_size, local_rank, device, chosen, restart)


def close_distributed() -> None:
    """Destroy the process group if one exists (safe to call on every exit path, meant for a `finally`).

    Leaving normally (no exception on its way out), each rank first waits at a barrier for the others, so no
    rank tears its group down while a peer still runs a collective with it; then the group's C++ objects are
    freed while the interpreter is whole. Gloo ranks aborted at exit in our suite without it ("terminate called
    without an active exception": 2026-11-29 the pipeline's rank 1, after its last file; never on demand). Leaving on an
    exception, a rank does not wait: its peers fail on their next collective or the group's timeout, and a
    peer that fails at this barrier (raising the backend's error) still destroys its group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if sys.exc_info()[0] is None:  # in a `finally`, set while an exception propagates through it
            dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()  # reference cycles holding a process group or its work: freed now, not at interpreter exit


def all_reduce_mean(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Mean over ranks of a tensor (a collective every rank must reach); identity at world size 1."""
    if not info.distributed:
        return values
    out = values.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / info.world_size


def all_reduce_max(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Max over ranks (used to agree on flags such as 'this rank saw a non-finite value')."""
    if not info.distributed:
        return values
    out = values.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def rank0_published(info: DistInfo, wrote: bool) -> None:
    """Every rank calls this after rank 0 wrote shared files (weights, a cache): afterwards the
    files are visible to all. Rank 0 passes whether its writes succeeded; a failure there
    raises on every rank, so no rank goes on to read a file that is not there."""
    if not info.distributed:
        return
    flag = torch.tensor([1.0 if (wrote or not info.is_main) else 0.0], device=info.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() < 1.0:
        raise RuntimeError("rank 0 failed to write the files this step publishes; see rank0.log")
