"""configs/launch/: both scripts pass shellcheck; the SLURM script starts one torchrun agent per node
with c10d rendezvous from the allocation and requeues on preemption (run against stand-ins for
srun and scontrol). The rented-machine bootstrap runs the quickstart end to end on the CPU in
tests/test_pipeline_e2e.py, as the re-run of its failed run."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tests import tiny_run as tr

LAUNCH = tr.ROOT / "configs" / "launch"
SCRIPTS = [LAUNCH / "slurm.sbatch", LAUNCH / "bootstrap.sh"]


def test_launch_scripts_pass_shellcheck():
    tr.assert_shellcheck_passes(*SCRIPTS)


def _fake_slurm(tmp_path, *, srun_sleeps: bool) -> dict:
    """PATH with stand-ins: `scontrol` names two nodes and records requeues, `srun` records its
    command line and (when asked) runs until SIGTERM, which it records; returns the environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "record.txt"
    (bin_dir / "scontrol").write_text(f"""#!/bin/bash
if [[ $1 == show ]]; then printf 'gpu-a\\ngpu-b\\n'; else echo "scontrol $*" >> {record}; fi
""")
    (bin_dir / "srun").write_text(f"""#!/bin/bash
echo "srun $*" >> {record}
{"trap 'echo srun-got-TERM >> " + str(record) + "; exit 143' TERM; while true; do sleep 0.1; done"
 if srun_sleeps else "exit 0"}
""")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="4242",
               SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_GPUS_ON_NODE="8")
    env.pop("CONFIG", None)
    return env


def test_slurm_script_starts_one_agent_per_node_with_c10d_rendezvous(tmp_path):
    env = _fake_slurm(tmp_path, srun_sleeps=False)
    proc = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--set", "operator.steps=5"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = (tmp_path / "record.txt").read_text().splitlines()
    for part in ("--ntasks-per-node=1", "torchrun --nnodes=2 --nproc_per_node=8", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=gpu-a:29500", "--rdzv-id=4242", "--max-restarts=3",
                 "-m entry.pipeline --config configs/burgers.yaml --set operator.steps=5"):
        assert part in line, (part, line)


def test_slurm_script_checkpoints_and_requeues_when_signalled(tmp_path):
    """SLURM signals the batch script before the time limit (--signal=B:USR1@300) or on preemption:
    torchrun (here srun) gets SIGTERM, which makes training checkpoint, and the job is requeued."""
    env = _fake_slurm(tmp_path, srun_sleeps=True)
    proc = subprocess.Popen(["bash", str(LAUNCH / "slurm.sbatch")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    record = tmp_path / "record.txt"
    deadline = time.monotonic() + 30
    while not (record.is_file() and "srun" in record.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    lines = record.read_text().splitlines()
    assert lines[1:] == ["srun-got-TERM", "scontrol requeue 4242"], lines
