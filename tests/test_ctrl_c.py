"""Ctrl-C saves like SIGTERM (issue 29): SIGINT during training makes every rank checkpoint at the
same step and exit 143, and a resumed run ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import logging
import os
import re
import signal

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from entry.distributed.process_group import DistInfo
from entry.training.loop import Preempted, train_stage
from entry.training.step import LoopSettings, StageParts
from pipelines.loader import build_loader
from pipelines.samplers import BatchSampler, DistributedIndexSampler
from tests import tiny_run as tr
from tests.faults import fault_env
from tests.toy_rows import Rows

INFO = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)


def _train(folder, *, interrupt_at: int | None = None) -> nn.Module:
    """8 steps of a toy stage in `folder` (resuming what is there); with `interrupt_at`, the
    process sends itself SIGINT during that step (0-based). Returns the model."""
    calls = []

    def step(model, params, batch, *, cfg, generator):
        if len(calls) == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does, mid-step
        calls.append(1)
        loss = (model(batch["x"]) - batch["y"]).square().mean()
        return loss, TensorDict({"mse": loss.detach()}, batch_size=[])

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    loader = build_loader(Rows(), BatchSampler(DistributedIndexSampler(20, rank=0, world_size=1, seed=3), 4),
                          num_workers=0, prefetch_factor=1, pin_memory=False)
    settings = LoopSettings(steps=8, per_rank_batch=4, accum_steps=1, grad_clip=0.0, max_skips_in_a_row=1,
                            checkpoint_every=100, keep_checkpoints=2, log_every=1, seed=0)
    sink = type("Sink", (), {"log": lambda self, step, values: None})()
    try:
        train_stage(StageParts("toy", model, step, None, loader, opt, sched), settings, INFO, run_dir=folder,
                    ckpt_dir=folder / "ckpt", logger=logging.getLogger("test_ctrl_c"), sink=sink, on_oom="fail")
    except KeyboardInterrupt:
        pytest.fail("SIGINT raised KeyboardInterrupt inside training instead of stopping at a checkpoint")
    finally:
        loader.close()
    return model


def test_sigint_checkpoints_at_the_next_step_and_resumes_bitwise(tmp_path):
    whole = _train(tmp_path / "whole")
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(Preempted, match="SIGINT received; checkpoint written at step 5"):
        _train(tmp_path / "split", interrupt_at=3)  # in step 4 (of 1..8); the next step agrees on it
    assert signal.getsignal(signal.SIGINT) is before  # the previous handler is back
    assert [p.name for p in sorted((tmp_path / "split" / "ckpt").iterdir())] == ["step_00000005"]
    assert (tmp_path / "split" / "ckpt" / "step_00000005" / "COMPLETE").is_file()
    resumed = _train(tmp_path / "split")
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))


@pytest.mark.timeout(120)
def test_ctrl_c_on_a_stage_command_checkpoints_and_exits_143(tmp_path):
    tr.prepare(tmp_path)
    name = "ctrl_c"
    env = fault_env(tr.env(), "sleep@rank=0,step=3,seconds=3")  # holds it still at step 3
    log, returncode = tr.signal_the_operator_at_step_3(tmp_path, name, signal.SIGINT, env=env, timeout_s=60)
    assert returncode == 143
    text = log.read_text()
    stopped = re.search(r"operator: SIGINT received; checkpoint written at step (\d+); exiting with 143", text)
    assert stopped, text[-3000:]
    ckpts = sorted((tmp_path / "runs" / name / "checkpoints" / "operator").glob("step_*"))
    assert [c.name for c in ckpts] == [f"step_{int(stopped.group(1)):08d}"] and (ckpts[0] / "COMPLETE").is_file()
