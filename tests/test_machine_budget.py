"""A race's budgets in the store's machine-seconds (`bench.machine_budget`, issue 51): a trial on a
machine that runs its model's step more than 1.2x faster or slower than the store's first machine
trains the budget's equivalent there (the same steps), the report reads its times in the store's
seconds; a store of wall-clock records is refused before anything trains."""

from __future__ import annotations

import math
from types import SimpleNamespace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bench.race as race
import bench.race_train as race_train
from bench.machine_budget import ALLOCATOR_ENV, SAME_MACHINE, fix_allocator, machine_factor, store_seconds
from tests.test_race import BASE_S, _argv, _config

seconds = st.floats(1e-4, 10.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(now=seconds, then=seconds, budget=st.floats(1.0, 1e4))
def test_a_budget_buys_the_store_machines_steps_on_any_other_machine(now, then, budget):
    """Within 1.2x of the store's step time (either way) the budget is the wall clock; beyond it, the
    wall budget buys as many of the model's steps as the budget bought on the store's machine."""
    factor = machine_factor(now, then)
    if 1 / SAME_MACHINE <= now / then <= SAME_MACHINE:
        assert factor == 1.0
    else:
        assert (budget * factor) / now == pytest.approx(budget / then)
    assert store_seconds({"machine_factor": factor}, budget * factor) == pytest.approx(budget)


def test_a_step_time_that_is_not_a_positive_number_is_refused():
    for now, then in ((0.0, 1.0), (1.0, -1.0), (math.nan, 1.0), (1.0, math.inf)):
        with pytest.raises(ValueError, match="positive and finite"):
            machine_factor(now, then)


def test_ours_probe_charges_and_predicts_at_the_machine_it_runs_on():
    probe = {"probe_steps": 20, "fixed_s": 2.0, "first_step_s": 0.5, "step_s": 0.1, "total_s": 4.0,
             "machine_factor": 1.0}
    faster = race.probe_at(probe, 0.4)
    assert [faster[k] for k in ("fixed_s", "first_step_s", "step_s", "total_s")] == pytest.approx([0.8, 0.2, 0.04, 1.6])
    assert faster["probe_steps"] == 20
    assert race.probe_at(faster | {"machine_factor": 0.4}, 0.4)["total_s"] == pytest.approx(1.6)  # made there
    assert race.probe_at(probe, 1.0) == probe


def test_a_race_resumed_on_a_faster_machine_trains_the_same_work(tmp_path, monkeypatch):
    """The store starts on a machine where the FNO's step takes 10 ms; its second rung runs on one
    taking 4 ms: every trial there gets 0.4 of the budget's wall seconds, the record says so, and
    the report's train s are the store's machine-seconds with a line naming the scaled records."""
    cfg = _config(tmp_path)
    step = {"s": 0.01}
    monkeypatch.setattr(race, "peer_step_seconds", lambda net, f, device: step["s"])
    argv = _argv(tmp_path, cfg, **{"--models": "fno", "--rungs": "1"})
    assert race.main(argv) == 0
    step["s"] = 0.004  # the next session's machine, 2.5x faster at the FNO's step
    assert race.main(_argv(tmp_path, cfg, **{"--models": "fno"})) == 0
    lines = [orjson.loads(x) for x in (tmp_path / "race.jsonl").read_bytes().splitlines()]
    by_key = {r["model"]: r["payload"] for r in lines}
    assert [r["model"] for r in lines].count("fno@calibration") == 1 and by_key["fno@calibration"]["step_s"] == 0.01
    first, second = by_key["fno@1"], by_key["fno@2"]
    assert first["machine_factor"] == 1.0 and first["wall_budget_s"] == BASE_S
    assert second["machine_factor"] == pytest.approx(0.4) and second["budget_s"] == 2 * BASE_S
    assert second["wall_budget_s"] == pytest.approx(0.4 * 2 * BASE_S)
    assert second["last_step_start_s"] < second["wall_budget_s"]
    assert (second["step_calibration_s"], second["store_step_calibration_s"]) == (0.004, 0.01)
    text = (tmp_path / "race.md").read_text()
    row = next(cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in text.splitlines())
               if len(cells) == 8 and cells[:3] == ["2", "1", "fno"])
    assert float(row[6].split()[0]) == pytest.approx(second["train_s"] / 0.4, rel=1e-2)
    assert "trained on a machine that ran their model 0.40x to 0.40x as long a step" in text


