# long file: one pipeline: its dataset, window arithmetic and loader assembly change together
"""Field pipeline: batches of raw PDEBench fields (autoencoder stage, bench's plain baseline).

Legend: B batch, C channels, S spatial axes (X or X, Y), T' stored steps after reduce_t.

The same node graph as the latent pipeline (`pipelines.loader.build_loader`), over HDF5:

- ``FieldSnapshots``: one field u [C, *S] per sample, for reconstruction training.
- ``FieldTrajectoryPairs``: (u_t, u_next, dt) pairs read straight from HDF5 per batch.
- ``TaskAlternatingBatchSampler`` + ``ConcatFields``: single-task batches (1D and 2D
  fields cannot share a batch), the same task on every rank at every step.
- ``build_field_loader``: the three above wired into ``build_loader``.

Sample ids follow the latent cache's convention (``entry.data.latent_cache``): ``task_id * 10**9 +``
a per-file number, here ``row * per_row + k`` (k: the reduced time step, or 0 = ``nu``,
1 = ``tensor`` for Darcy), so an id does not depend on the split or the batch order.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tensordict import TensorDict

from pipelines.loader import StatefulLoader, build_loader
from pipelines.memory import read_budget
from pipelines.layouts import DataError, DatasetReader
from pipelines.task_data import task_description, task_name
from pipelines.tasks import TaskSpec

__all__ = ["FieldSnapshots", "FieldTrajectoryPairs", "ConcatFields", "TaskAlternatingBatchSampler",
           "build_field_loader", "SAMPLE_ID_STRIDE", "IN_MEMORY_BYTES"]

SAMPLE_ID_STRIDE = 10**9
"""Offset of each task's sample ids (the latent cache's ``task_id * 10**9 + row``)."""
IN_MEMORY_BYTES = None
"""FieldSnapshots loads the reduced selection into memory once when it is at most
`pipelines.memory.read_budget()` big (256 MiB, less where memory is short): one sequential read,
then every batch is a memory index; above it, every batch is an HDF5 read."""


class _H5Source:
    """A task's validated data, read through its layout (`pipelines.task_data`); its files opened
    lazily once per process (an h5py handle does not survive a fork; threads share one handle,
    h5py serialises their reads)."""

    def __init__(self, path: str | os.PathLike, indices, reduce_x: int, reduce_t: int, task: TaskSpec | None = None):
        if reduce_x < 1 or reduce_t < 1:
            raise ValueError(f"reduce_x and reduce_t must be >= 1, got {reduce_x}, {reduce_t}")
        self.path, self.reduce_x, self.reduce_t = Path(path), reduce_x, reduce_t
        self.description = desc = task_description(self.path, task)  # DataError if missing or not the task's
        self.task_name = task_name(self.path, task, desc)
        self.rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = desc.trajectories
        if self.rows.size and (self.rows.min() < 0 or self.rows.max() >= n):
            raise DataError(f"{self.path}: sample indices must lie in [0, {n}), "
                            f"got min {self.rows.min()} max {self.rows.max()}")
        self.steady = desc.steady
        self.channels = len(desc.channels)
        self.n_steps = 1 if self.steady else math.ceil(desc.steps / reduce_t)
        self.spatial = tuple(math.ceil(s / reduce_x) for s in desc.grid.shape)
        # time between two kept steps (the file's spacing times reduce_t); 1.0 for steady tasks
        t = desc.times
        self.dt = 1.0 if t is None or t.size < reduce_t + 1 else float(t[reduce_t] - t[0])
        self._pid, self._reader = None, None

    def reader(self) -> DatasetReader:
        if self._pid != os.getpid():
            self._reader, self._pid = DatasetReader(self.description), os.getpid()
        return self._reader

    def read_rows(self, key: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(data of the sorted unique ``rows``, reduced, as [R, T', C, *S] (a steady task's input
        field, ``nu``, and its solution, ``tensor``: T' = 1); position of each requested row in it).
        One read per source file (PDEBench's: a slice when the rows are contiguous)."""
        uniq, pos = np.unique(rows, return_inverse=True)
        if key == "nu":  # a steady task's input field
            data = self.reader().constants(uniq, x_step=self.reduce_x)[:, None]
        else:
            data = self.reader().windows(uniq, t_step=1 if self.steady else self.reduce_t, x_step=self.reduce_x)
        return data, pos


