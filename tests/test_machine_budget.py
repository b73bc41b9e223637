"""A race's budgets in the store's machine-seconds (`bench.machine_budget`, issue 51): a trial on a
machine that runs its model's step faster or slower than the store's first machine trains the
budget's equivalent there (the same steps), without a dead band near 1; a step is the median over a
window, so a spell of fast steps does not set a budget; the report reads times in the store's seconds
and names records that got less work a second than their model at the lowest rung; a store of
wall-clock records is refused before anything trains."""

from __future__ import annotations

import math
from types import SimpleNamespace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bench.race as race
import bench.race_train as race_train
from bench.machine_budget import (ALLOCATOR_ENV, FIRST_TIMINGS, REANCHOR_MIN_TIMINGS, fix_allocator, machine_clock,
                                  machine_factor, median_step_seconds, store_seconds)
from bench.race_report import unequal_work
from bench.result_store import finished, record
from entry.config.load import ConfigError
from tests.test_race import BASE_S, _argv, _config, short_step_timings  # noqa: F401 (an autouse fixture)

seconds = st.floats(1e-4, 10.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(now=seconds, then=seconds, budget=st.floats(1.0, 1e4))
def test_a_budget_buys_the_store_machines_steps_on_any_other_machine(now, then, budget):
    """However close to the store's step time (no dead band: two trials on one machine never land on
    either side of a cliff), the wall budget buys as many of the model's steps as the budget bought
    on the store's machine, and the report reads it back as the budget."""
    factor = machine_factor(now, then)
    assert (budget * factor) / now == pytest.approx(budget / then)
    assert store_seconds({"machine_factor": factor}, budget * factor) == pytest.approx(budget)


@settings(max_examples=200, deadline=None)
@given(slow=st.floats(1e-3, 1.0), speedup=st.floats(1.2, 3.0), n_slow=st.integers(3, 40), data=st.data())
def test_a_spell_of_fast_steps_does_not_set_the_step_time(slow, speedup, n_slow, data):
    """A machine that runs most of a timing's steps slowly and fewer than half of them fast, in any
    order (a quiet spell), times its slow step: the trial trains at that speed. The fastest step,
    the statistic before 2026-12-01, said the fast one: the plain transformer's 240 s Burgers
    trials at 16-19 updates a second got 240 s or 344-372 s depending on it."""
    n_fast = data.draw(st.integers(0, n_slow - 1))
    steps = data.draw(st.permutations([slow] * n_slow + [slow / speedup] * n_fast))
    ends = [0.05]  # the first step (warm-up) ends the first interval's start
    for s in steps:
        ends.append(ends[-1] + s)
    assert median_step_seconds(ends) == pytest.approx(slow)
    with pytest.raises(ValueError, match="two step ends"):
        median_step_seconds(ends[:1])


def _judged(rung: float, seed: int, steps: int, train_s: float, factor: float, shape: str = "loop:one_step:b16") -> dict:
    return {"seed": seed, "steps": steps, "train_s": train_s, "machine_factor": factor, "recipe_key": f"{shape}:lr=0.001",
            "test_nrmse": 0.1}


def test_the_report_names_a_record_whose_work_a_second_differs_from_its_model_at_the_lowest_rung():
    """At 60 s the model ran 27 steps a second; at 240 s one seed was timed on a fast spell (factor 1)
    and trained 18.9 a second, the others were scaled and trained 25: the first is named, with its
    share; another loss (a different cost per step) and a record without steps are not judged; a
    record scaled too far (more work than its model at 60 s) is named too."""
    results = {(1.0, "pt"): ([_judged(1.0, s, 1620, 60.0, 1.0) for s in range(3)], []),
               (4.0, "pt"): ([_judged(4.0, 0, 4536, 240.0, 1.0), _judged(4.0, 1, 6000, 360.0, 1.5),
                              _judged(4.0, 2, 6000, 368.0, 1.53), _judged(4.0, 3, 100, 240.0, 1.0, "authors:rollout:b50"),
                              {"seed": 4, "test_nrmse": 0.2}], [])}
    assert unequal_work(results) == ["pt@4 seed 0: 0.70"]
    results[(4.0, "pt")][0][0]["machine_factor"] = 1.43  # its budget scaled as the trial ran: nothing to name
    assert unequal_work(results) == []
    results[(4.0, "pt")][0][1]["machine_factor"] = 2.5  # 6000 steps in 144 store-seconds: 41.7 a second
    assert unequal_work(results) == ["pt@4 seed 1: 1.54"]


def _ours(cap: int, seed: int, steps_run: int, stage_s: float, fixed_s: float) -> dict:
    return {"seed": seed, "steps": cap, "steps_run": steps_run, "train_s": fixed_s + stage_s, "machine_factor": 1.0,
            "stage_seconds": {"autoencoder": fixed_s - 4.0, "cache": 4.0, "operator": stage_s},
            "recipe_key": "config:config:lr=0.006", "test_nrmse": 0.2}


def test_ours_is_judged_by_the_steps_its_stage_ran_over_that_stage_s_seconds():
    """Ours pays a probe and its codec out of every budget, a share that shrinks as the budget grows,
    and its ``steps`` is its schedule's cap, not what ran: at 120 s its operator ran 458 steps in 70 s
    of 105 s, at 480 s 3232 in 470 s of 508 s, the same 6.5-6.9 a second. Steps over ``train_s``
    named all three at 480 s (1.38-1.40 on the ns2d race's records; 1.21 here); one whose stage ran
    half as fast is still named."""
    results = {(1.0, "ours"): ([_ours(1230, s, 458, 70.0, 35.0) for s in range(3)], []),
               (4.0, "ours"): ([_ours(7214, s, 3232, 470.0, 38.0) for s in range(3)], [])}
    assert unequal_work(results) == []
    results[(4.0, "ours")][0][2]["steps_run"] = 1616
    assert unequal_work(results) == ["ours@4 seed 2: 0.53"]


def test_one_lucky_or_unlucky_timing_does_not_set_a_trials_budget(tmp_path):
    """The store starts with three timings of the FNO's step (0.10, 0.14, 0.11 s: its step is their
    median, not the slow one); a later process times it three times before its first trial and once
    before each of the next. A 0.075 s timing before the fourth trial (a fast spell: the trials
    themselves train at one pace) moves its budget by the median's step, not by 0.75x; a machine that
    really is faster moves every timing, and the budgets follow it."""
    store, stamp = tmp_path / "race.jsonl", {"git_commit": "x"}
    script = iter([0.10, 0.14, 0.11,  # the store's calibration
                   0.11, 0.10, 0.12, 0.11, 0.11, 0.075])  # a process: three, then one before each trial
    clock = machine_clock(store, ["fno"], lambda m: next(script), stamp)
    budgets = [clock("fno", 480.0) for _ in range(4)]
    assert [b["step_timings"] for b in budgets] == [FIRST_TIMINGS, 4, 5, 6]
    assert [b["store_step_calibration_s"] for b in budgets] == [0.11] * 4
    assert [b["wall_budget_s"] for b in budgets] == pytest.approx([480.0, 480.0, 480.0, 480.0])
    faster = iter([0.055] * 4)  # the next session's machine runs the step twice as fast
    assert machine_clock(store, ["fno"], lambda m: next(faster), stamp)("fno", 480.0)["wall_budget_s"] == pytest.approx(240.0)
    assert [orjson.loads(x)["model"] for x in store.read_bytes().splitlines()] == ["fno@calibration"]


def test_a_store_anchored_on_a_spell_is_reanchored_to_its_trials_timings(tmp_path):
    """The FNO's store step was one slow timing (0.137 s); its trials, timed at 0.075-0.148 s, had
    a median of 0.104 s, so each got about 0.76 of its budget. Re-anchored, a trial timed at that
    median gets its whole budget; ours' probe, recorded at a factor of 0.9 against the old anchor,
    keeps the same step in seconds against the new one; a seed-0 record that repeats its chosen
    trial is one timing, not two (ten would move the median); too few timings are refused before
    anything is written."""
    store, stamp = tmp_path / "race.jsonl", {"git_commit": "x", "allocator": {}}
    record(store, "fno@calibration", 0, {"step_s": 0.137, "step_statistic": "median"} | stamp)
    record(store, "ours@calibration", 0, {"step_s": 0.0741, "step_statistic": "median"} | stamp)
    record(store, "ours@probe", race.SWEEP_SEED, {"total_s": 18.0, "machine_factor": 0.9})
    timings = [0.075, 0.09, 0.10, 0.104, 0.104, 0.11, 0.12, 0.13, 0.148]
    for i, t in enumerate(timings):
        for model in ("fno", "ours"):
            record(store, f"{model}@4@lr={i}", 0, {"step_calibration_s": t * (1 if model == "fno" else 0.7),
                                                  "step_statistic": "median", "wall_budget_s": 100.0 + i})
    record(store, "fno@4", 0, {"step_calibration_s": 0.148, "step_statistic": "median", "wall_budget_s": 108.0})
    with pytest.raises(ConfigError, match="too few for unet"):
        race.reanchor_clock(store, ["fno", "unet"], ["ours"], stamp)
    assert finished(store, "fno@calibration", 0)["step_s"] == 0.137  # nothing written
    assert len(timings) >= REANCHOR_MIN_TIMINGS
    race.reanchor_clock(store, ["fno", "ours"], ["ours"], stamp)
    assert finished(store, "fno@calibration", 0)["step_s"] == pytest.approx(0.104)
    assert finished(store, "fno@calibration", 0)["replaces_step_s"] == 0.137
    clock = machine_clock(store, ["fno"], lambda m: 0.104, stamp)
    assert clock("fno", 480.0)["wall_budget_s"] == pytest.approx(480.0)
    probe = finished(store, "ours@probe", race.SWEEP_SEED)
    new = finished(store, "ours@calibration", 0)["step_s"]
    assert new == pytest.approx(0.104 * 0.7)
    assert probe["machine_factor"] * new == pytest.approx(0.9 * 0.0741)  # the same step, in seconds
    assert race.probe_at(probe, probe["machine_factor"])["total_s"] == pytest.approx(18.0)


def test_reanchoring_a_store_with_too_few_trials_exits_2_and_writes_nothing(tmp_path, monkeypatch, capfd):
    """`bench.race --reanchor-clock` on a store whose FNO has trained fewer trials than a median
    needs (`REANCHOR_MIN_TIMINGS`) exits 2 with one line naming the model, the store untouched."""
    cfg = _config(tmp_path)
    monkeypatch.setattr(race, "peer_step_seconds", lambda net, f, device: 0.01)
    argv = _argv(tmp_path, cfg, **{"--models": "fno", "--rungs": "1"})
    assert race.main(argv) == 0
    store = tmp_path / "race.jsonl"
    before = store.read_bytes()
    capfd.readouterr()
    assert race.main([*argv, "--reanchor-clock"]) == 2
    assert "too few for fno" in capfd.readouterr().err
    assert store.read_bytes() == before


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
    seen = {}

    def fake_run(cmd, *, env, timeout_s=None):  # the pipeline's start
        assert "entry.pipeline" in cmd
        seen.update(env)
        return SimpleNamespace(returncode=1, stderr="stop here")

    monkeypatch.setattr(race, "run_child", fake_run)
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
    timings = [line.split(": ")[1].split("; ") for line in out[1:]]  # per repeat: median (fastest of n steps)
    assert all(len(t) == 2 for t in timings)
    for median, fastest in (map(float, (x.split()[0], x.split()[2])) for t in timings for x in t):
        assert 0 < fastest <= median
    assert main(["--config", cfg, "--models", "fno,nope"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0]
