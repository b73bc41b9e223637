"""The GPU recipe proven on CPU: {fp32, bf16} x {none, DDP, FSDP2} x {eager, compiled} at world
sizes 1 and 2 (gloo), a few steps of a tiny operator per cell, every cell of a world size in one
launch of tests/recipe_worker.py (the inductor CPU backend compiles the compiled cells).

At world size 1 there is no process group, so `parallel` leaves the model unwrapped: the three
layouts of a recipe are one code path and must agree bitwise. At world size 2, `none` trains one
independent model per rank on half of each batch (no gradient sync), so it is compared with
nothing; DDP and FSDP2 must train the world-size-1 model.

Bounds, from measurement (2026-11-23, torch 2.13 CPU, this test's 5 steps), against the eager
world-size-1 cell of the same precision; "learned step" is the relative L2 difference of the
exported operators' `op(z) - z` on the training pairs:
- bf16 cells: losses within 5.7e-4, learned steps within 3.4e-4. The layouts differ only in where
  bf16 rounding happens (FSDP2 gathers bf16 parameters, autocast casts fp32 ones at each matmul,
  inductor fuses differently), so the bound is one bf16 rounding, 2**-9 ~ 1.95e-3 (3.4x the
  largest loss difference). bf16 against fp32: losses 1.6e-3, learned steps 1.35e-3; bound one
  bf16 epsilon, 2**-8.
- fp32 cells: today's 1e-5 on losses, learned steps and weights (measured: 7.3e-8, 2.8e-7, and
  weights 0 for the eager layouts but 9.6e-6 for the compiled ones, so compiled weights get 1e-4:
  inductor's reduction order moves near-zero gradients, and Adam moves each weight by about lr
  whatever its gradient's size).
Raw bf16 weights are not compared, for that last reason (measured 1.8e-2).
"""

from __future__ import annotations

import math
import subprocess
import sys

import orjson
import pytest
import torch

from entry.config.load import load_config
from entry.models.build import build_operator
from tests import tiny_run as tr
from tests.recipe_worker import ALL_CELLS, STEPS, cell_tree, synthetic_pairs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BF16_BOUND = 2.0 ** -9
BF16_VS_FP32_BOUND = 2.0 ** -8
FP32_BOUND = 1e-5
FP32_COMPILED_WEIGHTS_BOUND = 1e-4
REFERENCE = {"fp32": "fp32-none-eager", "bf16": "bf16-none-eager"}


def launch_matrix(out, nproc: int, *, cuda: bool = False, timeout: float = 840) -> dict:
    """Run every cell at world size `nproc` in one launch; returns the worker's record."""
    env = tr.env()
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU matrix stays on the CPU on a GPU machine too
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "tests.recipe_worker", str(out)]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:] + rank_log_tails(out, nproc)
    return orjson.loads((out / f"cells-world{nproc}.json").read_bytes())


def rank_log_tails(out, nproc: int, chars: int = 1500) -> str:
    """The end of each rank's log in the cell last written at world size `nproc`: where a rank that
    died by a signal was, as faulthandler dumps its Python stack into that log."""
    folders = sorted((out / "runs").glob(f"*-world{nproc}"), key=lambda f: f.stat().st_mtime)
    if not folders:
        return ""
    logs = sorted(folders[-1].glob("rank*.log"))
    return "".join(f"\n--- {log} (end)\n{log.read_text(errors='replace')[-chars:]}" for log in logs)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("recipe")
    # World size 1 first: the world-size-2 launch then finds most compiled graphs in inductor's cache.
    return {n: launch_matrix(out, n)["cells"] for n in (1, 2)}


def weights(cell: dict) -> dict[str, torch.Tensor]:
    return torch.load(cell["weights"], weights_only=True)


def learned_delta(cell: dict) -> torch.Tensor:
    """What a cell's exported operator learned: its step `op(z) - z` on the training pairs (fp32, eager)."""
    model = build_operator(load_config(tree=cell_tree(tr.ROOT, "fp32-none-eager")))
    model.load_state_dict(weights(cell))
    data = synthetic_pairs()
    with torch.no_grad():
        return model.eval()(data["z_t"], data["dt"], data["task_id"]) - data["z_t"]


def function_diff(cell: dict, ref: dict) -> float:
    """Relative L2 difference of two cells' learned steps."""
    a, b = learned_delta(cell), learned_delta(ref)
    return float((a - b).norm() / b.norm())


def rel_diff(a: list[float], b: list[float]) -> float:
    """Largest relative difference of two equally long series."""
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def synchronised(world: int) -> list[str]:
    """Cells that train the one world-size-1 model: all at world size 1, DDP and FSDP2 at 2."""
    return [c for c in ALL_CELLS if world == 1 or c.split("-")[1] != "none"]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world", [1, 2])