def _index(indices, n: int) -> np.ndarray:
    i_B = np.asarray(indices, dtype=np.int64).reshape(-1)
    if i_B.size and (i_B.min() < 0 or i_B.max() >= n):
        raise IndexError(f"sample index out of range [0, {n})")
    return i_B


class FieldSnapshots:
    """Single fields of a PDEBench file: the autoencoder's samples.

    1D tasks: every (row, kept time step) of ``indices`` is one sample u [1, X'].
    Darcy: the coefficient ``nu`` and the solution ``tensor`` of each row are two samples
    u [1, X', Y'] (k = 0 and 1), because the steady prior needs both encoded by the same
    encoder; ``field="tensor"`` or ``"nu"`` keeps only one of them.

    Args:
        path: PDEBench HDF5 file.
        indices: file rows (e.g. the train split).
        reduce_x, reduce_t: keep every reduce_x-th point per axis, every reduce_t-th step.
        field: ``"all"`` (default: 1D ``tensor``; Darcy ``nu`` and ``tensor``), ``"tensor"``
            or ``"nu"`` (Darcy only).
        task_id: written into every batch (position of the task in the config).
        in_memory_bytes: load everything once when the reduced selection is at most this big
            (None: `pipelines.memory.read_budget()`).
        task: what the file holds (`TaskConfig.spec`); None infers a generated task from the file.

    ``gather(i_B)`` -> TensorDict[B] {"u": [B, C, *S] float32, "sample_id": [B] int64,
    "task_id": [B] int64}.

    Reads: in memory (``nbytes <= in_memory_bytes``), one read at construction and a tensor
    index per batch. Otherwise one sorted h5py read per batch (per dataset for Darcy) of the
    batch's distinct rows, whole reduced trajectories for 1D (h5py takes one index list per
    read, so the steps are picked from them in memory): up to T' times the bytes the batch
    needs, which is why small files are loaded instead.
    """

    def __init__(self, path: str | os.PathLike, indices, *, reduce_x: int = 1, reduce_t: int = 1,
                 field: Literal["all", "tensor", "nu"] = "all", task_id: int = 0,
                 in_memory_bytes: int | None = IN_MEMORY_BYTES, task: TaskSpec | None = None):
        self.src = src = _H5Source(path, indices, reduce_x, reduce_t, task)
        if field not in ("all", "tensor", "nu"):
            raise ValueError(f"field must be 'all', 'tensor' or 'nu', got {field!r}")
        if field == "nu" and not src.steady:
            raise ValueError(f"field='nu' needs a steady (Darcy) file; {src.path} is {src.task_name}")
        self.task_name, self.task_id = src.task_name, int(task_id)
        if src.steady:
            self.keys = ("nu", "tensor") if field == "all" else (field,)
            self.per_row = len(self.keys)
        else:
            self.keys, self.per_row = ("tensor",), src.n_steps
        self.sample_shape = (src.channels, *src.spatial)
        self.nbytes = len(self) * 4 * math.prod(self.sample_shape)
        self.in_memory = self.nbytes <= (read_budget() if in_memory_bytes is None else in_memory_bytes)
        self._u = self._load_all() if self.in_memory and len(self) else None

    def __len__(self) -> int:
        return self.src.rows.size * self.per_row

    def _load_all(self) -> torch.Tensor:
        rows = self.src.rows
        parts = []
        for key in self.keys:
            data, pos = self.src.read_rows(key, rows)
            parts.append(data[pos])  # [n, k, C, *S]
        u = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        return torch.from_numpy(np.ascontiguousarray(u)).reshape(len(self), *self.sample_shape)

    def gather(self, indices) -> TensorDict:
        i_B = _index(indices, len(self))
        j_B, k_B = np.divmod(i_B, self.per_row)
        rows_B = self.src.rows[j_B]
        if self._u is not None:
            u = self._u[torch.from_numpy(i_B)]
        elif i_B.size == 0:
            u = torch.empty(0, *self.sample_shape)
        else:
            u_np = np.empty((i_B.size, *self.sample_shape), dtype=np.float32)
            for kk, key in enumerate(self.keys):  # Darcy: one read per dataset
                mask = k_B == kk if self.src.steady else np.ones(i_B.size, dtype=bool)
                if not mask.any():
                    continue
                data, pos = self.src.read_rows(key, rows_B[mask])  # [R, T', C, *S]
                u_np[mask] = data[pos, 0 if self.src.steady else k_B[mask]]
            u = torch.from_numpy(u_np)
        sample_id = self.task_id * SAMPLE_ID_STRIDE + rows_B * self.per_row + k_B
        return TensorDict({"u": u, "sample_id": torch.from_numpy(sample_id),
                           "task_id": torch.full((i_B.size,), self.task_id, dtype=torch.int64)},
                          batch_size=[i_B.size])

    __getitem__ = gather


