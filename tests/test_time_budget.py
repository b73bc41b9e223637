"""`training.max_train_s`: a stage ends before a step that would take its training clock past the
budget, and ends as it would after its last step (a metrics line, a checkpoint of that step).
bench.race relies on it so that our model, like every peer, never trains past its budget."""

from __future__ import annotations

import dataclasses
import logging
import time

from entry.distributed import hooks
from entry.training import checkpoint as ckpt
from entry.training.loop import train_stage
from tests.test_hooks import tiny_stage

PAUSE_S, BUDGET_S, STEPS = 0.2, 3.0, 200


class SlowSteps(hooks.Listener):
    """Makes every step last at least PAUSE_S, so the budget bites long before STEPS steps on any machine."""

    def __init__(self):
        self.steps = 0

    def before_step(self, stage, rank, step, attempt):
        self.steps += 1
        time.sleep(PAUSE_S)


class Lines:
    def __init__(self):
        self.lines: list[tuple[int, dict]] = []

    def log(self, step: int, values: dict) -> None:
        self.lines.append((step, dict(values)))


def test_a_stage_stops_within_its_time_budget_and_checkpoints_its_last_step(tmp_path):
    from entry.stages.stage_build import cosine_schedule

    parts, settings, info = tiny_stage(tmp_path)
    parts = dataclasses.replace(parts, scheduler=cosine_schedule(parts.optimizer, steps=STEPS, warmup=0))
    settings = dataclasses.replace(settings, steps=STEPS, max_train_s=BUDGET_S, log_every=1000)
    sink, ckpt_dir = Lines(), tmp_path / "ckpt"
    with hooks.listening(SlowSteps()) as slow:
        last = train_stage(parts, settings, info, run_dir=tmp_path / "run", ckpt_dir=ckpt_dir,
                           logger=logging.getLogger("budget"), sink=sink, on_oom="fail", resume=False)
    assert 2 <= slow.steps < STEPS
    assert last["train_wall_s"] <= BUDGET_S
    assert last["step"] == slow.steps  # what the runner's "finished at step N of M" line reports
    # The last step's metrics line is written (log_every never fell due) and its checkpoint is the newest.
    assert [step for step, _ in sink.lines] == [slow.steps]
    # Annealed to its steps, not to its budget: the rate is still near its peak.
    assert sink.lines[-1][1]["lr"] / parts.scheduler.base_lrs[0] > 0.9
    assert ckpt.read_loop_state(ckpt.latest_checkpoint(ckpt_dir), 0)[ckpt.KEY_STEP] == slow.steps


def test_without_a_budget_every_step_runs(tmp_path):
    parts, settings, info = tiny_stage(tmp_path)
    with hooks.listening(SlowSteps()) as slow:
        train_stage(parts, settings, info, run_dir=tmp_path / "run", ckpt_dir=tmp_path / "ckpt",
                    logger=logging.getLogger("budget"), sink=Lines(), on_oom="fail", resume=False)
    assert slow.steps == settings.steps


def test_a_time_annealed_stage_ends_its_budget_at_the_schedules_floor(tmp_path):
    """`training.anneal_to: time`: the stage its budget stops ends with its learning rate decayed
    (the floor is 10% of the peak); annealed to its 200 steps it would still be near its peak after
    the dozen or so that fit (`test_a_stage_stops_within_its_time_budget_and_checkpoints_its_last_step`)."""
    from entry.stages.stage_build import cosine_schedule

    parts, settings, info = tiny_stage(tmp_path)
    parts = dataclasses.replace(parts, scheduler=cosine_schedule(parts.optimizer, steps=STEPS, warmup=0))
    settings = dataclasses.replace(settings, steps=STEPS, max_train_s=BUDGET_S, log_every=1000, anneal_to_time=True)
    sink = Lines()
    with hooks.listening(SlowSteps()) as slow:
        train_stage(parts, settings, info, run_dir=tmp_path / "run", ckpt_dir=tmp_path / "ckpt",
                    logger=logging.getLogger("budget"), sink=sink, on_oom="fail", resume=False)
    assert slow.steps < STEPS / 4
    # The last step starts with at most one step's length of the budget left: 0.2-0.5 s of 3 s.
    assert sink.lines[-1][1]["lr"] / parts.scheduler.base_lrs[0] < 0.2


def test_time_annealing_needs_a_budget_and_one_process(tmp_path):
    import pytest

    from entry.config.load import ConfigError, load_config
    from entry.stages.record import stage_spec
    from entry.training.runner import check_world_size
    from tests.tiny_run import tiny_tree

    tree = tiny_tree(tmp_path)
    tree["training"]["anneal_to"] = "time"
    with pytest.raises(ConfigError, match="training.max_train_s"):
        load_config(tree=tree)
    tree["training"]["max_train_s"] = 10.0
    cfg = load_config(tree=tree)
    operator = stage_spec("operator")
    check_world_size(operator, cfg, 1)
    with pytest.raises(ConfigError, match="training.anneal_to=time runs in one process"):
        check_world_size(operator, cfg, 2)