def test_every_cell_trains(matrix, world):
    for name, cell in matrix[world].items():
        losses = cell["losses"]
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses + cell["grad_norms"]), name
        assert losses[-1] < 0.7 * losses[0], (name, losses)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world", [1, 2])
def test_fresh_operator_is_exactly_the_identity_in_fp32(matrix, world):
    """Under the loop's autocast in every cell, and as validation calls it in the eager cells.
    bf16 + FSDP2 at world size 2 returned bf16, off by up to 3.9e-3, before the precision contract."""
    for name, cell in matrix[world].items():
        assert cell["train_dtype"] == "torch.float32" and cell["train_exact"], (name, cell["train_max_abs_err"])
        if name.endswith("eager"):
            assert cell["eval_dtype"] == "torch.float32" and cell["eval_exact"], name


@pytest.mark.timeout(1800)
def test_layouts_at_world_size_1_are_one_code_path(matrix):
    cells = matrix[1]
    for name in ALL_CELLS:
        precision, _, mode = name.split("-")
        same = cells[f"{precision}-none-{mode}"]
        assert cells[name]["losses"] == same["losses"], name
        assert all(torch.equal(a, b) for a, b in zip(weights(cells[name]).values(), weights(same).values())), name


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world", [1, 2])
def test_fp32_cells_match_as_today(matrix, world):
    ref = matrix[1][REFERENCE["fp32"]]
    for name in synchronised(world):
        if name.startswith("fp32"):
            cell = matrix[world][name]
            assert rel_diff(cell["losses"], ref["losses"]) <= FP32_BOUND, name
            assert function_diff(cell, ref) <= FP32_BOUND, name
            bound = FP32_COMPILED_WEIGHTS_BOUND if name.endswith("compiled") else FP32_BOUND
            assert tr.max_rel_diff(weights(ref), weights(cell)) <= bound, name


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world", [1, 2])
def test_bf16_cells_match_each_other_within_the_measured_bound(matrix, world):
    """Losses and learned steps, not raw weights: Adam moves every weight by about lr whatever
    its gradient's size, so a near-zero gradient whose sign bf16 rounding flips moves a weight
    the other way (see the module docstring)."""
    ref = matrix[1][REFERENCE["bf16"]]
    for name in synchronised(world):
        if name.startswith("bf16"):
            cell = matrix[world][name]
            assert rel_diff(cell["losses"], ref["losses"]) <= BF16_BOUND, name
            assert function_diff(cell, ref) <= BF16_BOUND, name


@pytest.mark.timeout(1800)
def test_bf16_trains_the_fp32_model_up_to_bf16_rounding(matrix):
    """bf16 is a precision, not another model: its losses and learned step stay within one bf16
    epsilon of fp32's."""
    fp32, bf16 = matrix[1][REFERENCE["fp32"]], matrix[1][REFERENCE["bf16"]]
    assert rel_diff(bf16["losses"], fp32["losses"]) <= BF16_VS_FP32_BOUND
    assert function_diff(bf16, fp32) <= BF16_VS_FP32_BOUND


@pytest.mark.cuda
@pytest.mark.timeout(1800)
def test_recipe_matrix_on_cuda(tmp_path):
    """The same matrix on one GPU (NCCL needs a GPU per rank: world size 2 is test_nccl_*)."""
    cells = launch_matrix(tmp_path, 1, cuda=True)["cells"]
    for name, cell in cells.items():
        assert cell["train_exact"] and cell["train_dtype"] == "torch.float32", name
        assert all(math.isfinite(x) for x in cell["losses"]) and cell["losses"][-1] < cell["losses"][0], name
    for precision, bound in (("fp32", 1e-3), ("bf16", BF16_BOUND)):  # fp32 runs TF32 matmuls on CUDA
        ref = cells[REFERENCE[precision]]
        for name in ALL_CELLS:
            if name.startswith(precision):
                assert rel_diff(cells[name]["losses"], ref["losses"]) <= bound, name


@pytest.mark.cuda(gpus=2)
@pytest.mark.timeout(1800)
def test_recipe_matrix_on_two_gpus_with_nccl(tmp_path):
    """World size 2 over NCCL: DDP and FSDP2 train the one-GPU model, the identity holds everywhere."""
    one = launch_matrix(tmp_path, 1, cuda=True)["cells"]
    record = launch_matrix(tmp_path, 2, cuda=True)
    assert record["backend"] == "nccl"  # training.backend auto: NCCL with CUDA
    two = record["cells"]
    for name in synchronised(2):
        assert two[name]["train_exact"], name
        bound = BF16_BOUND if name.startswith("bf16") else 1e-3
        assert rel_diff(two[name]["losses"], one[name]["losses"]) <= bound, name
