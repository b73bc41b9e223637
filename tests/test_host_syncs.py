"""The training loop reads the device back at most once per optimizer step (a logging step may add
one): every read (`.item()`, `.tolist()`, `bool(t)`, ...) waits for the GPU to finish the queued
work, so each one stalls the pipeline.

On CPU the reads are counted by two interposers: a TorchFunctionMode sees the Python-level reads
(`tolist` and `numpy` never reach the dispatcher on CPU) and a TorchDispatchMode sees
`aten._local_scalar_dense` and `aten.equal` issued inside C++ (a read inside a counted Python call
is not counted twice). On CUDA, `torch.cuda.set_sync_debug_mode` reports every synchronising call,
blocking host-to-device copies included.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from entry.config.load import load_config
from entry.config.recipe import resolve_config
from entry.distributed.precision import compute_autocast
from entry.distributed.process_group import DistInfo
from entry.training.loop import train_stage
from entry.stages.stage_build import cosine_schedule
from entry.training.step import LoopSettings, StageParts
from tests.recipe_worker import GlobalBatches, cell_tree, synthetic_pairs

STEPS, LOG_EVERY = 7, 3
_PYTHON_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
                 torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.__array__}
_DISPATCH_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default}


class HostReads:
    """Counts device-to-host reads while active (`with HostReads() as reads: ...; reads.count`)."""

    def __init__(self):
        self.count, self._inside = 0, 0
        counter = self

        class Python(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func not in _PYTHON_READS:
                    return func(*args, **(kwargs or {}))
                counter.count += 1
                counter._inside += 1
                try:
                    return func(*args, **(kwargs or {}))
                finally:
                    counter._inside -= 1

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in _DISPATCH_READS and not counter._inside:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self._modes = contextlib.ExitStack()
        self._python, self._dispatch = Python(), Dispatch()

    def __enter__(self) -> HostReads:
        self._modes.enter_context(self._python)
        self._modes.enter_context(self._dispatch)
        return self

    def __exit__(self, *exc) -> None:
        self._modes.close()


class _Sink:
    def __init__(self):
        self.lines: list[tuple[int, dict]] = []

    def log(self, step: int, values: dict) -> None:
        self.lines.append((step, values))


def _run_loop(tmp_path, device: torch.device, count_reads) -> tuple[list[int], _Sink]:
    """STEPS optimizer steps of a tiny operator (2 micro-steps each, input noise on) through
    `train_stage`; returns the number of reads `count_reads()` saw up to each optimizer step's end."""
    from core.steps.operator import OperatorStepConfig, operator_step
    from entry.models.build import build_operator
    from entry.stages.stage_build import place_model

    cfg = resolve_config(load_config(tree=cell_tree(tmp_path, "fp32-none-eager")), cuda=device.type == "cuda")
    info = DistInfo(0, 1, 0, device, None, 0)
    model = place_model(lambda: build_operator(cfg), cfg, info)
    # Fused AdamW, as entry.stages.stage_build.optimizer_for uses on CUDA: its step counters live on the
    # device, so it reads nothing back (the CPU default, foreach, keeps them on the host).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    marks: list[int] = []
    data = synthetic_pairs()
    parts = StageParts("operator", model, operator_step, OperatorStepConfig(input_noise=0.01),
                       GlobalBatches(data.pin_memory() if device.type == "cuda" else data, info), optimizer,
                       cosine_schedule(optimizer, steps=STEPS, warmup=0),
                       after_step=lambda: marks.append(count_reads()))
    settings = LoopSettings(steps=STEPS, per_rank_batch=8, accum_steps=2, grad_clip=1.0, max_skips_in_a_row=1,
                            checkpoint_every=1000, keep_checkpoints=1, log_every=LOG_EVERY, seed=0,
                            autocast=lambda: compute_autocast(device, "fp32"))
    sink = _Sink()
    train_stage(parts, settings, info, run_dir=tmp_path / "run", ckpt_dir=tmp_path / "ckpt",
                logger=logging.getLogger("host-syncs"), sink=sink, on_oom="fail", resume=False)
    return marks, sink


def _allowed(step: int) -> int:
    """Reads allowed between the ends of optimizer steps step - 1 and step: one, plus one when
    step - 1 wrote a metrics line."""
    return 1 + ((step - 1) % LOG_EVERY == 0)


def test_one_host_read_per_optimizer_step(tmp_path):
    with HostReads() as reads:
        marks, sink = _run_loop(tmp_path, torch.device("cpu"), lambda: reads.count)
    assert len(marks) == STEPS  # no step was skipped
    assert [step for step, _ in sink.lines] == [3, 6, 7]
    for step in range(2, STEPS + 1):  # step 1's interval also holds the loop's set-up
        seen = marks[step - 1] - marks[step - 2]
        # >= 1: the counter does see the loop's one read (a counter that saw nothing would pass too).
        assert 1 <= seen <= _allowed(step), (step, seen)


def test_counter_sees_every_kind_of_read():
    x = torch.ones(3)
    with HostReads() as reads:
        x.tolist(), x.sum().item(), bool(x.sum() > 0), float(x.sum()), int(x.sum()), x.numpy()
        torch.equal(x, x)
        torch.nn.functional.normalize(x, dim=0)  # no read
    assert reads.count == 7


@pytest.mark.cuda
def test_one_device_sync_per_optimizer_step_on_cuda(tmp_path):
    """The same loop on a GPU: count the synchronising calls CUDA's sync debug mode reports."""
    seen: list[str] = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            def count() -> int:
                seen.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))
                caught.clear()
                return len(seen)

            marks, _ = _run_loop(tmp_path, torch.device("cuda", 0), count)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    assert len(marks) == STEPS
    for step in range(2, STEPS + 1):
        assert marks[step - 1] - marks[step - 2] <= _allowed(step), (step, seen)
