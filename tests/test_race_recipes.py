"""The race's recipes chosen per rung and its records a referee accepts (issue 51): every sweep rung
records its candidates, their validation and the winner; a higher rung offers the lower rung's
winner; a rung above the last sweep rung reuses the highest swept rung's choice; a dirty tree is
refused before anything is written; every record names its commit and data fingerprint, and a
store of other data is refused. Peers' training is faked here (each run returns a score fixed by
its recipe and budget), so the choice is checked exactly; test_race.py runs the real thing."""

from __future__ import annotations

import dataclasses
import math

import orjson
import pytest
import torch

import bench.provenance as provenance
import bench.race as race
from bench.budget import TARGETS
from bench.fno_baseline import fno_rollout, fno_rollout_loss, one_step_loss, pushforward_loss
from bench.race_recipes import (AUTHORS, Recipe, choice_key, choose_at_rung, chooser, peer_templates, sweep_rungs,
                                trial_key)
from bench.race_report import report
from bench.race_train import Normalised, fit_normaliser
from bench.result_store import record
from tests.test_race import _config, short_step_timings  # noqa: F401 (an autouse fixture)

BASE_S = 0.5


def _fake_score(recipe: Recipe, budget_s: float) -> float:
    """A validation score fixed by recipe and budget: the authors' recipe best at the lowest rung,
    the loop's one_step at batch 8 above it, a rate of 1e-3 best (a peer's seed adds nothing)."""
    base = 0.5 if recipe.name == "authors" else (0.4 if budget_s > BASE_S else 0.6)
    return base + abs(math.log(recipe.lr / 1e-3)) / 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, config) of a generated tiny advection task, shared: each test gives its own --out."""
    root = tmp_path_factory.mktemp("recipes")
    return root, _config(root)


def _argv(out, cfg: str, *, dirty: bool = True, **more) -> list[str]:
    args = {"--base-s": str(BASE_S), "--rungs": "1,2,4", "--sweep-rungs": "1,2", "--models": "fno,unet",
            "--seeds": "0,1", "--lr-sweep": "1,3", "--lr-extensions": "0", "--peer-loss": "one_step",
            "--batches": "8", "--out": str(out / "race.jsonl"), "--report": str(out / "race.md")} | more
    return ["--config", cfg, *[x for kv in args.items() for x in kv], *(["--allow-dirty"] if dirty else [])]


@pytest.fixture
def fake_peers(monkeypatch):
    """Peers' runs faked by `_fake_score`; returns the list of (model, budget, recipe key, seed) run."""
    runs = []

    def fake_train_peer(model, f, recipe, *, budget_s, seed, val_every_s, device, select="last"):
        runs.append((type(model).__name__, budget_s, recipe.key(), seed))
        score = _fake_score(recipe, budget_s)
        return {"recipe": recipe.as_dict(), "recipe_key": recipe.key(), "budget_s": budget_s, "seed": seed,
                "lr": recipe.lr, "loss": recipe.loss, "train_s": budget_s, "within_budget": True, "steps": 3,
                "val_curve": [[budget_s, score]], "val_nrmse_final": score, "select": select,
                "val_nrmse_kept": score, "time_to_targets": {f"{t:g}": None for t in TARGETS},
                "test_nrmse": score + 0.01 * seed}

    monkeypatch.setattr(race, "train_peer", fake_train_peer)
    # A step time fixed, so every trial's budget is its rung's (machine factor 1) however busy the
    # machine is: a calibration slower than the store's scales the budget the fake scores.
    monkeypatch.setattr(race, "peer_step_seconds", lambda *args, **kwargs: 1e-3)
    return runs


def _store(path) -> dict:
    return {(r["model"], r["seed"]): r["payload"] for r in map(orjson.loads, path.read_bytes().splitlines())}


