"""Jobs run in worker processes, results in job order, memory bounded: the generators' pool.

Every job runs in a spawned worker, one worker included, so that the worker's MKL is pinned to
`MKL_INSTRUCTIONS`: MKL picks its FFT and BLAS code by the CPU's vendor and instruction sets, and the
last bits of a solver's FFTs followed (the ns2d race file: the same bytes on AMD Zen 1 and Zen 4, other
bytes on an Intel Xeon until pinned; bench/results/cpu-2core-2026-12-05-generation-intel.md). The pin
stays in the workers: the parent process, which may train next, keeps MKL's fastest code.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from itertools import islice

__all__ = ["run_in_workers", "MKL_INSTRUCTIONS"]

MKL_INSTRUCTIONS = "SSE4_2"
"""MKL's instruction set in every worker (`MKL_ENABLE_INSTRUCTIONS`): the code MKL runs on AMD CPUs
whatever they support, so an Intel CPU computes what they compute."""


@contextlib.contextmanager
def _spawning(fn: Callable) -> Iterator[None]:
    """This process as its workers should see it when they start, restored after: MKL pinned in the
    environment, and the main module hidden unless ``fn`` is its own.

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
    by_name = getattr(main.get("__spec__"), "name", None) is not None
    own = "__main__" in {getattr(fn, "__module__", None), type(fn).__module__}
    hidden = {}
    if not (own and by_name):
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


def _init_worker(threads: int | None) -> None:
    if threads is None:
        return
    # torch's FFT rounds differently at other thread counts: a lone worker keeps its parent's count,
    # W workers take one core each (full thread pools would oversubscribe).
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def run_in_workers(fn: Callable, jobs: Iterable[tuple], workers: int) -> Iterator:
    """Results of ``fn(*job)`` in job order, computed in `workers` spawned processes (1: one process
    at this process's torch thread count; more: one thread each), at most ``2 * workers`` jobs in
    flight. `fn` must be picklable (a module-level function or a frozen dataclass) and, when the main
    module is a script, not defined in it: the workers do not run a script again."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1:
        threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
    else:
        threads = 1
    # spawn, not fork: the parent may hold torch thread pools that a fork would copy half-locked.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                               initargs=(threads,))
    try:
        it = iter(jobs)
        # The pool spawns a worker per submission until it has `workers` (and never replaces one): all
        # of them start within the first 2 * workers submissions, inside `_spawning`.
        with _spawning(fn):
            pending = deque(pool.submit(fn, *job) for job in list(islice(it, 2 * workers)))
        while pending:
            result = pending.popleft().result()
            job = next(it, None)
            if job is not None:
                pending.append(pool.submit(fn, *job))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
