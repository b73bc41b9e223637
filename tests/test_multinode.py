"""Two torchrun agents on this machine (`--nnodes=2 --nproc_per_node=1`, c10d rendezvous on
127.0.0.1) run the quickstart pipeline with the data and run folders shared and the latent cache
node-local (a per-node `training.cache_dir`, as /dev/shm would be on two machines). A cache both
nodes share is built once, as every two-rank test on one machine builds it (one probe, whichever
node a rank is on)."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
import yaml

from tests import tiny_run as tr

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SHORT = ["--set", "evaluation.plot_samples=0", "--set", "evaluation.max_test_samples=2",
         "--set", "evaluation.time_rollout=false",
         "--set", "training.checkpoint_every=2", "--set", "training.num_workers=0"]
# Without the refiners: their ranks split batches as the operator's do (the 2-process pipeline test
# runs them); this test is about the folders two nodes share.
SHORT += ["--set", tr.WITHOUT_REFINERS]
for _stage in ("autoencoder", "operator", "steady"):
    SHORT += ["--set", f"{_stage}.steps=2"]
for _task in range(3):  # fewer samples to generate, cache and score: the test is about the folders
    SHORT += ["--set", f"data.tasks.{_task}.samples=40"]


def _two_agents(tmp_path, module_args: list[str], timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Start two torchrun agents of one 2-node job and wait for both."""
    port = tr.free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job{port}", *module_args]
    agents = [subprocess.Popen(cmd, cwd=tmp_path, env=tr.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    try:
        outs = [a.communicate(timeout=timeout)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    return [subprocess.CompletedProcess(cmd, a.returncode, out, "") for a, out in zip(agents, outs)]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    root = tmp_path_factory.mktemp("multinode")
    tree = yaml.safe_load((tr.ROOT / "configs" / "quickstart.yaml").read_text())
    tree["data"]["root"] = str(root / "data")
    tree["training"]["cache_dir"] = str(root / "cache")
    tree["logging"].update(run_dir=str(root / "runs"), progress=False, plots=False)
    (root / "q.yaml").write_text(yaml.safe_dump(tree))
    return root


def _pipeline(root, *extra: str) -> list[subprocess.CompletedProcess]:
    return _two_agents(root, ["-m", "entry.pipeline", "--config", str(root / "q.yaml"), *SHORT, *extra])


@pytest.mark.timeout(1200)
def test_two_nodes_with_a_node_local_cache(quickstart):
    # $GROUP_RANK is torchrun's node index: each node gets a cache folder the other cannot see.
    per_node = ["--set", "logging.run_name=local", "--set", f"training.cache_dir={quickstart}/node$GROUP_RANK/cache"]
    # The doctor, given a per-node run folder as well: the cache may be node-local, the run folder not.
    doctor = _two_agents(quickstart, ["-m", "entry.doctor", "--config", str(quickstart / "q.yaml"), *per_node,
                                      "--set", f"logging.run_dir={quickstart}/node$GROUP_RANK/runs"], timeout=300)
    lines = doctor[0].stdout.splitlines() + doctor[1].stdout.splitlines()
    assert all(a.returncode == 1 for a in doctor), lines[-40:]
    assert any(line.startswith("[pass]") and "folder training.cache_dir" in line and "node-local" in line
               for line in lines), lines
    assert any(line.startswith("[FAIL]") and "folder logging.run_dir" in line and "NOT shared" in line
               for line in lines), lines
    assert any(line.startswith("[pass]") and "folder data.tasks[0]" in line and "shared" in line for line in lines)
    assert not list(quickstart.glob("node*")), "the doctor only checks: it made the folders it was asked about"
    agents = _pipeline(quickstart, *per_node)
    for a in agents:
        assert a.returncode == 0, a.stdout[-4000:]
    run = quickstart / "runs" / "local"
    log = (run / "rank0.log").read_text()
    assert "pipeline completed" in log
    assert "2 parts" in log  # the data folder both nodes see: each made its part, one merged them
    assert orjson.loads((run / "eval.json").read_bytes())["world_size"] == 2
    for node in (0, 1):  # each node built the whole cache for itself
        for kind in ("dynamic_train", "steady_train"):  # folders <kind>_<split>-<key of the content>
            assert list((quickstart / f"node{node}" / "cache").glob(f"{kind}-*/manifest.json")), (node, kind)


@pytest.mark.timeout(600)
def test_a_run_folder_of_one_node_only_is_refused_before_anything_is_made(quickstart):
    """Per-node run folders yet to be made in one shared parent: the probe compares what each
    rank would create, not only the parent it can see, and the refusal creates neither."""
    agents = _pipeline(quickstart, "--set", "logging.run_name=refused",
                       "--set", f"logging.run_dir={quickstart}/refused$GROUP_RANK/runs")
    out = agents[0].stdout + agents[1].stdout
    assert all(a.returncode != 0 for a in agents), out[-4000:]
    assert any(line.startswith("config error: logging.run_dir") and "not shared" in line for line in out.splitlines()), \
        out[-4000:]
    assert not list(quickstart.glob("refused*")), list(quickstart.glob("refused*"))
