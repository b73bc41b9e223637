"""The generators' worker pool: results in job order, the parent's thread count in a lone worker, and
MKL pinned in every worker as in a process started pinned, so a file is the same bytes on Intel and
AMD CPUs (bench/results/cpu-2core-2026-12-05-generation-intel.md)."""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import os
import signal
import subprocess
import sys

import pytest
import torch

from pipelines.work_pool import MKL_INSTRUCTIONS, close_workers, run_in_workers
from tests import tiny_run as tr

def fft_hash() -> str:
    """sha256 of a float64 round trip through torch's FFT at 64^2, as the flow solvers take, at 1
    thread: MKL's AVX-512 code rounds it otherwise than its SSE4.2 code (an Intel Xeon, 2026-12-05)."""
    torch.set_num_threads(1)
    x = torch.randn(2, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.fft.irfft2(torch.fft.rfft2(x) * 1.2345, s=(64, 64))
    return hashlib.sha256(y.numpy().tobytes()).hexdigest()


def mkl_instructions() -> str | None:
    """This process's `MKL_ENABLE_INSTRUCTIONS`, None where unset."""
    return os.environ.get("MKL_ENABLE_INSTRUCTIONS")


def test_results_come_in_job_order_from_any_number_of_workers():
    jobs = [(2.0, float(i)) for i in range(7)]
    for workers in (1, 2):
        assert list(run_in_workers(math.pow, jobs, workers)) == [2.0 ** i for i in range(7)]


def test_a_lone_worker_keeps_the_parents_thread_count_and_several_take_one_each():
    # torch's FFT rounds differently at other thread counts: one worker must compute what this
    # process would (conftest runs tests at 1 thread; 2 is set here so a default cannot pass).
    torch.set_num_threads(2)
    assert list(run_in_workers(torch.get_num_threads, [()], 1)) == [2]
    assert list(run_in_workers(torch.get_num_threads, [(), ()], 2)) == [1, 1]


_MAIN = """
import torch

# MKL's first call at import, as entry.prepare_data's imports make one: a worker whose job is this module's
# own function imports it again, by name, before its pool's initializer runs.
torch.fft.rfft(torch.ones(8, dtype=torch.float64))


def own_fft_hash() -> str:
    from tests.test_work_pool import fft_hash

    return fft_hash()


if __name__ == "__main__":
    from pipelines.work_pool import run_in_workers
    from tests.test_work_pool import fft_hash, mkl_instructions

    print(*run_in_workers(own_fft_hash, [()], 1), *run_in_workers(fft_hash, [()], 1),
          *run_in_workers(mkl_instructions, [()], 1), mkl_instructions())
"""


def test_a_worker_computes_ffts_as_a_process_started_with_mkl_pinned_does(tmp_path):
    # MKL picks its FFT code by the CPU's vendor and instruction sets; an Intel Xeon wrote the ns2d
    # race file with other last bits than AMD CPUs until the workers were pinned (2026-12-05). MKL reads
    # the pin at its first call, which a worker may make before its initializer (re-importing its
    # parent's main module for a job of that module's own): the pin must be in the environment the
    # worker starts with, and not stay in the parent's.
    pinned = subprocess.run([sys.executable, "-c", "from tests.test_work_pool import fft_hash; print(fft_hash())"],
                            cwd=tmp_path, env=tr.env() | {"MKL_ENABLE_INSTRUCTIONS": MKL_INSTRUCTIONS},
                            capture_output=True, text=True, timeout=300)
    assert pinned.returncode == 0, pinned.stderr[-2000:]
    # Run with -m, as entry.prepare_data is: a worker re-imports such a main module by name.
    (tmp_path / "pinned_main.py").write_text(_MAIN)
    env = {k: v for k, v in tr.env().items() if k != "MKL_ENABLE_INSTRUCTIONS"}
    done = subprocess.run([sys.executable, "-m", "pinned_main"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [pinned.stdout.strip(), pinned.stdout.strip(), MKL_INSTRUCTIONS, "None"]


_COUNTED = """
import os

with open("imports.txt", "a") as f:  # a line per process that imports this module
    f.write(f"{os.getpid()}\\n")


def own_job(x: float) -> float:
    return 2 * x


if __name__ == "__main__":
    import math
    import sys

    from pipelines.work_pool import run_in_workers

    print(*run_in_workers(own_job if sys.argv[1] == "own" else math.sqrt, [(4.0,)], 1))
"""


def test_a_worker_imports_the_main_module_only_for_a_job_of_its_own(tmp_path):
    # A stage command's imports (torch's compiler among them, through tensordict) cost a spawned
    # worker 3 s of every generated file on a 2-core machine: only a job defined in the main module
    # needs the module there.
    (tmp_path / "counted_main.py").write_text(_COUNTED)
    for job, result, importers in (("library", "2.0", 1), ("own", "8.0", 2)):
        (tmp_path / "imports.txt").unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-m", "counted_main", job], cwd=tmp_path, env=tr.env(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == [result], job
        assert len((tmp_path / "imports.txt").read_text().split()) == importers, job


_UNGUARDED = """
import math

from pipelines.work_pool import run_in_workers

print(*run_in_workers(math.pow, [(2.0, 3.0), (2.0, 4.0)], 1))
"""


def test_a_script_without_a_main_guard_or_from_stdin_runs_its_jobs_once(tmp_path):
    # The workers do not re-import the main module: a script that calls the generators at its top
    # level is not run again in them (which would spawn again, and fail), and `python -` has no file.
    (tmp_path / "unguarded.py").write_text(_UNGUARDED)
    for argv, stdin in ((["unguarded.py"], None), (["-"], _UNGUARDED)):
        done = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=tr.env(), input=stdin, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["8.0", "16.0"], argv


def test_a_process_keeps_its_workers_until_it_closes_them():
    # A worker's start-up (torch's import) is paid once per process, not once per generated file; a
    # command closes them before it trains (entry.training.stage_sequence.prepare_data).
    close_workers()
    first = list(run_in_workers(os.getpid, [()] * 3, 1))
    assert len(set(first)) == 1 and first[0] != os.getpid()
    assert list(run_in_workers(os.getpid, [()], 1)) == first[:1]
    assert [p.pid for p in multiprocessing.active_children() if p.pid == first[0]] == first[:1]
    close_workers()
    assert first[0] not in [p.pid for p in multiprocessing.active_children()]
    assert list(run_in_workers(os.getpid, [()], 1)) != first[:1]
    # Another shape (workers, threads) starts its own in their place, results still in job order.
    assert list(run_in_workers(math.pow, [(3.0, float(i)) for i in range(5)], 2)) == [3.0 ** i for i in range(5)]
    close_workers()


def test_the_stage_sequence_stops_the_workers_before_it_trains(tmp_path):
    # A stage command generates its missing files, then trains for hours: idle workers would hold their
    # memory all along.
    import logging

    from entry.config.load import load_config
    from entry.distributed.process_group import DistInfo
    from entry.training.stage_sequence import prepare_data

    list(run_in_workers(os.getpid, [()], 1))  # this process's workers, as an earlier file leaves them
    assert multiprocessing.active_children()
    cfg = load_config(tree=tr.tiny_tree(tmp_path))
    prepare_data(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None, 0), logging.getLogger("test"), 1)
    assert (tmp_path / "data").is_dir() and not multiprocessing.active_children()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_worker_fails_its_call_and_the_next_call_gets_new_ones():
    close_workers()
    with pytest.raises(Exception, match="terminated abruptly"):
        list(run_in_workers(_die, [()], 1))
    assert list(run_in_workers(math.sqrt, [(9.0,)], 1)) == [3.0]
    close_workers()


def test_a_caller_that_stops_early_leaves_its_queued_jobs_unrun(tmp_path):
    close_workers()
    marks = [(str(tmp_path / f"job{i}"),) for i in range(6)]
    results = run_in_workers(_touch, marks, 1)
    assert next(results) == marks[0][0]
    results.close()  # jobs 1 and 2 were in flight (2 * workers), 3-5 never submitted
    close_workers()  # waits for a running job
    done = {p.name for p in tmp_path.iterdir()}
    assert "job0" in done and done <= {"job0", "job1", "job2"}, done


def _touch(path: str) -> str:
    with open(path, "w"):
        pass
    return path
