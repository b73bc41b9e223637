"""Checks that only a GPU machine can run (marked `cuda`; elsewhere skipped with the reason).

The other `cuda` tests sit beside the CPU tests of the same code: the recipe matrix on CUDA and
over NCCL (tests/test_recipe_matrix.py), one device sync per optimizer step
(tests/test_host_syncs.py), GPU data generation against CPU (tests/test_generate_device.py).
`bash bench/gpu_owner.sh` runs them all (`pytest -m cuda`) before the GPU benchmarks.
"""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
import torch
from tensordict import TensorDict

from tests import tiny_run as tr

pytestmark = pytest.mark.cuda


def test_loader_pins_batches_and_copies_them_to_the_gpu_without_a_sync():
    from pipelines.datasets import LatentPairs
    from pipelines.loader import build_loader
    from pipelines.samplers import BatchSampler, DistributedIndexSampler

    n, t = 12, 5
    cache = TensorDict({"z": torch.randn(n, t, 4, 3), "task_id": torch.zeros(n, dtype=torch.int64),
                        "dt": torch.full((n,), 0.1)}, batch_size=[n])
    data = LatentPairs(cache)
    sampler = BatchSampler(DistributedIndexSampler(len(data), rank=0, world_size=1, seed=0), 8, drop_last=True)
    with build_loader(data, sampler, num_workers=1, prefetch_factor=2, pin_memory=True) as loader:
        for batch in loader:
            assert all(v.is_pinned() for v in batch.values()), "the loader must pin what the step copies"
            torch.cuda.set_sync_debug_mode("error")  # a copy that synchronised would raise here
            try:
                on_gpu = batch.to("cuda", non_blocking=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            assert all(torch.equal(on_gpu[k].cpu(), batch[k]) for k in batch.keys())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_tiny")
    tr.prepare(root)
    return root


@pytest.mark.cuda(gpus=2)
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_nccl_two_process_operator_matches_one_process(tiny):
    """The operator stage under torchrun on two GPUs (backend auto: NCCL) trains the one-GPU model,
    in fp32 eager (TF32 matmuls) and in the default GPU recipe (bf16 + compile)."""
    # bf16: 5 steps, where the CPU recipe matrix measured the layouts within 5.6e-4 of each other.
    for recipe, bound in ((["--set", "training.precision=fp32", "--set", "training.compile=false"], 1e-4),
                          (["--set", "operator.steps=5"], 2.0 ** -9)):
        tag = "fp32" if "training.compile=false" in recipe else "auto"
        runs = {}
        for nproc in (1, 2):
            name = f"nccl_{tag}_{nproc}"
            proc = tr.launch(tiny, [*tr.new_run(tiny, name), *recipe], nproc=nproc, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[nproc] = tr.losses(tiny, name)
        environment = orjson.loads((tiny / "runs" / f"nccl_{tag}_2" / "environment.json").read_bytes())
        assert environment["backend"] == "nccl" and environment["world_size"] == 2
        assert len(runs[1]) == len(runs[2])
        for a, b in zip(runs[2], runs[1]):
            assert abs(a - b) <= bound * abs(b), (tag, runs)


@pytest.mark.timeout(600)
def test_the_dry_run_plans_against_this_gpus_memory(tiny):
    """`entry.pipeline --dry-run` on a GPU plans its stages against that GPU's memory."""
    from entry.training.memory_plan import human

    proc = subprocess.run([sys.executable, "-m", "entry.pipeline", "--config", str(tiny / "tiny.yaml"), "--dry-run"],
                          cwd=tiny, env=tr.env(), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    total = torch.cuda.get_device_properties(0).total_memory
    assert f"GPU memory {human(total)}" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(300)
def test_the_doctor_says_whether_this_gpu_suits_the_default_recipe():
    """`entry.doctor`'s recipe line on the real device: it passes where the GPU computes bf16 natively."""
    from entry.config.recipe import BF16_CAPABILITY

    proc = subprocess.run([sys.executable, "-m", "entry.doctor"], cwd=tr.ROOT, env=tr.env(), capture_output=True,
                          text=True, timeout=200)
    (line,) = [x for x in proc.stdout.splitlines() if "recipe:" in x]
    suits = torch.cuda.get_device_capability(0) >= BF16_CAPABILITY
    assert line.startswith("[pass]" if suits else "[FAIL]") and "precision bf16, compile on" in line, line
    assert proc.returncode == (0 if suits else 1), proc.stdout[-2000:]
