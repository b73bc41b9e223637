"""Who builds a latent cache folder: one job at a time, holding `<folder>.lock` (the project's
one lock, entry.storage.folder_lock). A cache folder is keyed by its content (its encoder and
data, entry/data/cache_plan.py), so two runs of one sweep whose codecs came out bitwise equal need
the same folder: the second waits for the first's build and reuses it, rather than stopping."""

from __future__ import annotations

from pathlib import Path

import torch

from entry.data.cache_plan import CachePlan, cache_in_place
from entry.distributed.process_group import DistInfo, all_reduce_max
from entry.storage.folder_lock import FolderInUse, acquire_waiting
from entry.storage.probe import StorageView
from pipelines.latent_cache import CacheError


def cache_lock_file(out: Path) -> Path:
    """The lock every builder of the cache folder `out` holds (`<out>.lock` beside it)."""
    return out.with_name(out.name + ".lock")


def agree_on_failure(error: Exception | None, info: DistInfo, what: str) -> None:
    """Every rank raises when any rank failed (`error` here, or elsewhere); a collective."""
    if info.distributed:
        failed = all_reduce_max(torch.tensor([float(error is not None)], device=info.device), info).item() > 0
        if failed and error is None:
            error = CacheError(f"{what} failed on another rank (its log names the cause)")
    if error is not None:
        raise error


def built_meanwhile(plan: CachePlan, info: DistInfo, view: StorageView, wait_s: float) -> bool:
    """Each folder's leader takes the lock of `plan`'s cache folder (and holds it: the build that
    follows needs it), waiting up to `wait_s` seconds while another job builds it. Returns True when
    every leader had to wait and then found that job's cache in place and matching: nothing is left
    to build. A collective (the other ranks wait in it, hence a `wait_s` under the process group's
    timeout). Raises `FolderInUse` on every rank when the other job holds the lock past `wait_s`."""
    found, error = True, None  # the other ranks do not hold back their leaders' agreement
    if view.leader:
        try:
            plan.folder.parent.mkdir(parents=True, exist_ok=True)
            waited = acquire_waiting(cache_lock_file(plan.folder), what=f"latent cache {plan.folder}", wait_s=wait_s)
            found = waited and cache_in_place(plan)
        except FolderInUse as e:
            error = e
    agree_on_failure(error, info, f"taking the lock of the latent cache {plan.folder}")
    return all_reduce_max(torch.tensor([float(not found)], device=info.device), info).item() == 0
