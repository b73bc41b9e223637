"""`python -m bench.race` (issues 31, 51) on a tiny generated 1D task: one record per model, rung
and seed plus each rung's recipe choice, each naming its commit and data, a re-run that trains
nothing, budgets kept, the report's "not reached", one-line user errors; and the arithmetic of
ours' step count and times. The recipe grid itself: tests/test_race_recipes.py.

The race runs once per module (about 15 s of training on 2 cores), in this process."""

from __future__ import annotations

import math
import os
import shlex
import subprocess
from types import SimpleNamespace

import orjson
import pytest
import torch
import yaml

import bench.machine_budget as machine_budget
import bench.provenance as provenance
import bench.race as race
import bench.race_train as race_train
from bench.budget import TARGETS
from entry.config.load import load_config
from entry.data.files import data_inputs
from entry.models.build import build_operator

MODELS = ("fno", "unet", "plain_transformer")
BASE_S, RUNGS = 0.5, (1, 2)


@pytest.fixture(scope="module", autouse=True)
def short_step_timings():
    """Each model's step timed over 0.05 s of training, not a race's seconds
    (`bench.machine_budget.CALIBRATION_S`): the tiny race's trials train for 0.5 s."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(machine_budget, "CALIBRATION_S", 0.05)
        yield


def _config(root) -> str:
    tree = {
        "data": {"root": str(root / "data"), "generate_if_missing": True, "tasks": [
            {"name": "advection1d", "param": 0.1, "samples": 20, "nx": 64, "nt": 21, "reduce_x": 2, "reduce_t": 2,
             "initial_step": 3}]},
        "latent": {"tokens": 16, "dim": 8, "hidden": 16},
        "operator": {"pdet": {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2, "group_size": 4}},
        "training": {"parallel": "none", "num_workers": 0, "cache_dir": str(root / "cache")},
        "evaluation": {"val_samples": 2},
        "logging": {"run_dir": str(root / "runs"), "run_name": "tiny", "progress": False, "plots": False,
                    "wandb": {"mode": "disabled"}},
    }
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def _argv(root, cfg: str, **more) -> list[str]:
    args = {"--base-s": str(BASE_S), "--rungs": ",".join(map(str, RUNGS)), "--sweep-rungs": "1,2",
            "--models": ",".join(MODELS), "--seeds": "0", "--lr-sweep": "1", "--lr-extensions": "0",
            "--peer-loss": "one_step", "--batches": "8", "--out": str(root / "race.jsonl"),
            "--report": str(root / "race.md")} | more
    # --allow-dirty: the tests run from a work tree that may hold uncommitted changes (the refusal
    # itself: test_a_dirty_tree_is_refused_and_nothing_is_written)
    return ["--config", cfg, *[x for kv in args.items() for x in kv], "--allow-dirty"]


@pytest.fixture(scope="module")
def raced(tmp_path_factory):
    """(folder, config, records [(key, seed, payload)], the result file's bytes, the report)."""
    root = tmp_path_factory.mktemp("race")
    cfg = _config(root)
    assert race.main(_argv(root, cfg)) == 0
    data = (root / "race.jsonl").read_bytes()
    records = [(r["model"], r["seed"], r["payload"]) for r in map(orjson.loads, data.splitlines())]
    return root, cfg, records, data, (root / "race.md").read_text()


def test_one_record_per_model_rung_and_seed_plus_each_rungs_recipe_choice(raced):
    root, cfg, records, _, _ = raced
    keys = [(key, seed) for key, seed, _ in records]
    assert len(keys) == len(set(keys)), "a result was recorded twice"
    by_key = {key: payload for key, _, payload in records}
    fingerprint = next(iter(data_inputs(load_config(cfg)).values()))
    for model in MODELS:
        for rung in RUNGS:
            choice = by_key[f"{model}@{rung}@recipe"]
            scores = {c["key"]: c["val_nrmse_kept"] for c in choice["candidates"]}
            assert len(scores) >= 2 and choice["chosen_key"] == min(scores, key=scores.get)  # chosen on validation
            assert {c["recipe"]["name"] for c in choice["candidates"]} >= {"authors", "loop"}
            r = by_key[f"{model}@{rung}"]
            assert (r["model"], r["seed"], r["rung"]) == (model, 0, rung)
            assert choice["chosen_key"] == f"{model}@{rung}@{r['recipe_key']}"  # trained with its rung's choice
            assert r == by_key[choice["chosen_key"]]  # a sweep rung's seed-0 run is the chosen trial itself
            assert math.isfinite(r["test_nrmse"]) and r["test"]["n_samples"] == 2
            assert r["steps"] >= 1 and r["val_curve"] and r["val_nrmse_final"] == r["val_curve"][-1][1]
            # a referee's record: the code and the data it was made from
            assert len(r["git_commit"]) == 40 and r["data_fingerprint"] == fingerprint and "dirty" in r
            assert r["processor"] == provenance.processor_name(torch.device("cpu"))  # finer than "cpu-2core"
            assert r["machine_forward_s"] > 0  # the machine's speed before its clock started
        assert by_key[f"{model}@2@recipe"]["lower"] == by_key[f"{model}@1@recipe"]["chosen"]  # offered above
    rung_keys = {key for key, _ in keys if key.count("@") == 1 and "probe" not in key and "calibration" not in key}
    assert rung_keys == {f"{m}@{g}" for m in MODELS for g in RUNGS}
    # each model's step timed once on the machine that started the store (bench.machine_budget)
    assert all(by_key[f"{m}@calibration"]["step_s"] > 0 for m in MODELS)
    # the plain transformer is sized to our operator
    target = sum(p.numel() for p in build_operator(load_config(cfg)).parameters())
    pt = by_key["plain_transformer@2"]
    assert pt["params_target"] == target and abs(pt["params"] - target) < 0.2 * target


def test_a_second_invocation_trains_nothing(raced, monkeypatch):
    root, cfg, _, data, text = raced

    def no_training(*args, **kwargs):
        raise AssertionError("a recorded model was trained again")

    monkeypatch.setattr(race_train, "train_budgeted", no_training)
    assert race.main(_argv(root, cfg)) == 0
    assert (root / "race.jsonl").read_bytes() == data  # no new line, nothing rewritten
    assert (root / "race.md").read_text() == text
    assert (root / "race.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the budget plot beside the report


def test_report_only_reports_a_partial_ladder_and_trains_nothing(raced, tmp_path, monkeypatch):
    """A race of days is read while it runs: --report-only writes the report of what the store holds
    (a rung not raced yet shows "—") and trains, probes and records nothing."""
    root, cfg, _, data, _ = raced

    def no_training(*args, **kwargs):
        raise AssertionError("--report-only trained")

    monkeypatch.setattr(race_train, "train_budgeted", no_training)
    monkeypatch.setattr(race, "run_pipeline", no_training)
    rungs = ",".join(map(str, (*RUNGS, 8)))
    argv = _argv(root, cfg, **{"--rungs": rungs, "--report": str(tmp_path / "partial.md")})
    assert race.main([*argv, "--report-only"]) == 0
    assert (root / "race.jsonl").read_bytes() == data
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in (tmp_path / "partial.md").read_text().splitlines()]
    times = {(r[0], r[1]): r[2:] for r in rows if len(r) == 2 + len(TARGETS) and r[1] in MODELS}
    assert {k for k in times if k[0] == "8"} == {("8", m) for m in MODELS}
    assert all(cells == ["—"] * len(TARGETS) for (rung, _), cells in times.items() if rung == "8")
    assert (tmp_path / "partial.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rungs_run_with_another_recipe_than_the_recorded_choice_are_refused(raced, tmp_path, capsys):
    """A choice made again after the rungs ran (the choice's record removed, another winner) must
    not leave rung records of the old recipe to be reused as the new choice's."""
    root, cfg, _, data, _ = raced
    lines = [orjson.loads(x) for x in data.splitlines()]
    for rec in lines:
        if rec["model"] == "unet@1@recipe":
            rec["payload"]["chosen"]["lr"] = 0.01
    store = tmp_path / "race.jsonl"
    store.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    assert race.main(_argv(root, cfg, **{"--out": str(store), "--report": str(tmp_path / "r.md")})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unet@1 seed 0 trained with the recipe" in err[0] and "recorded choice" in err[0]


def test_a_store_keeps_one_selection_of_weights(raced, capsys):
    """Every record says which weights it kept and their validation (the last, by default); a race
    with --select best refuses a store of last-weight records rather than mixing the two."""
    root, cfg, records, data, _ = raced
    for key, _, r in records:
        if "val_curve" in r:
            assert r["select"] == "last" and r["val_nrmse_kept"] == r["val_curve"][-1][1], key
    capsys.readouterr()
    assert race.main(_argv(root, cfg) + ["--select", "best"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "keeping its last weights, not --select best" in err[0]
    assert (root / "race.jsonl").read_bytes() == data
    assert race.kept_validation([(1.0, 0.3), (2.0, 0.1), (3.0, 0.2)], "best") == {"select": "best",
                                                                                  "val_nrmse_kept": 0.1}


def test_every_run_trains_within_its_budget(raced):
    # The stop rule itself is tested exactly with a fake clock (test_budget_race); on a real clock
    # a step can stall beyond every step before it (a busy machine: 2.9 s for a 0.5 s budget was
    # seen), so here no step may start past the budget and a run says truthfully whether it
    # stayed within it, whatever the machine's speed.
    # The budget is in the store's machine-seconds; a run trains its wall-clock equivalent on this
    # machine (the same seconds unless its model's step ran 1.2x faster or slower than at the
    # store's start: bench.machine_budget).
    for key, _, r in raced[2]:
        if "train_s" in r:
            assert r["budget_s"] == BASE_S * r["rung"], key
            assert r["wall_budget_s"] == pytest.approx(r["budget_s"] * r["machine_factor"]), key
            assert 0 <= r["last_step_start_s"] < r["wall_budget_s"] and r["train_s"] > 0, key
            assert r["within_budget"] == (r["train_s"] <= r["wall_budget_s"]), key


def test_the_report_says_not_reached_for_targets_no_seed_reached(raced):
    _, _, records, _, text = raced
    by_key = {key: payload for key, _, payload in records}
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 2 + len(TARGETS) and cells[1] in MODELS:
            rows[f"{cells[1]}@{cells[0]}"] = cells[2:]
    assert set(rows) == {f"{m}@{g}" for m in MODELS for g in RUNGS}
    unreached = 0
    for key, cells in rows.items():
        for target, cell in zip(TARGETS, cells):
            reached = by_key[key]["time_to_targets"][f"{target:g}"]
            assert (cell == "not reached") == (reached is None), (key, target, cell)
            unreached += reached is None
    assert unreached > 0  # 0.01 in one or two seconds of training: never
    # every scored record measured the machine before its training, and the report says the range
    assert f"before the training of the {len(MODELS) * len(RUNGS)} records that measured it" in text


def test_a_rung_not_raced_yet_reports_no_time_rather_than_not_reached(raced):
    """A partial ladder's report: a rung without records says "—", never "not reached"."""
    from bench.race_report import report

    root = raced[0]
    grid = [(float(g), m, [0]) for g in (*RUNGS, 8) for m in MODELS]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in
            report(root / "race.jsonl", grid, BASE_S, "advection1d").splitlines()]
    times = {(r[0], r[1]): r[2:] for r in rows if len(r) == 2 + len(TARGETS) and r[1] in MODELS}
    assert {k for k in times if k[0] == "8"} == {("8", m) for m in MODELS}
    assert all(cells == ["—"] * len(TARGETS) for (rung, _), cells in times.items() if rung == "8")
    assert all("—" not in cells for (rung, _), cells in times.items() if rung != "8")


@pytest.mark.parametrize("more,says", [({"--models": "fno,resnet"}, "resnet"), ({"--rungs": ""}, "--rungs"),
                                       ({"--rungs": "1,x"}, "--rungs"), ({"--task-index": "3"}, "--task-index"),
                                       ({"--base-s": "3"}, "another --out"),
                                       ({"--peer-loss": "pushforward"}, "other candidates"),
                                       ({"--batches": "0"}, "--batches"),
                                       ({"--lowest-only": "neuralop_fno"}, "--lowest-only")])
def test_bad_arguments_exit_2_with_one_line(raced, capsys, more, says):
    """Unknown model, empty or malformed rungs, a task the config lacks, and a result file of
    another budget or peer loss (its records would be reused as this race's): one line, exit 2,
    nothing written."""
    root, cfg, _, data, _ = raced
    capsys.readouterr()
    assert race.main(_argv(root, cfg, **more)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert (root / "race.jsonl").read_bytes() == data


def test_an_ablation_is_ours_with_its_overrides_at_ours_rate_and_no_peer(raced, monkeypatch, capfd):
    """``--ablation NAME KEY=VALUE``: the model ours-NAME is probed and trained with those overrides
    on every rung and seed at ours' chosen rate (no sweep of its own), recorded with them, and
    not counted as a peer; other overrides under a recorded name, keys the race sets, a wrong key
    and an ablation without ours are one-line errors."""
    root, cfg, _, data, _ = raced
    runs, probes = [], []
    monkeypatch.setattr(race, "probe_ours", lambda args, cfg_, f, name, ablation=(): probes.append((name, ablation))
                        or {"probe_steps": 20, "fixed_s": 0.1, "first_step_s": 0.01, "step_s": 0.01})

    def fake_train_ours(args, cfg_, f, probe, *, name, rung, budget_s, seed, lr, info, model="ours", ablation=()):
        runs.append((model, name, rung, seed, lr, ablation))
        return {"model": model, **({"ablation": list(ablation)} if ablation else {}), "budget_s": budget_s,
                "seed": seed, "schedule": race.OURS_NOTE, "lr": lr, "train_s": budget_s, "within_budget": True,
                "steps": 5, "val_curve": [[0.1, 1.0]], "val_nrmse_final": abs(math.log(lr / 6e-3)),
                "time_to_targets": {f"{t:g}": None for t in TARGETS}, "test_nrmse": 0.5 if model == "ours" else 1e-3}

    monkeypatch.setattr(race, "train_ours", fake_train_ours)
    out = root / "ablation.jsonl"
    out.write_bytes(data)  # the peers' records: reused, not trained again
    stencil = ["--ablation", "no_stencil", "operator.pdet.token_conv=false"]
    argv = _argv(root, cfg, **{"--models": "ours,fno", "--out": str(out), "--report": str(root / "ablation.md"),
                               "--seeds": "0,1"})
    assert race.main(argv + stencil) == 0
    chosen = {lr for model, _, rung, seed, lr, _ in runs if model == "ours" and (rung, seed) == (1, 0)}
    ablated = [r for r in runs if r[0] == "ours-no_stencil"]
    assert len(chosen) == 1 and len(ablated) == 4  # ours' one sweep trial (--lr-sweep 1); the ablation at 2 rungs x 2 seeds
    ours_rate = next(lr for m, _, rung, seed, lr, _ in runs if m == "ours" and rung == 2)
    assert {(rung, seed) for _, _, rung, seed, _, _ in ablated} == {(1, 0), (1, 1), (2, 0), (2, 1)}
    assert {(name, lr, extra) for _, name, _, _, lr, extra in ablated} == {
        ("tiny-ours-no_stencil", ours_rate, ("operator.pdet.token_conv=false",))}
    assert probes == [("tiny", ()), ("tiny-ours-no_stencil", ("operator.pdet.token_conv=false",))]
    rows = {cells[2]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in (root / "ablation.md").read_text().splitlines())
            if len(cells) == 8 and cells[0] == "2"}
    assert rows["fno"][5].startswith("1.00x")  # the ablation's 1e-3 is not the best peer's score
    named = "ours-no_stencil: ours with operator.pdet.token_conv=false, at ours' rate."
    assert named in (root / "ablation.md").read_text()
    assert race.main(argv + stencil) == 0 and len(runs) == 4 + 4  # a re-run trains nothing
    capfd.readouterr()
    for more, says in ((["--ablation", "no_stencil", "operator.weight_decay=0.0"], "name the ablation anew"),
                       (["--ablation", "fast", "operator.lr=1.0"], "the race sets operator.lr"),
                       (["--ablation", "typo", "operator.pdet.token_cnv=false"], "token_cnv"),
                       (["--ablation", "Bad-Name", "operator.pdet.token_conv=false"], "a-z, 0-9"),
                       (["--ablation", "bare"], "KEY=VALUE")):
        assert race.main(argv + more) == 2, more
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], (more, err)
    assert race.main(_argv(root, cfg, **{"--models": "fno", "--out": str(out)}) + stencil) == 2
    assert "add ours to --models" in capfd.readouterr().err


def test_ours_runs_take_the_ablations_overrides_before_the_races(raced, monkeypatch):
    """The ablation's overrides reach entry.pipeline ahead of the race's own (which win a clash)
    and its record names the model and the overrides."""
    root, cfg, _, _, _ = raced
    seen = []

    def fake_run_pipeline(args, more):
        seen.append(more)
        raise RuntimeError("stop here")

    monkeypatch.setattr(race, "run_pipeline", fake_run_pipeline)
    conf, args = load_config(cfg), SimpleNamespace(ema=0.0, select="best")
    fields = race.load_task_fields(conf, 0)
    probe = {"probe_steps": 20, "fixed_s": 0.1, "first_step_s": 0.01, "step_s": 0.01, "total_s": 0.3}
    extra = ("operator.pdet.token_conv=false",)
    with pytest.raises(RuntimeError, match="stop here"):
        race.train_ours(args, conf, fields, probe, name="t-ours-x", rung=1, budget_s=1.0, seed=0, lr=1e-3, info=None,
                        model="ours-x", ablation=extra)
    assert seen[-1][:1] == list(extra) and "logging.run_name=t-ours-x-race-r1-s0-lr0.001" in seen[-1]
    assert "evaluation.select=best" in seen[-1]  # --select reaches ours as its own best-validation choice
    skipped = race.train_ours(args, conf, fields, probe | {"fixed_s": 5.0}, name="t-ours-x", rung=1, budget_s=1.0,
                              seed=0, lr=1e-3, info=None, model="ours-x", ablation=extra)
    assert skipped["model"] == "ours-x" and skipped["ablation"] == list(extra) and "skipped" in skipped


# --- ours: the step count from the budget and the training time from the run folder --------------

def test_ours_steps_fill_the_budget_after_the_fixed_cost_and_the_first_step():
    assert race.steps_for_budget(10.0, 2.0, 1.0, 0.5) == 15  # 2 + 1 + 14 * 0.5 = 10: exactly full
    assert race.steps_for_budget(10.0, 2.0, 1.0, 0.6) == 12
    assert race.steps_for_budget(3.0, 2.0, 1.0, 0.5) == 1
    assert race.steps_for_budget(2.9, 2.0, 1.0, 0.5) == 0  # not even the first step: nothing runs


SUMMARY = """2026-11-25 18:20:42,804 rank0 INFO pipeline summary:
  autoencoder  {ae:<20} 1.7 s
  cache        done                      0.1 s
  operator     done                      0.9 s
  results: (no evaluation selected)
"""


def test_ours_time_is_the_earlier_stages_whole_plus_the_trained_stages_training(tmp_path):
    old = SUMMARY.format(ae="done").replace("1.7 s", "9.9 s")  # an earlier attempt's summary: not read
    (tmp_path / "rank0.log").write_text(old + "more lines\n" + SUMMARY.format(ae="done"))
    (tmp_path / "operator.done.json").write_bytes(orjson.dumps({"final_metrics": {"train_wall_s": 0.5}}))
    assert race.ours_seconds(tmp_path, "operator") == {"autoencoder": 1.7, "cache": 0.1, "operator": 0.5}
    (tmp_path / "rank0.log").write_text(SUMMARY.format(ae="skipped (complete)"))
    with pytest.raises(RuntimeError, match="autoencoder"):
        race.ours_seconds(tmp_path, "operator")
    with pytest.raises(RuntimeError, match="did not finish"):
        race.stage_seconds_from_log("2026-11-25 rank0 INFO stage operator: starting\n")


def test_the_grid_runs_lowest_only_models_at_the_lowest_rung_and_top_seeds_at_the_top():
    grid = race.race_grid(["ours", "fno", "neuralop_fno"], [4, 1, 16], [0, 1, 2], [0], ["neuralop_fno"])
    assert grid == [(1, "ours", [0, 1, 2]), (1, "fno", [0, 1, 2]), (1, "neuralop_fno", [0, 1, 2]),
                    (4, "ours", [0, 1, 2]), (4, "fno", [0, 1, 2]), (16, "ours", [0]), (16, "fno", [0])]


def test_ours_rate_is_swept_like_a_peers_and_annealed_to_its_budget(raced, monkeypatch):
    """Ours' rate is the config's times the best of the sweep on validation at the lowest rung
    (seed 0's run there is the chosen trial), every rung then trains at it with the pipeline's
    time-annealed schedule; a store of ours on the older step-annealed schedule is refused."""
    root, cfg, _, _, _ = raced
    runs = []
    monkeypatch.setattr(race, "probe_ours", lambda *a: {"probe_steps": 20, "fixed_s": 0.1, "first_step_s": 0.01,
                                                         "step_s": 0.01, "total_s": 0.3, "run_dir": "probe"})

    def fake_run_pipeline(args, more):
        runs.append(dict(o.split("=", 1) for o in more if "=" in o and not o.startswith("stages")))
        raise RuntimeError("stop here")  # the overrides are what this test reads

    def fake_train_ours(args, cfg_, f, probe, *, name, rung, budget_s, seed, lr, info, **ablated):
        runs.append({"rung": rung, "seed": seed, "lr": lr})
        return {"model": "ours", "budget_s": budget_s, "seed": seed, "schedule": race.OURS_NOTE, "lr": lr,
                "train_s": budget_s, "within_budget": True, "steps": 5, "val_curve": [[0.1, 1.0]],
                "val_nrmse_final": abs(math.log(lr / 6e-3)), "time_to_targets": {f"{t:g}": None for t in TARGETS},
                "test_nrmse": 0.5}

    real_train_ours = race.train_ours
    monkeypatch.setattr(race, "train_ours", fake_train_ours)
    out = root / "ours.jsonl"
    argv = _argv(root, cfg, **{"--models": "ours", "--lr-sweep": "1,3", "--out": str(out),
                               "--report": str(root / "ours.md"), "--seeds": "0,1"})
    assert race.main(argv) == 0
    base = load_config(cfg).operator.lr
    chosen = min((base, 3 * base), key=lambda lr: abs(math.log(lr / 6e-3)))
    assert {(r["rung"], r["seed"]) for r in runs if r["lr"] == chosen} == {(1, 0), (1, 1), (2, 0), (2, 1)}
    # at each sweep rung the two trials (the lower rung's choice is one of them: not run again), then seed 1
    assert len(runs) == (2 + 1) * 2
    # The pipeline is asked for the time-annealed schedule under the budget, steps capped above the estimate.
    monkeypatch.setattr(race, "run_pipeline", fake_run_pipeline)
    fields = race.load_task_fields(load_config(cfg), 0)
    with pytest.raises(RuntimeError, match="stop here"):
        real_train_ours(SimpleNamespace(ema=0.0, select="last"), load_config(cfg), fields, race.probe_ours(), name="t", rung=1,
                        budget_s=1.0, seed=0, lr=1e-3, info=None)
    more = runs[-1]
    # The probe's 0.3 s are on ours' clock, and the fixed cost gets an allowance above the probe's
    # (a run's codec fit and cache vary): the stage may train what is left of the budget.
    fixed = (1 + race.OURS_FIXED_SLACK) * 0.1
    estimate = race.steps_for_budget(1.0 - 0.3, fixed, 0.01, 0.01)
    assert more["training.anneal_to"] == "time"
    assert float(more["training.max_train_s"]) == pytest.approx(1.0 - 0.3 - fixed)
    assert int(more["operator.steps"]) == math.ceil(race.OURS_STEP_CAP * estimate) and more["operator.lr"] == "0.001"
    # A store of ours trained on the older schedule is not reused as this race's.
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    for rec in lines:
        if rec["model"] == "ours@2":
            rec["payload"]["schedule"] = race.STEP_ANNEALED
    out.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    assert race.main(argv) == 2


def test_the_ladder_script_races_every_model_with_three_seeds_on_every_rung_of_every_task(monkeypatch):
    """bench/race_ladder.sh (issue 51's whole race): its commands are valid races whose grids give
    every model, neuraloperator's FNO included, 3 seeds on every rung, choosing recipes at B and 4B."""
    out = subprocess.run(["bash", str(race.ROOT / "bench" / "race_ladder.sh")], env=os.environ | {"RACE_LADDER_PRINT": "1"},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    monkeypatch.setattr(race, "neuralop_available", lambda: True)  # the ladder names it; CI may lack the extra
    monkeypatch.chdir(race.ROOT)
    tasks = set()
    for line in out.splitlines():
        argv = shlex.split(line)
        assert argv[:3] == ["python", "-m", "bench.race"], line
        cfg, args = race.parse_config(argv[3:], race.__doc__, race._args)
        plan = race._checked(cfg, args)
        rungs = sorted({rung for rung, _, _ in plan.grid})
        assert {(rung, model) for rung, model, _ in plan.grid} == {(r, m) for r in rungs for m in race.MODELS}
        assert all(list(seeds) == [0, 1, 2] for _, _, seeds in plan.grid) and rungs[:2] == [1, 4]
        assert plan.swept == [1, 4]
        tasks.add(race.task_label(cfg, args.task_index))
    assert tasks == {"advection1d", "burgers1d", "darcy2d", "ns2d"}