class FieldTrajectoryPairs:
    """(u_t, u_{t+h}) field pairs read from HDF5 on every batch (no cache, no in-memory copy).

    1D: index ``j * (T' - h) + t`` (j: position in ``indices``); dt = h * the kept step
    spacing. Darcy: one pair per row, (coefficient, solution) with dt = 1 and t = 0, as in
    the steady latent cache. ``gather(i_B)`` -> TensorDict[B] {"u_t", "u_next": [B, C, *S],
    "dt": [B] float32, "t": [B] int64, "task_id", "sample_id" (``task_id * 10**9 + row``)}.
    """

    def __init__(self, path: str | os.PathLike, indices, *, reduce_x: int = 1, reduce_t: int = 1,
                 horizon: int = 1, task_id: int = 0, task: TaskSpec | None = None):
        self.src = src = _H5Source(path, indices, reduce_x, reduce_t, task)
        self.task_name, self.task_id = src.task_name, int(task_id)
        if src.steady:
            if horizon != 1:
                warnings.warn(f"{src.path}: horizon={horizon} ignored for the steady task (one pair per row)")
            self.horizon, self.pairs_per_row = 1, 1
        else:
            if not 1 <= horizon < src.n_steps:
                raise ValueError(f"horizon must be in [1, {src.n_steps}) (kept steps of {src.path}), "
                                 f"got {horizon}")
            self.horizon, self.pairs_per_row = horizon, src.n_steps - horizon

    def __len__(self) -> int:
        return self.src.rows.size * self.pairs_per_row

    def gather(self, indices) -> TensorDict:
        i_B = _index(indices, len(self))
        j_B, t_B = np.divmod(i_B, self.pairs_per_row)
        rows_B = self.src.rows[j_B]
        n, shape = i_B.size, (i_B.size, self.src.channels, *self.src.spatial)
        if n == 0:
            u_t, u_next = np.empty(shape, np.float32), np.empty(shape, np.float32)
        elif self.src.steady:
            nu, pos = self.src.read_rows("nu", rows_B)
            sol, pos2 = self.src.read_rows("tensor", rows_B)
            u_t, u_next = nu[pos, 0], sol[pos2, 0]
        else:
            traj, pos = self.src.read_rows("tensor", rows_B)  # [R, T', C, *S]
            u_t, u_next = traj[pos, t_B], traj[pos, t_B + self.horizon]
        dt = self.src.dt * self.horizon
        return TensorDict({
            "u_t": torch.from_numpy(np.ascontiguousarray(u_t)),
            "u_next": torch.from_numpy(np.ascontiguousarray(u_next)),
            "dt": torch.full((n,), dt, dtype=torch.float32),
            "t": torch.from_numpy(t_B),
            "task_id": torch.full((n,), self.task_id, dtype=torch.int64),
            "sample_id": torch.from_numpy(self.task_id * SAMPLE_ID_STRIDE + rows_B),
        }, batch_size=[n])

    __getitem__ = gather


class ConcatFields:
    """Datasets of several tasks under global indices (task k owns ``offset_k ..``).

    ``gather`` routes a batch to its task's dataset; a batch must hold one task only
    (``TaskAlternatingBatchSampler`` guarantees it), since 1D and 2D fields cannot stack.
    """

    def __init__(self, datasets: Sequence[Any]):
        if not datasets:
            raise ValueError("ConcatFields needs at least one dataset")
        self.datasets = list(datasets)
        self.sizes = [len(d) for d in self.datasets]
        self.offsets = np.cumsum([0, *self.sizes])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def task_sizes(self) -> dict[str, int]:
        """``{"<k>:<task name>": size}`` in global index order (feeds the batch sampler)."""
        return {f"{k}:{getattr(d, 'task_name', 'task')}": s
                for k, (d, s) in enumerate(zip(self.datasets, self.sizes))}

    def gather(self, indices) -> TensorDict:
        i_B = _index(indices, len(self))
        if i_B.size == 0:
            return self.datasets[0].gather([])
        k = int(np.searchsorted(self.offsets, i_B[0], side="right")) - 1
        lo, hi = self.offsets[k], self.offsets[k + 1]
        if i_B.min() < lo or i_B.max() >= hi:
            raise ValueError(f"a batch must hold one task; indices span beyond task {k} [{lo}, {hi})")
        return self.datasets[k].gather(i_B - lo)

    __getitem__ = gather


