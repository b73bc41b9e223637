"""Which ranks see the same folder: shared by every node, or one copy per node (node-local).

A file one rank writes and another reads must either be in a folder every rank sees or be
made once per node. `probe_storage` tells which holds for a folder: global rank 0 writes a token
into it, every rank looks for it, and one all_reduce tells all. On a shared folder one rank
(global rank 0) writes for everyone and every rank writes its share of a common file; on a
node-local folder (/dev/shm, a node's scratch disk) the same happens per node, led by each
node's local rank 0. The run folder (checkpoints, done files, weights) must be shared.

Nodes are torchrun's agents: GROUP_RANK numbers them and LOCAL_RANK / LOCAL_WORLD_SIZE place a
rank in its node. Paths in the config may name environment variables (`$TMPDIR/cache`,
`/scratch/$SLURM_JOB_ID`), expanded by each process, so every node can use its own.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from entry.config.load import ConfigError
from entry.distributed.process_group import DistInfo

LOOK_AGAIN_S = (0.0, 0.2, 0.5, 1.0, 2.0)
"""Pauses between looks for the token: a network filesystem may cache "no such file" briefly."""


def expand_path(text: str) -> Path:
    """A config path with `$VAR` / `${VAR}` and `~` expanded in this process."""
    return Path(os.path.expanduser(os.path.expandvars(text)))


@dataclass(frozen=True, slots=True)
class StorageView:
    """How the ranks share `folder`: who writes, and how many ranks split a common job."""

    folder: Path
    shared: bool
    """Every rank sees what global rank 0 writes there."""
    leader: bool
    """This rank writes for its group (global rank 0 if shared, else its node's local rank 0)."""
    members: int
    """Ranks that see the same folder as this one (the world, or this node's ranks)."""
    index: int
    """This rank's position among them (its global rank, or its local rank)."""

    def describe(self) -> str:
        return "shared by every rank" if self.shared else "node-local (each node has its own)"


def _node() -> tuple[int, int, int]:
    """(node index, local rank, ranks on this node) from torchrun's environment."""
    local_rank = int(os.environ.get("LOCAL_RANK") or 0)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    return int(os.environ.get("GROUP_RANK") or 0), local_rank, per_node


def _sees(token: Path) -> bool:
    for pause in LOOK_AGAIN_S:
        time.sleep(pause)
        try:
            if token.name in os.listdir(token.parent):  # a fresh listing, not a cached lookup
                return True
        except FileNotFoundError:
            pass
    return False


def nearest_existing(folder: str | os.PathLike) -> Path:
    """`folder` made absolute if it exists, else its nearest existing ancestor: where creating it
    would write, so the file system it would live on."""
    existing = Path(folder).absolute()
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    return existing


def _path_id(path: Path) -> int:
    """A 62-bit id of `path`, to compare paths across ranks in one int64."""
    return int.from_bytes(hashlib.sha256(str(path).encode()).digest()[:8], "big") >> 2


def probe_storage(folder: str | os.PathLike, info: DistInfo, *, create: bool = True) -> StorageView:
    """Find out whether `folder` is shared by every rank (a collective: every rank calls it).

    Global rank 0 writes a token named by a random nonce, then broadcasts the nonce; every rank
    (each creates the folder if it lacks it) looks for the token; an all_reduce agrees on whether
    all saw it, and whether a rank on rank 0's own node missed it (then the folder is neither
    shared nor node-local, and a `ConfigError` says so). Rank 0 removes the token afterwards.

    With ``create=False`` nothing is created: the token goes to `folder`'s nearest existing
    ancestor (`nearest_existing`), the file system the folder will be made on, so a command can
    check before it has decided to write anything.
    """
    folder = Path(folder)
    if create:
        folder.mkdir(parents=True, exist_ok=True)
    node, local_rank, per_node = _node()
    if not info.distributed:
        return StorageView(folder, True, True, 1, 0)
    place = folder.absolute() if create else nearest_existing(folder)
    # What is yet to be made below the token's folder: two ranks whose folders differ there (a
    # per-node `$GROUP_RANK` in the path) do not share one, though both would be made in one shared
    # ancestor. Nothing is left to make where the folder exists (and with create).
    rest = _path_id(folder.absolute().relative_to(place))
    # [nonce, rank 0's node, rank 0's rest]: rank 0 writes the token before the broadcast, so
    # receiving it means written.
    sent = torch.tensor([secrets.randbits(62) if info.is_main else 0, node, rest], dtype=torch.int64,
                        device=info.device)
    if info.is_main:
        (place / f".storage-probe-{int(sent[0]):x}").write_bytes(b"written by global rank 0\n")
    dist.broadcast(sent, src=0)
    nonce, rank0_node, rank0_rest = (int(x) for x in sent.tolist())
    token = place / f".storage-probe-{nonce:x}"
    seen = rank0_rest == rest and _sees(token)
    flags = torch.tensor([float(not seen), float(not seen and node == rank0_node)], device=info.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if info.is_main:
        token.unlink(missing_ok=True)
    missed, missed_on_node0 = (bool(x) for x in flags.tolist())
    if missed_on_node0:
        raise ConfigError(f"{folder}: some ranks on node 0 do not see a file that global rank 0 wrote there, so the "
                          f"folder is neither shared by all ranks nor one per node; point it at a shared filesystem "
                          f"or at a node-local one (/dev/shm, local scratch)")
    if not missed:
        return StorageView(folder, True, info.is_main, info.world_size, info.rank)
    return StorageView(folder, False, local_rank == 0, per_node, local_rank)


def require_shared(folder: str | os.PathLike, info: DistInfo, key: str) -> None:
    """`ConfigError` naming `key` unless every rank can write `folder` and sees it (the run folder:
    checkpoints, done files and weights are written by one rank and read by all). Creates nothing:
    a config or data error found after this check leaves no empty folder behind."""
    if not check_storage(folder, info, key).shared:
        raise ConfigError(f"{key}: {folder} is not shared by every node (ranks of other nodes do not see what global "
                          f"rank 0 writes there); checkpoints, done files and weights are read by every rank, so put "
                          f"{key} on a filesystem all nodes mount (NFS, Lustre, a cloud bucket mount)")


def check_storage(folder: str | os.PathLike, info: DistInfo, key: str) -> StorageView:
    """How the ranks would share `folder`, creating nothing (a collective): `ConfigError` naming
    `key` unless every rank can write it (`require_writable`), then `probe_storage` with
    ``create=False``, so a folder not made yet is judged where it would be made."""
    require_writable(folder, info, key)
    return probe_storage(folder, info, create=False)


def write_refusal(folder: Path) -> str | None:
    """Why the existing folder `folder` takes no new entry (the OS's words), None when it takes one: creates and
    at once removes an empty folder in it, the only sure test (as root, `os.access` says yes where the file
    system, /proc or a read-only mount, says no)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=folder))
    except OSError as e:
        return e.strerror or str(e)
    return None


def require_writable(folder: str | os.PathLike, info: DistInfo, key: str) -> None:
    """`ConfigError` naming `key` on every rank unless each rank can create `folder` (or write in it):
    checked before a command writes anything, so an unwritable folder (under /proc, read-only, a
    file in the way) is one line instead of a traceback after the data were prepared. A collective.

    Probes `folder`'s nearest existing ancestor (`write_refusal`); creates nothing else.
    """
    folder = Path(folder).absolute()
    existing = nearest_existing(folder)
    error = None
    if not existing.is_dir():
        error = f"{existing} is not a folder"
    elif (why := write_refusal(existing)) is not None:
        error = f"cannot create a folder in {existing} ({why})"
    failed = error is not None
    if info.distributed:
        flag = torch.tensor([float(failed)], device=info.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    if failed:
        raise ConfigError(f"{key}: {folder} is not writable ({error or 'on another rank'}); point {key} at a "
                          f"folder this user can write")
