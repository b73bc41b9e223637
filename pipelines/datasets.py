"""Batch-gathering views over a cached latent TensorDict (memory-mapped, CPU).

Legend: N trajectories, T time steps, L latent tokens, D latent width, B batch, k horizon.

The cache holds ``{"z": [N, T, L, D], "task_id": [N], "dt": [N], ...}`` with batch size
``[N]``. Every key other than ``"z"`` is per trajectory. Tasks of other trajectory lengths share one
cache: T is then the longest, and ``"steps"`` [N] (``STEPS_KEY``) holds each trajectory's own length;
the frames after it are padding that no pair reads. A dataset here is a *batch*
gatherer: ``gather(indices) -> TensorDict[B]`` does one fancy index per key, so a batch
costs a handful of reads from the memmap (the pages are shared by every thread and by
the OS page cache) instead of B ``__getitem__`` calls and a collate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = ["LatentPairs", "LatentTrajectories", "STEPS_KEY"]

STEPS_KEY = "steps"
"""The cache key of each trajectory's own number of frames, present only where they differ."""


def _check_cache(cache_td: TensorDictBase) -> tuple[int, int]:
    if "z" not in cache_td.keys():
        raise ValueError(f"latent cache has no 'z' key; keys: {sorted(cache_td.keys())}")
    z = cache_td["z"]
    if z.ndim != 4:
        raise ValueError(f"cache 'z' must be [N, T, L, D], got shape {tuple(z.shape)}")
    for key in ("task_id", "dt"):
        if key not in cache_td.keys():
            raise ValueError(f"latent cache has no {key!r} key")
    return z.shape[0], z.shape[1]


class _TaskOrdered:
    """Orders trajectories by task id (stable), so global indices are task-contiguous."""

    def __init__(self, cache_td: TensorDictBase, task_names: Sequence[str] | None):
        self.cache = cache_td
        self.n_traj, self.n_steps = _check_cache(cache_td)
        task_id = torch.as_tensor(cache_td["task_id"]).long().reshape(self.n_traj)
        # order_N[j] is the cache row of the j-th trajectory in task order
        self.order_N = torch.argsort(task_id, stable=True)
        ids, counts = torch.unique(task_id, sorted=True, return_counts=True)
        self.task_ids = ids.tolist()
        self.traj_per_task = counts.tolist()
        if task_names is not None and len(task_names) <= max(self.task_ids, default=-1):
            raise ValueError(f"task_names has {len(task_names)} names but the cache uses "
                             f"task ids up to {max(self.task_ids)}")
        self.task_names = list(task_names) if task_names is not None else None
        # steps_N[j]: the frames of the j-th trajectory in task order (T for all in a cache of one length)
        self.steps_N = (torch.as_tensor(cache_td[STEPS_KEY]).long().reshape(self.n_traj)[self.order_N]
                        if STEPS_KEY in cache_td.keys() else torch.full((self.n_traj,), self.n_steps))
        if self.n_traj and not (1 <= int(self.steps_N.min()) and int(self.steps_N.max()) <= self.n_steps):
            raise ValueError(f"cache {STEPS_KEY!r} must lie in [1, T={self.n_steps}], got "
                             f"[{int(self.steps_N.min())}, {int(self.steps_N.max())}]")

    def _sizes(self, per_traj_N: torch.Tensor) -> dict[str, int]:
        """Items per task, from the items of every trajectory in task order."""
        names = self.task_names
        sums = torch.split(per_traj_N, self.traj_per_task)
        return {(names[t] if names else str(t)): int(s.sum()) for t, s in zip(self.task_ids, sums)}

    def _rows(self, traj_j: torch.Tensor) -> torch.Tensor:
        return self.order_N[traj_j]

    def _per_traj(self, rows_B: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[rows_B] for k, v in self.cache.items() if k != "z"}