class TaskAlternatingBatchSampler:
    """Per-rank single-task batches; at every step all ranks use the same task.

    Per epoch, each task's indices are permuted (``torch.Generator().manual_seed(seed +
    epoch)``, the same on every rank), cut to a multiple of ``world_size`` and sharded
    strided (rank r takes positions r, r + W, ...: disjoint shards), then grouped into
    full batches of ``batch_size_per_rank`` (short tails dropped). Task k thus has
    ``n_k = size_k // W // batch_size_per_rank`` batches on every rank. Steps go round the
    tasks in order, skipping tasks whose batches are used up, so the task schedule
    depends only on the sizes, W and the batch size: identical on every rank, and every
    rank yields the same ``len = sum_k n_k`` batches (one pass over each task).

    Indices are global: task k owns ``offset_k .. offset_k + size_k - 1`` (tasks
    concatenated in the given order, as in ``ConcatFields``).
    """

    def __init__(self, task_sizes: Mapping[str, int], *, batch_size_per_rank: int, rank: int,
                 world_size: int, seed: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if batch_size_per_rank < 1:
            raise ValueError(f"batch_size_per_rank must be >= 1, got {batch_size_per_rank}")
        self.task_names = list(task_sizes)
        self.task_sizes = [int(task_sizes[k]) for k in self.task_names]
        if not self.task_sizes or min(self.task_sizes) < 0:
            raise ValueError(f"task_sizes must name tasks with sizes >= 0, got {dict(task_sizes)}")
        self.offsets = [sum(self.task_sizes[:k]) for k in range(len(self.task_sizes))]
        self.batch_size, self.rank, self.world_size, self.seed = batch_size_per_rank, rank, world_size, seed
        self.epoch = 0
        self.batches_per_task = [s // world_size // batch_size_per_rank for s in self.task_sizes]
        if sum(self.batches_per_task) == 0:
            raise ValueError(f"no task has {world_size * batch_size_per_rank} samples for one batch per "
                             f"rank (batch_size_per_rank={batch_size_per_rank}, world_size={world_size}); "
                             f"task sizes: {dict(task_sizes)}")
        empty = [n for n, b in zip(self.task_names, self.batches_per_task) if b == 0]
        if empty:
            warnings.warn(f"tasks {empty} are too small for one batch per rank and are not sampled")
        self.schedule = self._schedule()

    def _schedule(self) -> list[int]:
        left, out = list(self.batches_per_task), []
        while any(left):
            for k in range(len(left)):
                if left[k]:
                    out.append(k)
                    left[k] -= 1
        return out

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.schedule)

    def task_at(self, step: int) -> int:
        """Task position of batch ``step`` (the same on every rank)."""
        return self.schedule[step]

    def __iter__(self) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed(int(self.seed) + self.epoch)
        shards = []
        for size, n_batches, offset in zip(self.task_sizes, self.batches_per_task, self.offsets):
            perm = torch.randperm(size, generator=g)  # drawn for every task: fixed generator use
            keep = n_batches * self.batch_size * self.world_size
            shards.append((perm[:keep][self.rank :: self.world_size] + offset).tolist())
        pos = [0] * len(shards)
        for k in self.schedule:
            yield shards[k][pos[k] : pos[k] + self.batch_size]
            pos[k] += self.batch_size


def build_field_loader(datasets: Sequence[Any] | Mapping[str, Any], *, rank: int, world_size: int,
                       batch_size_per_rank: int, seed: int, num_workers: int, prefetch_factor: int,
                       pin_memory: bool) -> StatefulLoader:
    """Single-task field batches of ``datasets`` (one per task, in task order) for this rank.

    Returns the StatefulLoader of ``build_loader`` over ``ConcatFields(datasets)`` driven by
    a ``TaskAlternatingBatchSampler``; the sampler is reachable as ``loader.batch_sampler``.
    """
    ds = list(datasets.values()) if isinstance(datasets, Mapping) else list(datasets)
    concat = ConcatFields(ds)
    sampler = TaskAlternatingBatchSampler(concat.task_sizes, batch_size_per_rank=batch_size_per_rank,
                                          rank=rank, world_size=world_size, seed=seed)
    loader = build_loader(concat, sampler, num_workers=num_workers, prefetch_factor=prefetch_factor,
                          pin_memory=pin_memory)
    loader.batch_sampler = sampler
    return loader
