"""Per-task statistics of a latent cache's training pairs, measured before a stage trains: the
steady prior's solution mean (entry/steady.py) and the operator's per-task loss weights
(entry/operator.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDictBase

from entry.config.schema import Config
from entry.data.cache_plan import cache_plan, open_cache
from entry.distributed.process_group import DistInfo, all_reduce_mean
from pipelines.datasets import LatentPairs

CHUNK = 256
"""Pairs gathered at a time."""


def per_task_mean(cfg: Config, info: DistInfo, kind: str, value: Callable[[TensorDictBase], torch.Tensor], *,
                  horizon: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of ``value(pairs)`` ([B, ...] per pair) over each task's training pairs of cache
    ``kind``. -> (means [T, ...] float32, pairs per task [T] int64); a task without pairs gets zeros.

    A collective: every rank sums a contiguous share of the pairs in float64 and the sums are
    reduced, so every rank gets the same value at any world size. Read from the cache, not the
    stage's loader, whose position and shuffle state it would move.
    """
    plan = cache_plan(cfg, kind, "train")
    dataset = LatentPairs(open_cache(plan), horizon_k=horizon, task_names=list(plan.task_names))
    shape = value(dataset.gather(torch.tensor([0]))).shape[1:]
    sums = torch.zeros(len(cfg.data.tasks), shape.numel() + 1, dtype=torch.float64)
    mine = torch.arange(len(dataset)).tensor_split(info.world_size)[info.rank]
    for chunk in mine.split(CHUNK):
        pairs = dataset.gather(chunk)
        rows = torch.cat([value(pairs).reshape(len(chunk), -1).double(),
                          torch.ones(len(chunk), 1, dtype=torch.float64)], 1)
        sums.index_add_(0, pairs["task_id"].long(), rows)
    # The mean over ranks of both sums keeps their ratio; the counts come back times 1 / world.
    sums = all_reduce_mean(sums.to(info.device), info).cpu() * info.world_size
    counts = sums[:, -1].round().long()
    means = sums[:, :-1] / sums[:, -1:].clamp_min(1.0)
    return means.reshape(len(cfg.data.tasks), *shape).float(), counts
