"""configs/launch/: both scripts pass shellcheck; the SLURM script starts one torchrun agent per node
with c10d rendezvous from the allocation and requeues on preemption (run against stand-ins for
srun and scontrol); the rented-machine bootstrap runs the quickstart end to end on the CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest

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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bootstrap_runs_the_quickstart_on_cpu(tmp_path):
    """The rented-machine script with --skip-cuda-install: doctor, data, pipeline; results archived,
    wandb's offline files among them; its last line says the pipeline completed."""
    sets = [f"data.root={tmp_path / 'data'}", f"training.cache_dir={tmp_path / 'cache'}",
            f"logging.run_dir={tmp_path / 'runs'}", "logging.progress=false", "evaluation.plot_samples=0",
            "evaluation.max_test_samples=2", "evaluation.time_rollout=false", "training.num_workers=0"]
    # The refiners left out: the test is about the script (the pipeline's stages have their own tests).
    sets += [tr.WITHOUT_REFINERS]
    sets += [f"{stage}.steps=2" for stage in ("autoencoder", "operator", "steady")]
    sets += [f"data.tasks.{i}.samples=40" for i in range(3)]
    env = dict(tr.env(), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(LAUNCH / "bootstrap.sh"), "--skip-cuda-install", "--config",
                           "configs/quickstart.yaml", "--nproc", "1", "--results", str(tmp_path / "results"), "--",
                           *[x for s in sets for x in ("--set", s)]],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.strip().splitlines()[-1].endswith("pipeline completed"), proc.stdout[-2000:]
    (archive,) = (tmp_path / "results").glob("quickstart-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert "quickstart/eval.json" in names
    assert any(n.startswith("quickstart/wandb/offline-run-") for n in names)
    assert not any("/checkpoints/" in n for n in names)