def test_each_sweep_rung_chooses_and_records_a_recipe_offering_the_lower_rungs(tiny, tmp_path, fake_peers):
    _, cfg = tiny
    assert race.main(_argv(tmp_path, cfg)) == 0
    store = _store(tmp_path / "race.jsonl")
    for model in ("fno", "unet"):
        low, high = store[(f"{model}@1@recipe", 0)], store[(f"{model}@2@recipe", 0)]
        # rung 1: the authors' recipe wins (the fake's rule); its candidates are the grid, each scored
        templates = peer_templates(model, ["one_step"], [8], None)
        grid = {trial_key(model, 1, dataclasses.replace(t, lr=t.lr * f)) for t in templates for f in (1, 3)}
        assert {c["key"] for c in low["candidates"]} == grid and low["lower"] is None
        assert low["chosen"]["name"] == "authors" and low["chosen"]["lr"] == pytest.approx(AUTHORS[model].lr)
        for c in low["candidates"]:
            assert c["val_nrmse_kept"] == pytest.approx(_fake_score(Recipe.from_dict(c["recipe"]), BASE_S))
        # rung 2: offered rung 1's winner, and chooses anew (the loop's recipe wins at this budget)
        assert high["lower"] == low["chosen"]
        assert trial_key(model, 2, Recipe.from_dict(low["chosen"])) in {c["key"] for c in high["candidates"]}
        assert high["chosen"]["name"] == "loop" and high["chosen"]["normalise"] and high["chosen"]["clip"] == 1.0
        # rung 4, above the last sweep rung: rung 2's choice, every seed trained, no sweep of its own
        assert (f"{model}@4@recipe", 0) not in store
        for seed in (0, 1):
            assert store[(f"{model}@4", seed)]["recipe"] == high["chosen"]
            assert store[(f"{model}@1", seed)]["recipe"] == low["chosen"]
        assert store[(f"{model}@2", 0)] == store[(high["chosen_key"], 0)]  # the chosen trial is seed 0's run
    text = (tmp_path / "race.md").read_text()
    assert "loop:one_step:b8:lr=0.001" in text and "authors:rollout:b50:lr=0.001" in text  # recipe per rung


def test_a_peer_is_offered_its_lower_rungs_recipe_even_outside_the_grid(tmp_path):
    """The lower rung's winner, at a rate this rung's sweep does not try, is a candidate and wins
    where it is best; a winner the grid holds already is not trained twice."""
    calls = []

    def run(recipe, seed):
        calls.append(recipe.key())
        return {"val_nrmse_final": abs(math.log(recipe.lr / 9e-3))}

    templates = [AUTHORS["fno"]]
    lower = dataclasses.replace(AUTHORS["fno"], lr=9e-3)  # chosen below by an extension of its sweep
    at = {"task": "t", "rung": 4.0, "budget_s": 4.0}
    won = choose_at_rung(tmp_path / "s.jsonl", "fno", 4.0, run, templates, [1.0, 3.0], 0, lower, at)
    assert won == lower and calls == [AUTHORS["fno"].key(), dataclasses.replace(AUTHORS["fno"], lr=3e-3).key(),
                                      lower.key()]
    assert choose_at_rung(tmp_path / "s.jsonl", "fno", 4.0, run, templates, [1.0, 3.0], 0, lower, at) == lower
    assert len(calls) == 3  # the recorded choice is read back
    same = dataclasses.replace(AUTHORS["fno"], lr=3e-3)
    choose_at_rung(tmp_path / "t.jsonl", "fno", 4.0, run, templates, [1.0, 3.0], 0, same, at)
    assert len(calls) == 5  # its trial was the grid's


def test_sweep_rungs_and_the_choice_a_rung_trains_with():
    assert sweep_rungs([1, 4, 16], [1, 4]) == [1, 4]
    assert sweep_rungs([2, 8], [1, 4]) == [2]  # the lowest rung always chooses
    assert [chooser(r, [1, 4]) for r in (1, 4, 16)] == [1, 4, 4]
    assert choice_key("fno", 4.0) == "fno@4@recipe"


