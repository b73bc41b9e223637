"""Batch-gathering views over a cached latent TensorDict (memory-mapped, CPU).

Legend: N trajectories, T time steps, L latent tokens, D latent width, B batch, k horizon.

The cache holds ``{"z": [N, T, L, D], "task_id": [N], "dt": [N], ...}`` with batch size
``[N]``. Every key other than ``"z"`` is per trajectory. A dataset here is a *batch*
gatherer: ``gather(indices) -> TensorDict[B]`` does one fancy index per key, so a batch
costs a handful of reads from the memmap (the pages are shared by every thread and by
the OS page cache) instead of B ``__getitem__`` calls and a collate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = ["LatentPairs", "LatentTrajectories"]


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

    def _sizes(self, per_traj: int) -> dict[str, int]:
        names = self.task_names
        return {(names[t] if names else str(t)): c * per_traj
                for t, c in zip(self.task_ids, self.traj_per_task)}

    def _rows(self, traj_j: torch.Tensor) -> torch.Tensor:
        return self.order_N[traj_j]

    def _per_traj(self, rows_B: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[rows_B] for k, v in self.cache.items() if k != "z"}


class LatentPairs(_TaskOrdered):
    """Pairs (z_t, z_{t+k}) of cached latent trajectories.

    Index ``i = j * (T - k * R) + t`` with ``j`` the trajectory's position in task order (the
    cache's own order when it is already sorted by ``task_id``) and ``t`` in ``[0, T - k * R)``.
    ``gather(i_B)`` returns a TensorDict[B] with ``z_t``, ``z_next`` ([B, L, D]),
    ``dt`` = k * dt (the time elapsed between ``z_t`` and ``z_next``), ``t`` (int64),
    ``task_id`` and every other per-trajectory key of the cache; with ``unroll`` R > 1 also
    ``z_seq`` [B, R, L, D], the targets ``z_{t+k}, ..., z_{t+R k}`` of an R-step rollout.

    Args:
        cache_td: TensorDict from ``load_cache`` (batch size [N]).
        horizon_k: steps between input and target (>= 1, < T).
        task_names: optional names indexed by task id, used as keys of ``task_sizes``.
        unroll: R, operator steps each sample's targets cover (``k * R < T``).
    """

    def __init__(self, cache_td: TensorDictBase, *, horizon_k: int = 1,
                 task_names: Sequence[str] | None = None, unroll: int = 1):
        super().__init__(cache_td, task_names)
        if not 1 <= horizon_k < self.n_steps:
            raise ValueError(f"horizon_k must be in [1, T={self.n_steps}), got {horizon_k}")
        if unroll < 1 or horizon_k * unroll >= self.n_steps:
            raise ValueError(f"unroll={unroll} steps of horizon {horizon_k} need a trajectory longer than "
                             f"{horizon_k * unroll} steps, got T={self.n_steps}")
        self.horizon_k, self.unroll = horizon_k, unroll
        self.pairs_per_traj = self.n_steps - horizon_k * unroll

    def __len__(self) -> int:
        return self.n_traj * self.pairs_per_traj

    @property
    def task_sizes(self) -> dict[str, int]:
        """Number of pairs per task, in global index order (feeds MultiTaskBatchSampler)."""
        return self._sizes(self.pairs_per_traj)

    def gather(self, indices: Sequence[int] | torch.Tensor) -> TensorDict:
        i_B = torch.as_tensor(indices, dtype=torch.long)
        if i_B.numel() and (i_B.min() < 0 or i_B.max() >= len(self)):
            raise IndexError(f"pair index out of range [0, {len(self)})")
        rows_B = self._rows(i_B // self.pairs_per_traj)
        t_B = i_B % self.pairs_per_traj
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
        return self._sizes(1)

    def gather(self, indices: Sequence[int] | torch.Tensor) -> TensorDict:
        j_B = torch.as_tensor(indices, dtype=torch.long)
        rows_B = self._rows(j_B)
        out = self._per_traj(rows_B)
        out["z"] = self.cache["z"][rows_B]
        return TensorDict(out, batch_size=[j_B.numel()])

    __getitem__ = gather