def test_a_store_of_wall_clock_records_is_refused_before_anything_trains(tmp_path, monkeypatch, capfd):
    """Records trained before budgets were machine-relative (no <model>@calibration) cannot be
    resumed: a calibration taken now would not be their machine's. --report-only still reads them."""
    cfg = _config(tmp_path)
    argv = _argv(tmp_path, cfg, **{"--models": "fno", "--rungs": "1"})
    assert race.main(argv) == 0
    store = tmp_path / "race.jsonl"
    kept = [x for x in store.read_bytes().splitlines() if orjson.loads(x)["model"] != "fno@calibration"]
    store.write_bytes(b"".join(x + b"\n" for x in kept))

    def no_training(*args, **kwargs):
        raise AssertionError("trained into a wall-clock store")

    monkeypatch.setattr(race_train, "train_budgeted", no_training)
    capfd.readouterr()
    assert race.main(_argv(tmp_path, cfg, **{"--models": "fno"})) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "machine-relative" in err[0] and "fno" in err[0]
    assert store.read_bytes() == b"".join(x + b"\n" for x in kept)
    assert race.main([*argv, "--report-only"]) == 0


def test_every_race_process_runs_under_one_allocator_policy(tmp_path, monkeypatch, capfd):
    """A race's records and calibrations name the allocator policy its process ran under; ours'
    pipeline is started under it too; a store calibrated under another policy is refused."""
    cfg = _config(tmp_path)
    argv = _argv(tmp_path, cfg, **{"--models": "fno", "--rungs": "1"})
    assert race.main(argv) == 0
    store = tmp_path / "race.jsonl"
    lines = [orjson.loads(x) for x in store.read_bytes().splitlines()]
    policy = fix_allocator()
    assert all(r["payload"]["allocator"] == policy for r in lines)
    assert policy in ({}, ALLOCATOR_ENV)  # glibc's mallopt took every setting, or the platform has its own
    seen, real_run = {}, race.subprocess.run

    def fake_run(cmd, *args, env=None, **kwargs):  # the pipeline's start only; git's calls go through
        if "entry.pipeline" not in cmd:
            return real_run(cmd, *args, env=env, **kwargs)
        seen.update(env)
        return SimpleNamespace(returncode=1, stderr="stop here")

    monkeypatch.setattr(race.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="stop here"):
        race.run_pipeline(SimpleNamespace(config=cfg, overrides=[]), [])
    assert {k: seen[k] for k in ALLOCATOR_ENV} == ALLOCATOR_ENV
    for rec in lines:
        if rec["model"] == "fno@calibration":
            rec["payload"]["allocator"] = {}
    store.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    capfd.readouterr()
    assert race.main(_argv(tmp_path, cfg, **{"--models": "fno"})) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another allocator policy" in err[0]


def test_the_calibration_command_times_each_model_in_order_and_refuses_unknown_ones(tmp_path, capfd):
    from bench.machine_budget import main

    cfg = _config(tmp_path)
    assert race.main(_argv(tmp_path, cfg, **{"--models": "fno", "--rungs": "1"})) == 0  # the data
    capfd.readouterr()
    assert main(["--config", cfg, "--models", "fno,ours,fno", "--repeats", "2"]) == 0
    out = capfd.readouterr().out.splitlines()
    assert out[0].startswith("allocator:") and [line.split(":")[0] for line in out[1:]] == ["fno", "ours", "fno"]
    assert all(len(line.split(": ")[1].split(",")) == 2 for line in out[1:])
    assert main(["--config", cfg, "--models", "fno,nope"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0]
