"""The one place that builds a ``torchdata.nodes`` graph (nothing else imports torchdata).

    batch sampler (lists of indices) -> SamplerWrapper
      -> ParallelMapper(method="thread"): dataset.gather(indices) -> TensorDict[B]
      -> PinMemory (only when asked and CUDA is available)
      -> Prefetcher(prefetch_factor)
      -> Loader

Threads, not processes: the gather is a few fancy indexes into a memory-mapped cache
(numpy/torch release the GIL while copying), so thread workers share one mapping of the
cache with the main thread; process workers would each need their own.

``SamplerWrapper`` is torchdata's ``IterableWrapper`` plus an epoch: it calls
``sampler.set_epoch`` on every reset and stores the epoch and the number of index lists
handed out in its state. Every node snapshots its state per item (snapshot_frequency=1),
so ``state_dict()`` taken after k batches restores, in a new process, to batch k + 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import weakref

import torch
from torchdata.nodes import Loader, ParallelMapper, PinMemory, Prefetcher, SamplerWrapper
from torchdata.nodes.loader import LoaderIterator

__all__ = ["build_loader", "StatefulLoader"]


class _BatchSampler(Protocol):
    def __iter__(self) -> Iterator[list[int]]: ...
    def __len__(self) -> int: ...
    def set_epoch(self, epoch: int) -> None: ...


class _Gather:
    """Map function of the ParallelMapper: one batch of indices -> one batch."""

    def __init__(self, dataset: Any, collate: Callable[[Any], Any] | None):
        self.dataset, self.collate = dataset, collate

    def __call__(self, indices: list[int]) -> Any:
        if hasattr(self.dataset, "gather"):
            batch = self.dataset.gather(indices)
        else:  # a plain map-style dataset: per-item reads, then collate
            batch = [self.dataset[i] for i in indices]
        return self.collate(batch) if self.collate is not None else batch


# torchdata internals. torchdata is in maintenance and its nodes have no public way to stop their
# threads or to read how many batches a Loader state has yielded; these two functions are the only
# code that touches its private attributes (version bounded in pyproject.toml to what is tested;
# tests/test_loader.py::test_torchdata_internals_are_where_the_loader_expects fails if they move).


def shutdown_graph(root: Any) -> int:
    """Stops and joins the worker threads of every node below ``root``, outermost first; returns
    how many running iterators it stopped.

    torchdata only stops them in ``__del__``; daemon threads still inside a torch op at
    interpreter exit abort the process ("terminate called without an active exception"),
    so a loader abandoned mid-epoch must be closed (done at exit by a weakref.finalize).
    Internals: each node's running iterator ``node._it`` and its ``_shutdown()``.
    """
    todo, seen, stopped = [root], set(), 0
    while todo:
        node = todo.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        it = getattr(node, "_it", None)
        if hasattr(it, "_shutdown"):
            it._shutdown()
            stopped += 1
        todo += [it, getattr(node, "source", None)]
    return stopped


def batches_yielded(loader_state: dict[str, Any]) -> int:
    """Batches a ``Loader.state_dict()`` has yielded in its epoch (internal key of LoaderIterator)."""
    return int(loader_state[LoaderIterator.NUM_YIELDED_KEY])


class StatefulLoader:
    """Iterable over one epoch of batches with ``state_dict``/``load_state_dict``/``set_epoch``.

    Typical use::

        loader.load_state_dict(ckpt["loader"])        # optional, on resume
        for epoch in range(ckpt_epoch, n_epochs):
            loader.set_epoch(epoch)
            for batch in loader: ...

    ``state_dict()`` holds the epoch and the number of batches already yielded. After
    ``load_state_dict(sd)`` the next ``iter()`` continues ``sd``'s epoch right after its
    last yielded batch; if that epoch was already finished, the loader stands at the start
    of the next one (``epoch`` is ``sd``'s epoch + 1), where an uninterrupted run would
    go on. A later ``set_epoch`` still chooses another epoch. Resuming an unfinished epoch
    under another epoch number is an error (it would silently mix two shuffles).
    """

    EPOCH_KEY, YIELDED_KEY, NODES_KEY = "epoch", "batches_yielded", "nodes"

    def __init__(self, sampler_node: SamplerWrapper, loader: Loader, n_batches: int):
        self._sampler_node, self._loader, self._n_batches = sampler_node, loader, n_batches
        self._epoch = 0
        self._pending: dict[str, Any] | None = None
        self._iterated = False
        self._finalizer = weakref.finalize(self, shutdown_graph, loader.root)

    def close(self) -> int:
        """Stops the worker threads (also run at exit); the loader can be iterated again. Returns
        how many running iterators were stopped."""
        return shutdown_graph(self._loader.root)

    def __enter__(self) -> "StatefulLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_epoch(self, epoch: int) -> None:
        self._epoch = int(epoch)

    @property
    def epoch(self) -> int:
        return self._epoch

    def __len__(self) -> int:
        return self._n_batches

    def __iter__(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        if pending is not None and pending[self.NODES_KEY] is not None \
                and pending[self.YIELDED_KEY] < self._n_batches:
            if pending[self.EPOCH_KEY] != self._epoch:
                self._pending = pending  # kept, so set_epoch(saved epoch) can still resume
                raise ValueError(f"loader state is mid-epoch {pending[self.EPOCH_KEY]} "
                                 f"but set_epoch({self._epoch}) was called; resume that epoch first")
            self._loader.load_state_dict(pending[self.NODES_KEY])
        else:
            # SamplerWrapper reads .epoch on a reset before its first item and calls the
            # epoch_updater (which returns self._epoch) on later resets.
            self._sampler_node.epoch = self._epoch
        self._iterated = True
        return iter(self._loader)

    def state_dict(self) -> dict[str, Any]:
        if not self._iterated:
            return {self.EPOCH_KEY: self._epoch, self.YIELDED_KEY: 0, self.NODES_KEY: None}
        nodes = self._loader.state_dict()
        return {self.EPOCH_KEY: self._sampler_node.epoch,
                self.YIELDED_KEY: batches_yielded(nodes), self.NODES_KEY: nodes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Position the loader where ``state_dict`` was taken (see the class docstring)."""
        finished = state_dict[self.NODES_KEY] is not None and state_dict[self.YIELDED_KEY] >= self._n_batches
        # A state taken right after an epoch's last batch is the start of the next epoch:
        # replaying the finished one (as a restart at its number would) repeats its batches.
        self._pending = None if finished else state_dict
        self._epoch = int(state_dict[self.EPOCH_KEY]) + int(finished)


def build_loader(dataset: Any, batch_sampler: _BatchSampler, *, num_workers: int,
                 prefetch_factor: int, pin_memory: bool,
                 collate: Callable[[Any], Any] | None = None) -> StatefulLoader:
    """Builds the batch pipeline over ``dataset`` driven by ``batch_sampler``.

    Args:
        dataset: has ``gather(indices) -> TensorDict[B]`` (LatentPairs, LatentTrajectories),
            or is a map-style dataset whose items ``collate`` turns into a batch.
        batch_sampler: yields this rank's lists of indices; has ``set_epoch`` and ``len``.
        num_workers: gather threads (0: gather inline in the main thread).
        prefetch_factor: batches kept ready ahead of the consumer (>= 1).
        pin_memory: pin batches (only when CUDA is available; otherwise ignored).
        collate: optional function applied to each gathered batch.

    Returns:
        A StatefulLoader (``__iter__``, ``__len__``, ``set_epoch``, ``state_dict``,
        ``load_state_dict``).
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if prefetch_factor < 1:
        raise ValueError(f"prefetch_factor must be >= 1, got {prefetch_factor}")
    sampler_node = SamplerWrapper(batch_sampler, initial_epoch=0)
    node = ParallelMapper(sampler_node, _Gather(dataset, collate), num_workers=num_workers,
                          in_order=True, method="thread")
    if pin_memory and torch.cuda.is_available():
        node = PinMemory(node)
    node = Prefetcher(node, prefetch_factor=prefetch_factor)
    loader = Loader(node, restart_on_stop_iteration=True)
    out = StatefulLoader(sampler_node, loader, len(batch_sampler))
    # the epoch is whatever set_epoch stored, never auto-incremented by torchdata
    sampler_node.epoch_updater = lambda _old: out.epoch
    return out
