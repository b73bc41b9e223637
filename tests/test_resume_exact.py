"""A resumed run equals the uninterrupted one bitwise, also when the checkpoint it resumes
from was written right after an epoch's last batch (issue 17, item 1), at 1 and 2 ranks."""

from __future__ import annotations

import logging

import orjson
import pytest
import torch
from tensordict import TensorDict
from torch import nn

from entry.distributed import DistInfo
from entry.train_loop import LoopSettings, StageParts, train_stage
from pipelines.loader import build_loader
from pipelines.samplers import BatchSampler, DistributedIndexSampler
from tests import tiny_run as tr

INFO = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)
BATCHES_PER_EPOCH = 5


class _Rows:
    """20 rows of a linear-regression set; `gather` returns a batch with the rows' ids."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(20, 3, generator=g), torch.randn(20, 1, generator=g)

    def __len__(self):
        return 20

    def gather(self, indices):
        ix = torch.as_tensor(indices)
        return TensorDict({"x": self.x[ix], "y": self.y[ix], "id": ix}, batch_size=[len(indices)])


def _parts(seen: list[list[int]]) -> StageParts:
    def step(model, params, batch, *, cfg, generator):
        seen.append(batch["id"].tolist())
        loss = (model(batch["x"]) - batch["y"]).square().mean()
        return loss, TensorDict({"mse": loss.detach()}, batch_size=[])

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)  # the same at any total step count
    sampler = BatchSampler(DistributedIndexSampler(20, rank=0, world_size=1, seed=3), 4)
    loader = build_loader(_Rows(), sampler, num_workers=0, prefetch_factor=1, pin_memory=False)
    assert len(loader) == BATCHES_PER_EPOCH
    return StageParts("toy", model, step, None, loader, opt, sched)


def _train(tmp_path, steps: int, seen: list) -> nn.Module:
    parts = _parts(seen)
    settings = LoopSettings(steps=steps, per_rank_batch=4, accum_steps=1, grad_clip=0.0, max_skips_in_a_row=1,
                            checkpoint_every=BATCHES_PER_EPOCH, keep_checkpoints=2, log_every=1, seed=0)
    sink = type("Sink", (), {"log": lambda self, step, values: None})()
    try:
        train_stage(parts, settings, INFO, run_dir=tmp_path, ckpt_dir=tmp_path / "ckpt",
                    logger=logging.getLogger("test_resume_exact"), sink=sink, on_oom="fail")
    finally:
        parts.loader.close()
    return parts.model


def test_resume_at_an_epoch_boundary_is_bitwise_one_rank(tmp_path):
    whole_seen: list = []
    whole = _train(tmp_path / "whole", 8, whole_seen)
    # Stop exactly at the end of epoch 0 (its checkpoint is the last thing written), then resume.
    first_seen, rest_seen = [], []
    _train(tmp_path / "split", BATCHES_PER_EPOCH, first_seen)
    resumed = _train(tmp_path / "split", 8, rest_seen)
    assert first_seen + rest_seen == whole_seen  # epoch 1's batches, not epoch 0's again
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_exact")
    tr.prepare(root)
    return root


def _steps_logged(root, name) -> list[int]:
    lines = (root / "runs" / name / "metrics.jsonl").read_bytes().splitlines()
    return [rec["step"] for rec in map(orjson.loads, lines) if rec["stage"] == "operator" and "loss" in rec]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_at_an_epoch_boundary_is_bitwise_two_ranks(root):
    # The tiny run has 21 batches per epoch at 1 and 2 ranks: checkpoints at the epoch's end.
    args = ["--set", "operator.steps=24", "--set", "training.checkpoint_every=21"]
    whole = tr.launch(root, [*tr.new_run(root, "whole"), *args], nproc=2)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "21 batches per epoch" in (root / "runs" / "whole" / "rank0.log").read_text()
    killed = tr.launch(root, [*tr.new_run(root, "killed"), *args], nproc=2, max_restarts=1,
                       fault="kill@rank=1,step=23")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "step_00000021" in (root / "runs" / "killed" / "rank0.log").read_text()
    a, b = tr.final_weights(root, "whole"), tr.final_weights(root, "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The failed attempt's lines after the checkpoint are replaced, not repeated.
    assert _steps_logged(root, "killed") == _steps_logged(root, "whole") == list(range(1, 25))
