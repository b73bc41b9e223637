"""One process of the recipe matrix (tests/test_recipe_matrix.py): train a tiny operator in every
cell {fp32, bf16} x {none, ddp, fsdp} x {eager, compiled} of one world size, in one launch.

    python -m torch.distributed.run --standalone --nproc_per_node=N -m tests.recipe_worker OUT_DIR [CELL ...]

A cell is `<precision>-<parallel>-<eager|compiled>`; all twelve when none are named. Each cell
goes through the stack's own code: `entry.training.runner.execute_stage` (the resolved recipe, the loop's
autocast, `place_model`: compile each block, then FSDP2 per block and root, or DDP; the training
loop; the exported weights). Data are fixed synthetic latent pairs: every world size sees the same
global batches, each rank its contiguous share. Before training, a fresh operator's forward (under
the loop's autocast, then as validation calls it) must return its input exactly, in fp32.

Rank 0 writes `OUT_DIR/cells.json`: per cell the loss and grad norm per step, the identity
checks, the seconds it took and its exported weights file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from pathlib import Path

import orjson
import torch
from tensordict import TensorDict

from entry.config.load import load_config
from entry.config.recipe import resolve_config
from entry.distributed.precision import compute_autocast
from entry.distributed.process_group import DistInfo, close_distributed, init_distributed
from entry.distributed.sharding import is_fsdp

PRECISIONS, PARALLELS, MODES = ("fp32", "bf16"), ("none", "ddp", "fsdp"), ("eager", "compiled")
ALL_CELLS = [f"{p}-{par}-{m}" for p in PRECISIONS for par in PARALLELS for m in MODES]
STEPS, GLOBAL_BATCH, PAIRS, TOKENS, DIM = 5, 8, 8, 8, 8


def cell_tree(out: Path, cell: str, world: int = 1) -> dict:
    """Config tree of one cell at world size `world` (1 or 2): a tiny operator of one block, the
    cell's recipe, and micro-batches of GLOBAL_BATCH / 2 rows at both world sizes (two micro-steps
    at world size 1), so inductor builds one graph per recipe: compiling is most of the time."""
    precision, parallel, mode = cell.split("-")
    return {
        "data": {"root": str(out / "data"), "tasks": [{"name": "advection1d", "param": 0.1, "nx": 32, "nt": 11}]},
        "latent": {"tokens": TOKENS, "dim": DIM, "hidden": 16},
        "operator": {"steps": STEPS, "batch_size": GLOBAL_BATCH, "lr": 3e-3, "input_noise": 0.01,
                     "pdet": {"hidden_dim": 16, "depths": [1], "num_heads": 2, "group_size": 2}},
        "training": {"seed": 0, "accum_steps": 2 // world, "precision": precision, "parallel": parallel,
                     "compile": mode == "compiled", "checkpoint_every": 1000, "keep_checkpoints": 1,
                     "max_skips_in_a_row": 1, "timeout_s": 120},
        "logging": {"run_dir": str(out / "runs"), "run_name": f"{cell}-world{world}", "log_every": 1,
                    "progress": False, "plots": False, "wandb": {"mode": "disabled"}},
    }


def synthetic_pairs() -> TensorDict:
    """PAIRS latent pairs z_next = z_t - 0.1 tanh(z_t): a map one block learns visibly in a few steps."""
    g = torch.Generator().manual_seed(1234)
    z_t = torch.randn(PAIRS, TOKENS, DIM, generator=g)
    return TensorDict({"z_t": z_t, "z_next": z_t - 0.1 * torch.tanh(z_t),
                       "dt": torch.full((PAIRS,), 0.05), "task_id": torch.zeros(PAIRS, dtype=torch.int64),
                       "sample_id": torch.arange(PAIRS, dtype=torch.int64),
                       "t": torch.zeros(PAIRS, dtype=torch.int64)}, batch_size=[PAIRS])


class GlobalBatches:
    """The loop's loader contract over fixed data: each epoch a seeded permutation cut into global
    batches, rank r taking rows [r * B/W, (r + 1) * B/W) of each, so every world size trains on the
    same global batches."""

    def __init__(self, data: TensorDict, info: DistInfo):
        self.data, self.info, self.epoch = data, info, 0
        self.per_rank = GLOBAL_BATCH // info.world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return PAIRS // GLOBAL_BATCH

    def __iter__(self):
        order = torch.randperm(PAIRS, generator=torch.Generator().manual_seed(self.epoch))
        lo = self.info.rank * self.per_rank
        for b in range(len(self)):
            yield self.data[order[b * GLOBAL_BATCH:(b + 1) * GLOBAL_BATCH][lo:lo + self.per_rank]]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]


def identity_checks(model, info: DistInfo, precision: str, data: TensorDict, *, as_validation: bool) -> dict:
    """Does the fresh operator return its input exactly, in fp32? Under the loop's autocast (with
    a backward, as training runs it), and with `as_validation` also as validation calls it (eval,
    no_grad, no autocast: eager cells only, as compiling those graphs too would double the cost)."""
    z, dt, tid = (data[k][:4].to(info.device) for k in ("z_t", "dt", "task_id"))
    with compute_autocast(info.device, precision):
        out = model(z, dt, tid)
    out.float().sum().backward()  # a whole forward/backward, so FSDP2 reshards and DDP syncs
    model.zero_grad(set_to_none=True)
    found = {"train_dtype": str(out.dtype), "train_exact": bool(torch.equal(out.detach(), z)),
             "train_max_abs_err": float((out.detach().float() - z).abs().max())}
    if not as_validation:
        return found
    model.eval()
    with torch.no_grad():
        out = model(z, dt, tid)
    model.train()
    if is_fsdp(model):
        model.reshard()  # a forward without backward leaves FSDP2's root gathered
    found.update(eval_dtype=str(out.dtype), eval_exact=bool(torch.equal(out, z)))
    return found


def run_cell(out: Path, cell: str, info: DistInfo, data: TensorDict) -> dict:
    """Train one cell through entry.training.runner.execute_stage; returns its record."""
    from core.steps.operator import OperatorStepConfig, operator_step
    from entry.storage.run_folder import run_dir_for
    from entry.models.build import build_operator
    from entry.stages.record import stage_spec
    from entry.training.runner import execute_stage
    from entry.stages.stage_build import optimizer_for, place_model
    from entry.training.stage_record import weights_file
    from entry.training.step import StageParts

    cfg = resolve_config(load_config(tree=cell_tree(out, cell, info.world_size)), cuda=info.device.type == "cuda")
    checks = {}

    def build(cfg, info, run_dir, logger) -> StageParts:
        model = place_model(lambda: build_operator(cfg), cfg, info)
        checks.update(identity_checks(model, info, cfg.training.precision, data,
                                      as_validation=not cfg.training.compile))
        optimizer, scheduler = optimizer_for(model, cfg.operator, info)
        step_cfg = OperatorStepConfig(input_noise=cfg.operator.input_noise)
        return StageParts("operator", model, operator_step, step_cfg, GlobalBatches(data, info), optimizer, scheduler)

    t0 = time.perf_counter()
    # The operator's record with this cell's build, which validates nothing.
    stage = dataclasses.replace(stage_spec("operator"), build=build, validates="")
    assert execute_stage(cfg, info, stage, resume=False) == 0
    seconds = time.perf_counter() - t0
    run_dir = run_dir_for(cfg)
    lines = [orjson.loads(x) for x in (run_dir / "metrics.jsonl").read_bytes().splitlines()] if info.is_main else []
    return {"losses": [x["loss"] for x in lines], "grad_norms": [x["grad_norm"] for x in lines], **checks,
            "seconds": seconds, "weights": str(weights_file(run_dir, "operator"))}


def main(argv: list[str]) -> int:
    out, cells = Path(argv[0]), argv[1:] or ALL_CELLS
    info = init_distributed(backend="auto", timeout_s=120)
    try:
        torch.manual_seed(0)
        data = synthetic_pairs()
        results = {cell: run_cell(out, cell, info, data) for cell in cells}
        if info.is_main:
            record = {"world_size": info.world_size, "device": str(info.device), "backend": info.backend,
                      "cells": results}
            (out / f"cells-world{info.world_size}.json").write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2))
    except BaseException:
        logging.shutdown()
        close_distributed()
        raise
    exit_after_record(info)
    return 0


def exit_after_record(info: DistInfo) -> None:
    """End every rank at once, without tearing the process group down, once all have trained and
    rank 0 has written the record. Once in CI (2026-11-24) rank 0 aborted ("terminate called
    without an active exception", SIGABRT: a C++ thread destroyed unjoined) within 0.1 s of its
    last cell's end, both ranks then on their way out; nine relaunches here did not repeat it. The
    stack's own commands exit through close_distributed, and tests/test_runtime_distributed.py and
    tests/test_resume_exact.py run them; this worker tests training."""
    if info.distributed:
        torch.distributed.barrier()  # no rank leaves while another still trains or writes
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
