"""The training runs a bench command starts as child processes, reachable by a SIGTERM sent to it.

A scheduler that preempts a bench command (SLURM's `scancel`, a `kill` of its pid) signals the command
alone: Python's default SIGTERM ends it at once, and its children, each an `entry.pipeline` in the same
process group, trained on unseen (bench.transfer's two jobs did, 2026-12-07). `forwarding_sigterm`
passes the signal on to every live child instead; each checkpoints and exits 143, as it does under
torchrun, and the command stops with one line and exit 143 (not a failed run's traceback); the same
command resumes the runs. A process-group kill would reach whatever started the command too (a shell's
job, pytest).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

__all__ = ["run_child", "forwarding_sigterm"]

_live: set[subprocess.Popen] = set()
_lock = threading.RLock()  # re-entrant: the handler may interrupt the main thread holding it
_stopping = threading.Event()


def run_child(cmd: list[str], *, env: dict[str, str], timeout_s: float | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)`, the child
    reachable by `forwarding_sigterm` while it runs. Refuses (RuntimeError) to start one once a SIGTERM
    has arrived; raises `subprocess.TimeoutExpired` after killing a child that overran."""
    with _lock:
        if _stopping.is_set():
            raise RuntimeError(f"not started after SIGTERM: {' '.join(cmd[:4])} ...")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _live.add(proc)
    try:
        with proc:
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                raise subprocess.TimeoutExpired(cmd, timeout_s, out, err) from None
    finally:
        with _lock:
            _live.discard(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _forward(signum: int, frame) -> None:
    with _lock:
        _stopping.set()
        children = list(_live)
    if not children:
        raise SystemExit(128 + signum)  # nothing to wait for: end as the default action would
    for child in children:
        child.send_signal(signum)


@contextlib.contextmanager
def forwarding_sigterm() -> Iterator[None]:
    """Within: a SIGTERM to this process goes to its live children (`run_child`) and no new child
    starts; with none alive it ends this process (exit 143). What the block raises once a SIGTERM has
    arrived (a child's exit 143, a child refused) is the stop, not a failure: one line on stderr, exit
    143. The handler before is restored after. From the main thread only (where Python runs signal
    handlers)."""
    before = signal.signal(signal.SIGTERM, _forward)
    try:
        yield
    except Exception as err:
        if not _stopping.is_set():
            raise
        first = (str(err).strip().splitlines() or [""])[0][:200]
        print(f"stopped by SIGTERM: the runs it reached checkpointed, and the same command resumes them "
              f"({type(err).__name__}: {first})", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM) from None
    finally:
        signal.signal(signal.SIGTERM, before)
        _stopping.clear()
