"""Jobs run in worker processes, results in job order, memory bounded: the generators' pool.

Every job runs in a spawned worker, one worker included, so that the worker's MKL is pinned to
`MKL_INSTRUCTIONS`: MKL picks its FFT and BLAS code by the CPU's vendor and instruction sets, and the
last bits of a solver's FFTs followed (the ns2d race file: the same bytes on AMD Zen 1 and Zen 4, other
bytes on an Intel Xeon until pinned; bench/results/cpu-2core-2026-12-05-generation-intel.md). The pin
stays in the workers: the parent process, which may train next, keeps MKL's fastest code.

A process keeps its workers from one call to the next (a worker's start-up, torch's import, is 1.5 s
of CPU on a 2-core machine: once per process, not once per generated file) until `close_workers`,
which a command calls before it trains, or until it exits.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import islice

__all__ = ["run_in_workers", "close_workers", "MKL_INSTRUCTIONS"]

MKL_INSTRUCTIONS = "SSE4_2"
"""MKL's instruction set in every worker (`MKL_ENABLE_INSTRUCTIONS`): the code MKL runs on AMD CPUs
whatever they support, so an Intel CPU computes what they compute."""


@contextlib.contextmanager
def _spawning(with_main: bool) -> Iterator[None]:
    """This process as its workers should see it when they start, restored after: MKL pinned in the
    environment, and the main module hidden unless `with_main`.

    MKL reads `MKL_ENABLE_INSTRUCTIONS` once, at its first call, and a worker may import modules that
    call MKL before any initializer runs: the pin must be in the environment the worker starts with.
    A worker imports its parent's main module first when it can find it; only a job of the main
    module (``python -m pipelines.generate``'s are its own functions, named ``__main__`` there) needs
    it, re-imported by name. Otherwise the main module is hidden: a stage command's imports (torch's
    compiler among them, through tensordict: 1.5 s on a 2-core machine) would be paid again by every
    worker of every generated file, and a script run again would repeat a user's unguarded calls, or
    fail for ``python -`` (no file to run).
    """
    before = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
    main = sys.modules["__main__"].__dict__
    hidden = {}
    if not with_main:
        hidden = {key: main[key] for key in ("__spec__", "__file__") if key in main}
        main.pop("__file__", None)
        main["__spec__"] = None  # multiprocessing reads the attribute unguarded
    os.environ["MKL_ENABLE_INSTRUCTIONS"] = MKL_INSTRUCTIONS
    try:
        yield
    finally:
        if before is None:
            del os.environ["MKL_ENABLE_INSTRUCTIONS"]
        else:
            os.environ["MKL_ENABLE_INSTRUCTIONS"] = before
        main.update(hidden)


def _needs_main(fn: Callable) -> bool:
    """Whether `fn` is the main module's own (a function or a callable's class defined there) and the
    main module was run by name (`python -m`), so a worker can import it again."""
    by_name = getattr(sys.modules["__main__"].__dict__.get("__spec__"), "name", None) is not None
    return by_name and "__main__" in {getattr(fn, "__module__", None), type(fn).__module__}


def _init_worker(threads: int | None) -> None:
    if threads is None:
        return
    # torch's FFT rounds differently at other thread counts: a lone worker keeps its parent's count,
    # W workers take one core each (full thread pools would oversubscribe).
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


class _Pool:
    """This process's workers: `workers` of them at `threads` torch threads each (None: the default),
    the main module imported in them when `with_main`."""

    def __init__(self, workers: int, threads: int | None, with_main: bool):
        self.owner, self.workers, self.threads, self.with_main = os.getpid(), workers, threads, with_main
        # spawn, not fork: the parent may hold torch thread pools that a fork would copy half-locked.
        self.executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init_worker, initargs=(threads,))

    def serves(self, workers: int, threads: int | None, needs_main: bool) -> bool:
        return ((self.owner, self.workers, self.threads) == (os.getpid(), workers, threads)
                and (self.with_main or not needs_main))


_pool: _Pool | None = None


def close_workers() -> None:
    """Stop this process's workers, after the jobs they are running; the next `run_in_workers` starts
    new ones. A command that generated data calls it before it trains: idle workers hold memory."""
    global _pool
    pool, _pool = _pool, None
    if pool is not None and pool.owner == os.getpid():  # a forked child's copy is its parent's to stop
        pool.executor.shutdown(wait=True, cancel_futures=True)


def _workers_for(fn: Callable, workers: int, threads: int | None) -> _Pool:
    """This process's pool when it can run `fn` at this shape, else a new one in its place (a call
    still reading the old one's results fails)."""
    global _pool
    needs_main = _needs_main(fn)
    if _pool is None or not _pool.serves(workers, threads, needs_main):
        close_workers()
        _pool = _Pool(workers, threads, needs_main)
    return _pool


def run_in_workers(fn: Callable, jobs: Iterable[tuple], workers: int) -> Iterator:
    """Results of ``fn(*job)`` in job order, computed in `workers` spawned processes (1: one process
    at this process's torch thread count; more: one thread each), at most ``2 * workers`` jobs in
    flight. `fn` must be picklable (a module-level function or a frozen dataclass) and, when the main
    module is a script, not defined in it: the workers do not run a script again. The workers stay
    for the next call (`close_workers`)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1:
        threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
    else:
        threads = 1
    pool = _workers_for(fn, workers, threads)
    it = iter(jobs)
    pending = deque()
    try:
        # A pool spawns a worker at a submission that finds none idle, until it has `workers`: every
        # submission is made as the workers should start (`_spawning`).
        with _spawning(pool.with_main):
            pending.extend(pool.executor.submit(fn, *job) for job in list(islice(it, 2 * workers)))
        while pending:
            result = pending.popleft().result()
            job = next(it, None)
            if job is not None:
                with _spawning(pool.with_main):
                    pending.append(pool.executor.submit(fn, *job))
            yield result
    except BrokenProcessPool:
        close_workers()  # a worker died: the next call starts new ones
        raise
    finally:
        for future in pending:  # a caller that stopped early: its queued jobs are not run
            future.cancel()
