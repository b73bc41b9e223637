"""Fault injection reaches the code through one seam, entry/distributed/hooks.py: the step, the loop
and the data readers name no fault, an in-process listener hears the events with the right stage
and step, and the fault listener keeps the variable's semantics (stage, attempt, host syncs)."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest
import torch

from entry.config.load import load_config
from entry.config.recipe import resolve_config
from entry.distributed import hooks
from tests import faults
from entry.distributed.precision import compute_autocast
from entry.distributed.process_group import DistInfo
from entry.training.loop import train_stage
from entry.stages.stage_build import cosine_schedule
from entry.training.step import LoopSettings, StageParts
from tests.recipe_worker import GlobalBatches, cell_tree, synthetic_pairs
from tests.test_host_syncs import HostReads

ROOT = Path(__file__).resolve().parents[1]
SEAMED = ("entry/training/step.py", "entry/training/loop.py", "entry/data/files.py", "entry/data/latent_cache.py")
STEPS, ACCUM = 4, 2


def fault_names(path: Path) -> list[str]:
    """Every mention of a fault in `path`: words `fault`/`faults` (comments included) and imports
    of the fault module."""
    text = path.read_text()
    found = re.findall(r"\bfaults?\b", text, flags=re.IGNORECASE)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [f"{node.module}.{a.name}" for a in node.names if "fault" in f"{node.module}.{a.name}"]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if "fault" in a.name]
    return found


@pytest.mark.parametrize("relative", SEAMED)
def test_the_step_the_loop_and_the_data_readers_name_no_fault(relative):
    assert fault_names(ROOT / relative) == []


def test_no_product_module_names_the_fault_module():
    """The fault injection is the tests' (tests/faults.py, installed by tests/fault_site): nothing in
    the product or the benchmarks imports it."""
    importers = set()
    for pkg in ("core", "pipelines", "entry", "bench"):
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = ([f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom)
                         and node.module else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                if any("faults" in n.split(".") for n in names):
                    importers.add(str(path.relative_to(ROOT)))
    assert importers == set()
    assert not (ROOT / "entry" / "distributed" / "faults.py").exists()


def test_the_check_sees_a_fault(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from entry.distributed import faults\nx = 1  # default, faulthandler\n")
    assert fault_names(src) == ["faults", "entry.distributed.faults"]


class Recorder(hooks.Listener):
    """Records the events it hears."""

    def __init__(self):
        self.steps: list[tuple[str, int, int, int]] = []
        self.losses: list[tuple[str, int]] = []
        self.units = 0

    def before_step(self, stage, rank, step, attempt):
        self.steps.append((stage, rank, step, attempt))

    def loss(self, stage, rank, step, attempt, loss):
        self.losses.append((stage, step))
        return loss

    def model_ready(self, stage, units, rank, attempt, now):
        self.units = len(units)
        return []


class NoSink:
    """The metrics sink, discarding."""

    def log(self, step: int, values: dict) -> None:
        pass


def tiny_stage(tmp_path, name: str = "operator"):
    """(parts, settings, info) of a tiny operator stage: STEPS optimizer steps of ACCUM micro-steps."""
    from core.steps.operator import OperatorStepConfig, operator_step
    from entry.models.build import build_operator
    from entry.stages.stage_build import place_model

    cfg = resolve_config(load_config(tree=cell_tree(tmp_path, "fp32-none-eager")), cuda=False)
    info = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)
    torch.manual_seed(0)
    model = place_model(lambda: build_operator(cfg), cfg, info)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    parts = StageParts(name, model, operator_step, OperatorStepConfig(input_noise=0.01),
                       GlobalBatches(synthetic_pairs(), info), optimizer, cosine_schedule(optimizer, steps=STEPS, warmup=0))
    settings = LoopSettings(steps=STEPS, per_rank_batch=8, accum_steps=ACCUM, grad_clip=1.0, max_skips_in_a_row=3,
                            checkpoint_every=1000, keep_checkpoints=1, log_every=1000, seed=0,
                            autocast=lambda: compute_autocast(info.device, "fp32"))
    return parts, settings, info


def run_tiny_stage(tmp_path, name: str = "operator", parts=None) -> StageParts:
    """Train `tiny_stage` (or the one given) through `train_stage`; returns its parts."""
    parts, settings, info = tiny_stage(tmp_path, name) if parts is None else parts
    train_stage(parts, settings, info, run_dir=tmp_path / "run", ckpt_dir=tmp_path / "ckpt",
                logger=logging.getLogger("hooks"), sink=NoSink(), on_oom="fail", resume=False)
    return parts


def test_an_installed_listener_hears_every_step_and_loss_and_is_removed_after(tmp_path):
    before = hooks.listeners()
    with hooks.listening(Recorder()) as heard:
        assert hooks.listeners() == (*before, heard)
        run_tiny_stage(tmp_path, "operator")
    assert hooks.listeners() == before
    assert heard.steps == [("operator", 0, s, 0) for s in range(STEPS)]
    assert heard.losses == [("operator", s) for s in range(STEPS) for _ in range(ACCUM)]
    assert heard.units >= 1


def test_an_error_fault_fires_at_its_step_through_the_forward_hook_and_is_disarmed(tmp_path):
    stage = tiny_stage(tmp_path)
    with faults.injected(faults.parse_fault("error@rank=0,step=2,stage=operator")) as injector:
        with pytest.raises(RuntimeError, match=r"injected error \(rank 0, step 2\)"):
            run_tiny_stage(tmp_path, parts=stage)
    assert injector not in hooks.listeners()
    assert all(not m._forward_pre_hooks for m in stage[0].model.modules())  # the loop removed what it armed
    run_tiny_stage(tmp_path / "again")  # nothing listens any more: the stage runs clean


def test_a_fault_for_another_stage_or_attempt_does_not_fire(tmp_path):
    for text in ("error@rank=0,step=1,stage=diffusion", "error@rank=0,step=1,attempt=1", "error@rank=1,step=1"):
        with faults.injected(faults.parse_fault(text)):
            run_tiny_stage(tmp_path / text.replace("=", "-").replace(",", "_"))


def test_stage_rules_data_only_when_named_cache_like_any_stage():
    anywhere = faults.parse_fault("sleep@rank=0,step=0")
    assert anywhere.applies_to("operator") and anywhere.applies_to("cache") and not anywhere.applies_to("data")
    data = faults.parse_fault("sleep@rank=0,stage=data,seconds=1")
    assert data.applies_to("data") and not data.applies_to("operator")
    repeat = faults.parse_fault("nan@rank=1,step=2,repeat=1")
    assert [repeat.due(1, s, 0) for s in range(4)] == [False, False, True, True] and not repeat.due(0, 3, 0)


def test_the_nan_fault_reads_nothing_back():
    """tests/test_host_syncs.py's rule: the fault multiplies on the device, the loop's read stays the only one."""
    injector = faults.FaultInjector(faults.parse_fault("nan@rank=0,step=3"))
    loss = torch.ones(())
    with HostReads() as reads:
        poisoned = injector.loss("operator", 0, 3, 0, loss)
        kept = injector.loss("operator", 0, 2, 0, loss)
    assert reads.count == 0
    assert torch.isnan(poisoned) and kept is loss


def test_the_variable_is_installed_once_per_process(monkeypatch):
    monkeypatch.setattr(faults, "_from_env", [])
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.install_from_env() is None
    monkeypatch.setenv(faults.ENV, "term@rank=3,step=9,stage=operator")
    first = faults.install_from_env()
    try:
        assert faults.install_from_env() is first and hooks.listeners().count(first) == 1
        assert first.fault == faults.Fault(kind="term", rank=3, step=9, stage="operator")
    finally:
        faults.uninstall(first)
    assert first not in hooks.listeners()


def test_the_data_generation_and_the_cache_build_tell_their_stage(tmp_path):
    from entry.data.files import prepare_data_files
    from tests import tiny_run as tr

    with hooks.listening(Recorder()) as heard:
        cfg = load_config(tr.prepare(tmp_path))  # builds the training cache in this process
        blocks = len(heard.steps)
        prepare_data_files(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None, 0), logging.getLogger("hooks"),
                           progress=False)
    assert blocks >= 1 and heard.steps[:blocks] == [("cache", 0, b, 0) for b in range(blocks)]
    assert heard.steps[blocks:] == [("data", 0, 0, 0)]
