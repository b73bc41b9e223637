"""bench.child_runs: a SIGTERM to a bench command reaches the training runs it started, which then
exit as preempted ones do; no new run starts after it, and the command ends with one line and exit 143;
with none running it ends the command; a failure with no SIGTERM is raised as it is."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.tiny_run import ROOT, env

# A stand-in for a training run: says it started, then on SIGTERM records it and exits 143 as a
# preempted stage does (entry.training's checkpoint-and-exit).
CHILD = """
import pathlib, signal, sys, time
folder = pathlib.Path(sys.argv[1])
def stop(signum, frame):
    (folder / "term").write_text("got it")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
(folder / "started").write_text("")
time.sleep(60)
"""

# The bench command's part: one run, then an attempt at the next, under `forwarding_sigterm`; a bench
# command raises on a run that failed, and so does this one.
PARENT = """
import os, sys
from bench.child_runs import forwarding_sigterm, run_child
child = [sys.executable, "-c", sys.argv[1], sys.argv[2]]
with forwarding_sigterm():
    if sys.argv[3] == "idle":
        (__import__("pathlib").Path(sys.argv[2]) / "started").write_text("")
        __import__("time").sleep(60)
    done = run_child(child, env=dict(os.environ))
    print("child exited", done.returncode, flush=True)
    run_child(child, env=dict(os.environ))
print("not reached", flush=True)
"""


def _signalled_parent(tmp_path, mode: str) -> subprocess.CompletedProcess:
    """The parent script in `mode` ("child": SIGTERM while its run trains; "idle": while none does),
    sent SIGTERM once the run (or the parent) has started; its output and exit code."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(tmp_path), mode], cwd=ROOT, env=env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    parent.send_signal(signal.SIGTERM)
    out, err = parent.communicate(timeout=30)
    return subprocess.CompletedProcess(parent.args, parent.returncode, out, err)


@pytest.mark.timeout(90)
def test_a_sigterm_reaches_the_running_child_and_no_new_one_starts(tmp_path):
    done = _signalled_parent(tmp_path, "child")
    assert (tmp_path / "term").read_text() == "got it", done.stderr[-2000:]
    assert "child exited 143" in done.stdout and "not reached" not in done.stdout, done.stdout
    # The refused second run is the stop, said in one line: no traceback of a failure.
    assert done.returncode == 143 and "Traceback" not in done.stderr, done.stderr[-2000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("stopped by SIGTERM")]
    assert "the same command resumes them" in line and "not started after SIGTERM" in line


@pytest.mark.timeout(90)
def test_a_sigterm_with_no_child_running_ends_the_command(tmp_path):
    done = _signalled_parent(tmp_path, "idle")
    assert done.returncode == 143 and "child exited" not in done.stdout, (done.stdout, done.stderr[-2000:])


def test_the_handler_before_is_restored_after():
    from bench.child_runs import forwarding_sigterm

    before = signal.getsignal(signal.SIGTERM)
    with forwarding_sigterm():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_failure_without_a_sigterm_is_raised_as_it_is():
    from bench.child_runs import forwarding_sigterm

    with pytest.raises(ValueError, match="a real failure"):
        with forwarding_sigterm():
            raise ValueError("a real failure")