class LatentPairs(_TaskOrdered):
    """Pairs (z_t, z_{t+k}) of cached latent trajectories.

    Index ``i = start_j + t`` with ``j`` the trajectory's position in task order (the cache's own
    order when it is already sorted by ``task_id``), ``t`` in ``[0, T_j - k * R)`` and ``start_j`` the
    pairs of the trajectories before ``j``: ``j * (T - k * R)`` when every trajectory has T frames;
    a trajectory of ``T_j`` < T frames (``STEPS_KEY``) gives pairs within its own frames only.
    ``gather(i_B)`` returns a TensorDict[B] with ``z_t``, ``z_next`` ([B, L, D]),
    ``dt`` = k * dt (the time elapsed between ``z_t`` and ``z_next``), ``t`` (int64),
    ``task_id`` and every other per-trajectory key of the cache; with ``unroll`` R > 1 also
    ``z_seq`` [B, R, L, D], the targets ``z_{t+k}, ..., z_{t+R k}`` of an R-step rollout.

    Args:
        cache_td: TensorDict from ``load_cache`` (batch size [N]).
        horizon_k: steps between input and target (>= 1, < every T_j).
        task_names: optional names indexed by task id, used as keys of ``task_sizes``.
        unroll: R, operator steps each sample's targets cover (``k * R < `` every T_j).
    """

    def __init__(self, cache_td: TensorDictBase, *, horizon_k: int = 1,
                 task_names: Sequence[str] | None = None, unroll: int = 1):
        super().__init__(cache_td, task_names)
        shortest = int(self.steps_N.min()) if self.n_traj else self.n_steps
        if not 1 <= horizon_k < shortest:
            raise ValueError(f"horizon_k must be in [1, T={shortest}), got {horizon_k}")
        if unroll < 1 or horizon_k * unroll >= shortest:
            raise ValueError(f"unroll={unroll} steps of horizon {horizon_k} need a trajectory longer than "
                             f"{horizon_k * unroll} steps, got T={shortest}")
        self.horizon_k, self.unroll = horizon_k, unroll
        self.pairs_N = self.steps_N - horizon_k * unroll
        self.first_N = torch.cumsum(self.pairs_N, 0) - self.pairs_N  # index of each trajectory's first pair

    def __len__(self) -> int:
        return int(self.pairs_N.sum())

    @property
    def task_sizes(self) -> dict[str, int]:
        """Number of pairs per task, in global index order (feeds MultiTaskBatchSampler)."""
        return self._sizes(self.pairs_N)

    def gather(self, indices: Sequence[int] | torch.Tensor) -> TensorDict:
        i_B = torch.as_tensor(indices, dtype=torch.long)
        if i_B.numel() and (i_B.min() < 0 or i_B.max() >= len(self)):
            raise IndexError(f"pair index out of range [0, {len(self)})")
        j_B = torch.searchsorted(self.first_N, i_B, right=True) - 1
        rows_B = self._rows(j_B)
        t_B = i_B - self.first_N[j_B]
        z = self.cache["z"]
        out = self._per_traj(rows_B)
        out["dt"] = out["dt"] * self.horizon_k
        out["z_t"] = z[rows_B, t_B]
        out["z_next"] = z[rows_B, t_B + self.horizon_k]
        if self.unroll > 1:
            offsets_R = self.horizon_k * torch.arange(1, self.unroll + 1)
            out["z_seq"] = z[rows_B[:, None], t_B[:, None] + offsets_R]
        out["t"] = t_B
        return TensorDict(out, batch_size=[i_B.numel()])

    __getitem__ = gather


class LatentTrajectories(_TaskOrdered):
    """Whole cached trajectories for evaluation: ``gather(j_B)`` -> {z: [B, T, L, D], ...}."""

    def __init__(self, cache_td: TensorDictBase, *, task_names: Sequence[str] | None = None):
        super().__init__(cache_td, task_names)

    def __len__(self) -> int:
        return self.n_traj

    @property
    def task_sizes(self) -> dict[str, int]:
        return self._sizes(torch.ones(self.n_traj, dtype=torch.long))

    def gather(self, indices: Sequence[int] | torch.Tensor) -> TensorDict:
        j_B = torch.as_tensor(indices, dtype=torch.long)
        rows_B = self._rows(j_B)
        out = self._per_traj(rows_B)
        out["z"] = self.cache["z"][rows_B]
        return TensorDict(out, batch_size=[j_B.numel()])

    __getitem__ = gather