def test_a_dirty_tree_is_refused_and_nothing_is_written(tiny, tmp_path, monkeypatch, capfd, fake_peers):
    _, cfg = tiny
    for changed, says in ((["core/x.py"], "1 uncommitted change(s)"), (None, "no git checkout")):
        monkeypatch.setattr(provenance, "uncommitted", lambda root, c=changed: c)
        assert race.main(_argv(tmp_path, cfg, dirty=False)) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and "--allow-dirty" in err[0], err
        assert not (tmp_path / "race.jsonl").exists() and not (tmp_path / "race.md").exists() and not fake_peers
    monkeypatch.setattr(provenance, "uncommitted", lambda root: [])  # a clean tree races
    monkeypatch.setattr(provenance, "commit_state", lambda: ("0" * 40, False))
    assert race.main(_argv(tmp_path, cfg, dirty=False, **{"--rungs": "1", "--seeds": "0"})) == 0
    assert all(not r["dirty"] and r["git_commit"] == "0" * 40 for r in _store(tmp_path / "race.jsonl").values()
               if "task" in r)


def test_a_dirty_race_says_so_and_a_clean_race_refuses_its_records(tiny, tmp_path, monkeypatch, capfd, fake_peers):
    _, cfg = tiny
    monkeypatch.setattr(provenance, "commit_state", lambda: ("1" * 40, True))
    assert race.main(_argv(tmp_path, cfg, **{"--rungs": "1", "--seeds": "0"})) == 0
    assert all(r["dirty"] for r in _store(tmp_path / "race.jsonl").values() if "task" in r)
    assert "record(s) were written from a work tree with uncommitted changes" in (tmp_path / "race.md").read_text()
    monkeypatch.setattr(provenance, "uncommitted", lambda root: [])
    data = (tmp_path / "race.jsonl").read_bytes()
    capfd.readouterr()
    assert race.main(_argv(tmp_path, cfg, dirty=False, **{"--rungs": "1", "--seeds": "0"})) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "uncommitted changes (--allow-dirty)" in err[0]
    assert (tmp_path / "race.jsonl").read_bytes() == data


def test_every_record_names_its_data_and_a_store_of_other_data_is_refused(tiny, tmp_path, capfd, fake_peers):
    root, cfg = tiny
    argv = _argv(tmp_path, cfg, **{"--rungs": "1", "--seeds": "0"})
    assert race.main(argv) == 0
    data = (tmp_path / "race.jsonl").read_bytes()
    lines = [orjson.loads(x) for x in data.splitlines()]
    fingerprints = {rec["payload"]["data_fingerprint"] for rec in lines if "task" in rec["payload"]}
    assert len(fingerprints) == 1 and None not in fingerprints
    for edit, says in ((lambda p: p | {"data_fingerprint": "elsewhere"}, "made on data elsewhere"),
                       (lambda p: {k: v for k, v in p.items() if k != "data_fingerprint"}, "made on data it does not")):
        changed = [rec | {"payload": edit(rec["payload"])} if rec["model"] == "unet@1" else rec for rec in lines]
        store = tmp_path / "other.jsonl"
        store.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in changed))
        capfd.readouterr()
        assert race.main(_argv(tmp_path, cfg, **{"--rungs": "1", "--seeds": "0", "--out": str(store)})) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and "unet@1 seed 0" in err[0], err
        assert store.read_bytes() == b"".join(orjson.dumps(x) + b"\n" for x in changed)  # nothing appended


def test_the_report_gives_ratios_with_spreads_and_says_where_ours_is_not_best(tmp_path):
    store, grid = tmp_path / "r.jsonl", [(1.0, "ours", [0, 1]), (1.0, "fno", [0, 1]), (4.0, "ours", [0]),
                                         (4.0, "fno", [0])]
    scores = {("ours", 1.0): [0.2, 0.4], ("fno", 1.0): [0.1, 0.3], ("ours", 4.0): [0.05], ("fno", 4.0): [0.1]}
    for (model, rung), values in scores.items():
        for seed, v in enumerate(values):
            record(store, f"{model}@{rung:g}", seed, {"model": model, "seed": seed, "test_nrmse": v, "train_s": rung,
                                                      "recipe_key": "authors:rollout:b50:lr=0.001",
                                                      "time_to_targets": {f"{t:g}": None for t in TARGETS}})
    text = report(store, grid, 1.0, "t")
    rows = {(c[0], c[2]): c for c in ([x.strip() for x in line.strip("|").split("|")] for line in text.splitlines())
            if len(c) == 8 and c[0] in ("1", "4")}
    spread = 1.5 * math.hypot(0.1414213562 / 0.3, 0.1414213562 / 0.2)
    assert rows[("1", "ours")][5] == f"1.50x ± {spread:.2f}" and rows[("4", "ours")][5] == "0.50x"
    assert rows[("1", "fno")][7] == "authors:rollout:b50:lr=0.001"
    assert "Where ours is not the best: 1 (1 s): ours 0.3 ± 0.14 against fno 0.2 ± 0.14." in text


