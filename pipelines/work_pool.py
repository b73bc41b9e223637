"""Jobs run in worker processes, results in job order, memory bounded: the generators' pool."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from itertools import islice

__all__ = ["run_in_workers"]


def _init_worker() -> None:
    # Each worker computes on one core; W workers with full torch thread pools would oversubscribe.
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def run_in_workers(fn: Callable, jobs: Iterable[tuple], workers: int) -> Iterator:
    """Results of ``fn(*job)`` in job order, at most ``2 * workers`` jobs in flight (`workers` = 1:
    in this process). `fn` must be picklable (a module-level function or a frozen dataclass)."""
    if workers == 1:
        yield from (fn(*job) for job in jobs)
        return
    # spawn, not fork: the parent may hold torch thread pools that a fork would copy half-locked.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker)
    try:
        it = iter(jobs)
        pending = deque(pool.submit(fn, *job) for job in list(islice(it, 2 * workers)))
        while pending:
            result = pending.popleft().result()
            job = next(it, None)
            if job is not None:
                pending.append(pool.submit(fn, *job))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
