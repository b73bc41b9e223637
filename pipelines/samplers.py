"""Index samplers for one process of a (possibly distributed) job.

Rank and world size are plain integers handed in by the entry layer; nothing here imports
``torch.distributed``. Randomness comes only from ``torch.Generator`` objects seeded by
``seed + epoch`` (never the global RNG), so every rank computes the same global order and
takes its own part of it, and ``set_epoch(e)`` reshuffles deterministically.

- ``DistributedIndexSampler``: one index at a time, disjoint shards (torch's
  ``DistributedSampler`` contract, without the process group).
- ``BatchSampler``: groups an index sampler's shard into per-rank batches.
- ``MultiTaskBatchSampler``: per-rank batches whose GLOBAL union holds a fixed task mix.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Literal

import torch

__all__ = ["DistributedIndexSampler", "BatchSampler", "MultiTaskBatchSampler", "largest_remainder"]


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def _generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) + int(epoch))


class DistributedIndexSampler:
    """Yields this rank's indices of ``range(n)`` for the current epoch.

    The global order (a permutation when ``shuffle``) is cut into ``world_size`` strided
    shards: rank r gets positions r, r + W, r + 2W, ... Shards are disjoint and their union
    is the dataset, except:

    - ``drop_last=False`` and ``n % world_size != 0``: the order is padded by wrapping
      around to its start (repeating its first ``pad`` entries; cycling again when
      ``n < world_size``), so that every rank gets ``ceil(n / W)`` indices. Those padded
      indices are the only duplicates across ranks.
    - ``drop_last=True``: the last ``n % W`` entries of the order are dropped, every rank
      gets ``n // W`` indices (a different tail is dropped each epoch when shuffling).

    Args:
        n: dataset size (>= 0).
        rank, world_size: this process's place in the job.
        seed: base seed; the epoch's order uses ``torch.Generator().manual_seed(seed + epoch)``.
        shuffle: permute the order each epoch; otherwise ``0..n-1``.
        drop_last: see above.
    """

    def __init__(self, n: int, *, rank: int, world_size: int, seed: int,
                 shuffle: bool = True, drop_last: bool = False):
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        _check_rank(rank, world_size)
        self.n, self.rank, self.world_size = n, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        if drop_last or n == 0:
            self.num_samples = n // world_size
        else:
            self.num_samples = -(-n // world_size)
        self.total_size = self.num_samples * world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _global_order(self) -> torch.Tensor:
        if self.shuffle:
            order = torch.randperm(self.n, generator=_generator(self.seed, self.epoch))
        else:
            order = torch.arange(self.n)
        if self.total_size > self.n:  # wrap padding, cycling when n < world_size
            reps = -(-self.total_size // self.n)
            order = order.repeat(reps)
        return order[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._global_order()[self.rank :: self.world_size].tolist())

    def __len__(self) -> int:
        return self.num_samples


class BatchSampler:
    """Groups an index sampler's indices into lists of ``batch_size`` (per rank).

    ``set_epoch`` is forwarded. With ``drop_last`` the final short batch is dropped; since
    every rank's shard has the same length, every rank gets the same number of batches.
    """

    def __init__(self, sampler: DistributedIndexSampler, batch_size: int, *, drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        idx = list(self.sampler)
        stop = len(self) * self.batch_size
        for i in range(0, min(stop, len(idx)), self.batch_size):
            yield idx[i : i + self.batch_size]

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


def largest_remainder(weights: Sequence[int], total: int, *, rotate: int = 0) -> list[int]:
    """Integer counts summing to ``total``, each within one of ``total * w / sum(w)``.

    Hamilton's method in exact integer arithmetic (float quotas would turn true ties into
    arbitrary winners): floor every quota, then hand the leftover units to the largest
    remainders. Ties are broken by task order rotated by ``rotate``, so under tied
    remainders the extra samples go round the tasks step by step instead of always to the
    first task.
    """
    wsum = sum(weights)
    if wsum <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    counts = [total * w // wsum for w in weights]
    rems = [total * w % wsum for w in weights]
    k = len(weights)
    order = sorted(range(k), key=lambda i: (-rems[i], (i - rotate) % k))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def quota_sequence(weights: Sequence[int]) -> list[list[int]]:
    """Cumulative counts ``A[n][k]`` of the first ``n`` units (n = 0 .. sum w) shared among tasks of
    integer ``weights`` by Balinski and Young's quota method: unit n + 1 goes to the task of
    largest ``w_k / (A_k + 1)`` among those still under their upper quota (``A_k < (n + 1) w_k / W``).
    Every prefix keeps within one unit of its exact share (``|A_k - n w_k / W| < 1``) and no task's
    count ever falls as n grows, so the units between two prefixes are never negative; at n = W
    every task has exactly w_k, and the sequence repeats. Ties go to the first task."""
    total = sum(weights)
    counts, out = [0] * len(weights), [[0] * len(weights)]
    for n in range(total):
        best = None
        for k, w in enumerate(weights):
            # eligible: one more unit keeps task k within its upper quota; priority w / (A + 1), exactly
            if counts[k] * total < (n + 1) * w and (
                    best is None or w * (counts[best] + 1) > weights[best] * (counts[k] + 1)):
                best = k
        counts[best] += 1
        out.append(list(counts))
    return out


class MultiTaskBatchSampler:
    """Per-rank batches of global dataset indices with a fixed task mix per GLOBAL batch.

    Tasks are concatenated in the given order: task k owns global indices
    ``offset_k .. offset_k + size_k - 1``. Each step draws one global batch of
    ``global_batch`` indices with per-task counts from :meth:`step_counts` (each count within
    one sample of the intended share, two under unequal weights), shuffles it, and gives rank r the
    contiguous slice ``[r * b, (r + 1) * b)`` with ``b = global_batch / world_size``.
    All ranks compute the same global batch (same generator), so their slices are
    disjoint within a step and every rank yields the same number of batches.

    Strategies (weights of the mix):
      - ``"balanced"``: equal weights, or the positive integer ``weights`` given (task k's share
        of every global batch is w_k / sum w); every task needs at least one sample.
      - ``"proportional"``: weights proportional to task sizes.

    Epoch length rule (steps per epoch, identical on every rank):
      ``M = max_k size_k / (w_k / sum w)`` samples (rounded up), i.e. enough for the task that is
      the most "under-sampled" relative to its share to be seen once. Proportional: ``M`` is the
      dataset size (one pass). Balanced with equal weights: ``M = K * max_k size_k`` (the largest
      task once, smaller tasks cycled). Steps are ``floor(M / global_batch)`` with ``drop_last``
      (default), ``ceil`` otherwise; every step is a full global batch either way.

    Each task is drawn from an endless stream of fresh permutations of its indices
    (without replacement within a pass, reshuffled for every further pass), so smaller
    tasks are cycled and, because of rounding, a task may get a few samples more than one
    pass (repeated) or fewer (its tail unseen this epoch).
    """

    def __init__(self, task_sizes: Mapping[str, int] | Sequence[int], *, global_batch: int,
                 rank: int, world_size: int,
                 strategy: Literal["balanced", "proportional"], seed: int, drop_last: bool = True,
                 weights: Sequence[int] | None = None):
        _check_rank(rank, world_size)
        if isinstance(task_sizes, Mapping):
            names, sizes = list(task_sizes.keys()), [int(v) for v in task_sizes.values()]
        else:
            sizes = [int(v) for v in task_sizes]
            names = [str(i) for i in range(len(sizes))]
        if not sizes:
            raise ValueError("task_sizes must name at least one task")
        if any(s < 0 for s in sizes):
            raise ValueError(f"task_sizes must be >= 0, got {dict(zip(names, sizes))}")
        if strategy not in ("balanced", "proportional"):
            raise ValueError(f"strategy must be 'balanced' or 'proportional', got {strategy!r}")
        if strategy == "balanced" and min(sizes) == 0:
            empty = [n for n, s in zip(names, sizes) if s == 0]
            raise ValueError(f"strategy 'balanced' needs every task non-empty; empty: {empty}")
        if sum(sizes) == 0:
            raise ValueError("task_sizes are all zero")
        if weights is not None and (strategy != "balanced" or len(weights) != len(sizes)
                                    or any(int(w) != w or w < 1 for w in weights)):
            raise ValueError(f"weights must be {len(sizes)} positive integers, one per task, with strategy "
                             f"'balanced'; got {list(weights)} with {strategy!r}")
        if global_batch < 1 or global_batch % world_size:
            raise ValueError(f"global_batch ({global_batch}) must be a positive multiple of "
                             f"world_size ({world_size})")
        self.task_names, self.task_sizes = names, sizes
        self.offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        self.global_batch, self.local_batch = global_batch, global_batch // world_size
        self.rank, self.world_size = rank, world_size
        self.strategy, self.seed, self.drop_last = strategy, seed, drop_last
        self.epoch = 0
        if strategy == "proportional":
            self.weights = list(sizes)
        else:
            self.weights = [int(w) for w in weights] if weights is not None else [1] * len(sizes)
        # M = max_k size_k / (w_k / sum_j w_j), rounded up (an integer already unless weights are given).
        total = sum(self.weights)
        m = max(-(-size * total // w) for size, w in zip(sizes, self.weights) if w)
        self.samples_per_epoch = m
        self.num_batches = m // global_batch if drop_last else -(-m // global_batch)
        # Balanced: the units of global batch s are those between prefixes s B and (s + 1) B of the
        # quota sequence, so every task gets its share of every prefix of the epoch, not only of
        # every batch (a per-batch largest remainder hands the leftover units by its own rotation,
        # which can give one task two extra units before another has had one).
        self._quota = quota_sequence(self.weights) if strategy == "balanced" else None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_batches

    def step_counts(self, step: int) -> list[int]:
        """Per-task counts of global batch ``step``: proportional, the largest remainder rotated by
        step (within one sample of the share; period K); balanced, the quota sequence's units of
        this batch (within one sample of the share for equal weights, two for unequal ones; the
        epoch's running total within one)."""
        if self._quota is None:
            return largest_remainder(self.weights, self.global_batch, rotate=step)
        total = len(self._quota) - 1

        def prefix(n: int) -> list[int]:
            return [(n // total) * w + a for w, a in zip(self.weights, self._quota[n % total])]

        lo, hi = prefix(step * self.global_batch), prefix((step + 1) * self.global_batch)
        return [b - a for a, b in zip(lo, hi)]

    def global_batches(self) -> Iterator[torch.Tensor]:
        """The epoch's global batches (int64 tensors of ``global_batch`` indices)."""
        g = _generator(self.seed, self.epoch)
        k_tasks = len(self.task_sizes)
        period = k_tasks if self._quota is None else self.num_batches  # step_counts repeats with this period
        counts = [self.step_counts(s) for s in range(min(period, self.num_batches))]
        need = [sum(counts[s % period][k] for s in range(self.num_batches)) for k in range(k_tasks)]
        streams = []
        for k, (size, n_k) in enumerate(zip(self.task_sizes, need)):
            passes = -(-n_k // size) if size else 0
            parts = [torch.randperm(size, generator=g) for _ in range(passes)]
            stream = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
            streams.append(stream[:n_k] + self.offsets[k])
        pos = [0] * k_tasks
        for s in range(self.num_batches):
            parts = []
            for k, c in enumerate(counts[s % period]):
                parts.append(streams[k][pos[k] : pos[k] + c])
                pos[k] += c
            batch = torch.cat(parts)
            yield batch[torch.randperm(self.global_batch, generator=g)]

    def __iter__(self) -> Iterator[list[int]]:
        lo = self.rank * self.local_batch
        for batch in self.global_batches():
            yield batch[lo : lo + self.local_batch].tolist()

    def task_of(self, index: int) -> int:
        """Task position of a global index (for tests and logging)."""
        for k in reversed(range(len(self.offsets))):
            if index >= self.offsets[k]:
                return k
        raise IndexError(index)