def test_the_report_gives_each_field_s_score_and_names_the_published_setting_beside_ns2d(tmp_path):
    store, grid = tmp_path / "r.jsonl", [(1.0, "ours", [0, 1]), (1.0, "fno", [0])]
    per_channel = {("ours", 0): [0.1, 0.3, 0.5], ("ours", 1): [0.3, 0.5, 0.7], ("fno", 0): [0.2, 0.2, 0.2]}
    for (model, seed), values in per_channel.items():
        record(store, f"{model}@1", seed, {"model": model, "seed": seed, "test_nrmse": sum(values) / 3, "train_s": 1,
                                           "test": {"nrmse_per_channel": values},
                                           "time_to_targets": {f"{t:g}": None for t in TARGETS}})
    text = report(store, grid, 1.0, "ns2d", ("vorticity", "velocity_x", "velocity_y"))
    assert "| rung | model | vorticity | velocity_x | velocity_y |" in text
    assert "| 1 | ours | 0.2 ± 0.14 | 0.4 ± 0.14 | 0.6 ± 0.14 |" in text and "| 1 | fno | 0.2 | 0.2 | 0.2 |" in text
    assert "vorticity alone at 64 x 64 with 1000 training trajectories" in text
    assert "per field" not in report(store, grid, 1.0, "advection1d", ("u",)).lower()


def test_normalised_maps_physical_frames_through_the_normalised_model():
    """A model that returns its newest normalised frame, wrapped, returns the newest physical frame
    exactly (time-major channels: the wrapper normalises each frame's channel by its own mean)."""
    torch.manual_seed(0)
    u = torch.randn(4, 6, 2, 8) * torch.tensor([3.0, 0.01])[None, None, :, None] + torch.tensor([5.0, -1.0])[:, None]
    mean, std = fit_normaliser(u)
    assert torch.allclose(mean, u.transpose(0, 2).reshape(2, -1).mean(1)) and std.shape == (2,)
    class Newest(torch.nn.Module):
        def forward(self, x):
            return x[:, -2:]

    wrapped = Normalised(Newest(), mean, std)
    x = u[:, :3].flatten(1, 2)  # [B, 3 * C, X], time-major
    assert torch.allclose(wrapped(x), u[:, 2], atol=1e-5)
    assert torch.equal(fit_normaliser(torch.ones(2, 3, 1, 4))[1], torch.ones(1))  # a constant channel: std 1


def test_pushforward_loss_is_zero_for_the_exact_model_and_one_step_with_no_unroll():
    """On u_{t+1} = 0.9 u_t, the exact map has zero pushforward loss however far it unrolls; an
    unroll of one step is the one-step loss (the same windows from the same generator)."""
    u0 = torch.randn(5, 1, 1, 16)
    u = torch.cat([u0 * 0.9 ** t for t in range(8)], dim=1)  # [B, T, C, X]

    class Decay(torch.nn.Module):
        def __init__(self, a):
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor(a))

        def forward(self, x):  # the newest of the two given frames, decayed
            return self.a * x[:, -1:]

    exact = pushforward_loss(Decay(0.9), u, 2, unroll=3, generator=torch.Generator().manual_seed(0))
    assert exact.item() == pytest.approx(0.0, abs=1e-10)
    wrong = Decay(0.8)
    one = pushforward_loss(wrong, u, 2, unroll=1, generator=torch.Generator().manual_seed(3))
    assert one.item() == pytest.approx(one_step_loss(wrong, u, 2, generator=torch.Generator().manual_seed(3)).item())
    three = pushforward_loss(wrong, u, 2, unroll=3, generator=torch.Generator().manual_seed(3))
    three.backward()
    assert three.item() > 0 and wrong.a.grad is not None


