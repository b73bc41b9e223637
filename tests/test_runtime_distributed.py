"""The distributed runtime under torchrun on CPU (gloo): equivalence, faults that never hang,
resumable checkpoints. Every multi-process test has a timeout."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import orjson
import pytest
import torch

from tests import tiny_run as tr

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime")
    tr.prepare(root)
    return root


@pytest.fixture(scope="module")
def reference(root):
    """An uninterrupted 1-process run: final weights and loss per step."""
    proc = tr.launch(root, tr.new_run(root, "ref1"), nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tr.final_weights(root, "ref1"), _loss_by_step(root, "ref1")


def _loss_by_step(root, name) -> dict[int, float]:
    out = {}
    for line in (root / "runs" / name / "metrics.jsonl").read_bytes().splitlines():
        rec = orjson.loads(line)
        if rec["stage"] == "operator":
            out[rec["step"]] = rec["loss"]
    return out


def _log(root, name, rank) -> str:
    return (root / "runs" / name / f"rank{rank}.log").read_text()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_two_process_training_equals_one_process(root, reference, parallel):
    name = f"eq_{parallel}"
    proc = tr.launch(root, [*tr.new_run(root, name), "--set", f"training.parallel={parallel}"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref_w, ref_loss = reference
    assert tr.max_rel_diff(ref_w, tr.final_weights(root, name)) < 1e-5
    got = _loss_by_step(root, name)
    assert got.keys() == ref_loss.keys()
    for step, value in ref_loss.items():
        assert abs(got[step] - value) <= 1e-5 * abs(value), step


@pytest.mark.timeout(600)
def test_oom_on_one_rank_restarts_with_smaller_micro_batch(root, reference):
    name = "oom_restart"
    proc = tr.launch(root, tr.new_run(root, name), nproc=2, max_restarts=1, fault="oom@rank=1,step=7")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log1 = _log(root, name, 1)
    assert "out of memory on rank 1 at step 7" in log1
    assert "micro-batch 2, accum_steps 2" in _log(root, name, 0)  # per-rank batch 4 halved
    assert "resumed from" in _log(root, name, 0) and "step_00000005" in _log(root, name, 0)
    assert tr.max_rel_diff(reference[0], tr.final_weights(root, name)) < 1e-4


@pytest.mark.timeout(120)
def test_oom_without_restarts_fails_fast_and_names_rank(root):
    name = "oom_fail"
    t0 = time.monotonic()
    proc = tr.launch(root, tr.new_run(root, name), nproc=2, fault="oom@rank=1,step=3", timeout=90)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert elapsed < 30 + 15, elapsed  # 30 s for the failure, plus interpreter start-up on 2 cores
    out = proc.stdout + proc.stderr
    assert "rank      : 1" in out or "rank: 1" in out, out[-3000:]
    assert "OutOfMemoryError" in out


@pytest.mark.timeout(300)
def test_nan_on_one_rank_skips_step_on_both(root):
    # FSDP2 (sharded gradients); DDP's detection on both ranks is the repeated-NaN test's.
    name = "nan_fsdp"
    proc = tr.launch(root, [*tr.new_run(root, name), "--set", "training.parallel=fsdp",
                            "--set", "operator.steps=6"], nproc=2, fault="nan@rank=1,step=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert "non-finite loss or gradient at step 3" in _log(root, name, rank)


@pytest.mark.timeout(300)
def test_repeated_nan_stops_every_rank(root):
    # DDP (all-reduced gradients): each of the three steps is found non-finite on both ranks.
    name = "nan_repeat"
    proc = tr.launch(root, [*tr.new_run(root, name), "--set", "training.max_skips_in_a_row=2",
                            "--set", "training.parallel=ddp"], nproc=2, fault="nan@rank=1,step=2,repeat=1")
    assert proc.returncode != 0
    for rank in (0, 1):
        assert "3 non-finite steps in a row" in _log(root, name, rank)


@pytest.mark.timeout(600)
def test_sigkill_resume_is_bitwise(root):
    uninterrupted = "eq_fsdp"  # the uninterrupted 2-process FSDP2 run of the equivalence test
    if not (root / "runs" / uninterrupted / "operator.pt").is_file():
        proc = tr.launch(root, tr.new_run(root, uninterrupted), nproc=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
    name = "kill_resume"
    proc = tr.launch(root, tr.new_run(root, name), nproc=2, max_restarts=1, fault="kill@rank=1,step=12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_00000010" in _log(root, name, 0)
    a, b = tr.final_weights(root, uninterrupted), tr.final_weights(root, name)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_sigsegv_leaves_python_stack_and_fails(root):
    name = "segv"
    proc = tr.launch(root, tr.new_run(root, name), nproc=2, fault="segv@rank=1,step=2")
    assert proc.returncode != 0
    log1 = _log(root, name, 1)
    assert "Fatal Python error: Segmentation fault" in log1
    assert "entry/training/loop.py" in log1  # the Python stack of the faulting rank
    out = proc.stdout + proc.stderr
    assert "rank      : 1" in out or "rank: 1" in out, out[-3000:]


@pytest.mark.timeout(300)
def test_sigterm_checkpoints_and_resumes(root):
    name = "preempt"
    e = tr.env()
    _, returncode = tr.signal_the_operator_at_step_3(root, name, signal.SIGTERM, env=e, timeout_s=120)
    assert returncode == 143
    ckpts = sorted((root / "runs" / name / "checkpoints" / "operator").glob("step_*"))
    assert ckpts and (ckpts[-1] / "COMPLETE").is_file()
    stopped_at = int(ckpts[-1].name.split("_")[1])
    again = tr.launch(root, ["--set", f"logging.run_name={name}", "--set", "training.checkpoint_every=1000",
                             "--set", f"operator.steps={stopped_at + 2}"], nproc=1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpts[-1]}" in _log(root, name, 0)


@pytest.mark.timeout(120)
def test_stalled_rank_fails_peer_within_timeout(root):
    from datetime import datetime

    name = "stall"
    t0 = time.monotonic()
    proc = tr.launch(root, [*tr.new_run(root, name), "--set", "training.timeout_s=5"], nproc=2,
                     fault="sleep@rank=1,step=2,seconds=12", timeout=100)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 90  # the job ends: no hang
    lines = _log(root, name, 0).splitlines()
    stamp = lambda line: datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")  # noqa: E731
    last_step = next(line for line in reversed(lines) if "operator step 2/" in line)
    error = next(line for line in lines if " ERROR " in line)
    waited = (stamp(error) - stamp(last_step)).total_seconds()
    assert waited < 5 + 3, waited  # the 5 s process-group timeout plus a small margin
    assert "during the forward pass (FSDP2 parameter all-gathers)" in error
    assert "Timed out" in error


@pytest.mark.timeout(300)
def test_sigterm_on_torchrun_job_checkpoints_on_every_rank(root):
    name = "preempt_job"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "entry.operator",
           "--config", str(root / "tiny.yaml"), *tr.new_run(root, name), "--set", "operator.steps=3000",
           "--set", "training.checkpoint_every=10000"]
    proc = subprocess.Popen(cmd, cwd=root, env=tr.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = root / "runs" / name / "rank0.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (log.exists() and "operator step 3/" in log.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker
    proc.communicate(timeout=120)
    assert proc.returncode != 0  # torchrun itself reports the signal; the workers exit 143
    for rank in (0, 1):
        assert "SIGTERM received; checkpoint written" in _log(root, name, rank)
        assert "exiting with 143" in _log(root, name, rank)
    ckpts = sorted((root / "runs" / name / "checkpoints" / "operator").glob("step_*"))
    assert ckpts and (ckpts[-1] / "COMPLETE").is_file()
    stopped_at = int(ckpts[-1].name.split("_")[1])
    again = tr.launch(root, ["--set", f"logging.run_name={name}", "--set", "training.checkpoint_every=10000",
                             "--set", f"operator.steps={stopped_at + 2}"], nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpts[-1]}" in _log(root, name, 0)


@pytest.mark.timeout(120)
def test_doctor_passes_under_torchrun():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "entry.doctor"], cwd=tr.ROOT, env=tr.env(), capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"[pass] rank{rank} all_reduce" in proc.stdout
    assert "FAIL" not in proc.stdout