def test_pdebench_pushforward_sums_the_last_steps_and_differentiates_only_them():
    """PDEBench's U-Net pushforward (``unroll_step``): the same free rollout, its loss the last
    ``unroll`` steps' terms of the full rollout loss, with gradient through those steps only."""
    torch.manual_seed(1)
    u = torch.randn(3, 9, 2, 16)
    model = torch.nn.Conv1d(4, 2, 3, padding=1)  # two given frames of two channels -> one frame
    with torch.no_grad():
        pred = fno_rollout(model, u, 2)
    terms = (pred - u).square().flatten(2).mean(dim=(0, 2))  # per step; zero for the given frames
    tail = fno_rollout_loss(model, u, 2, unroll=3)
    assert tail.item() == pytest.approx(terms[-3:].sum().item(), rel=1e-5)
    assert fno_rollout_loss(model, u, 2, unroll=50).item() == pytest.approx(fno_rollout_loss(model, u, 2).item())
    # the gradient of one unrolled step is the gradient of that step's term with its input frames held fixed
    one = fno_rollout_loss(model, u, 2, unroll=1)
    (grad,) = torch.autograd.grad(one, model.weight)
    fixed = (model(pred[:, -3:-1].flatten(1, 2)) - u[:, -1]).square().mean()
    (expected,) = torch.autograd.grad(fixed, model.weight)
    assert torch.allclose(grad, expected, rtol=1e-4, atol=1e-7)


def test_a_peers_normaliser_is_fitted_on_its_clock(tiny, monkeypatch):
    """The normaliser's fit is taken off the budget the loop gets and counted in the run's training
    time and curve; the model trains on normalised frames (each channel mean 0, std 1) and is scored
    on physical ones."""
    import types

    import bench.race_train as race_train
    from bench.accuracy_scores import load_task_fields
    from bench.budget import CurvePoint
    from entry.config.load import load_config
    from entry.data.files import ensure_data

    _, cfg = tiny
    conf = load_config(cfg)
    ensure_data(conf)
    f = load_task_fields(conf, 0)
    ticks = iter([10.0, 10.25])  # the fit's start and end: 0.25 s
    monkeypatch.setattr(race_train, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    seen = {}

    def fake_train_budgeted(model, next_batch, loss_fn, budget_s, lr, **kw):
        seen.update(budget_s=budget_s, batch=next_batch(), kw=kw)
        return model.eval(), [CurvePoint(0.5, 0.3)]

    monkeypatch.setattr(race_train, "train_budgeted", fake_train_budgeted)
    recipe = dataclasses.replace(AUTHORS["fno"], normalise=True, batch=f.train.shape[0])
    out = race_train.train_peer(race.PEERS["fno"](f, 0, 0), f, recipe, budget_s=2.0, seed=0, val_every_s=None,
                                device=torch.device("cpu"))
    assert seen["budget_s"] == pytest.approx(1.75) and out["normalise_s"] == pytest.approx(0.25)
    assert out["train_s"] == pytest.approx(0.75) and out["val_curve"] == [[pytest.approx(0.75), 0.3]]
    dims = [d for d in range(seen["batch"].ndim) if d != 2]
    assert torch.allclose(seen["batch"].mean(dim=dims), torch.zeros(f.train.shape[2]), atol=1e-4)
    assert torch.allclose(seen["batch"].std(dim=dims), torch.ones(f.train.shape[2]), atol=1e-3)
    assert math.isfinite(out["test_nrmse"]) and seen["kw"]["schedule"] == "step"


def test_neuralop_fno_is_a_default_peer_when_its_package_imports(monkeypatch, capfd):
    from types import SimpleNamespace

    monkeypatch.setattr(race, "neuralop_available", lambda: True)
    assert race._models(SimpleNamespace(models=None)) == ["fno", "unet", "plain_transformer", "neuralop_fno"]
    monkeypatch.setattr(race, "neuralop_available", lambda: False)
    capfd.readouterr()
    assert race._models(SimpleNamespace(models=None)) == ["fno", "unet", "plain_transformer"]
    assert "neuralop_fno skipped" in capfd.readouterr().err  # said, not silent
    with pytest.raises(race.ConfigError, match="needs the package neuraloperator"):
        race._models(SimpleNamespace(models="fno,neuralop_fno"))
