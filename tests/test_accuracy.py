"""`python -m bench.accuracy` end to end at a tiny CPU size, and its pieces: reference lookup,
time to a target, FNO scoring conventions, multi-task ratios, and the split it trains on."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
import yaml

from bench.accuracy_report import multitask_ratios
from bench.accuracy_scores import reference_values, time_to_reach
from tests import tiny_run as tr

ROOT = Path(__file__).resolve().parents[1]


def test_reference_values_use_the_arxiv_table_and_the_predicted_steps_stretch():
    ref = reference_values("burgers1d", 0.01)
    assert ref["published"]["nrmse"] == pytest.approx(7.8e-3) and ref["published"]["convention"] == "pdebench2022"
    assert ref["stretch"]["nrmse"] == pytest.approx(4.2e-3)
    assert ref["stretch"]["convention"] == "predicted_steps_only"
    assert reference_values("advection1d", 1.0)["published"]["nrmse"] == pytest.approx(9.7e-3)
    assert "stretch" not in reference_values("advection1d", 1.0)
    assert reference_values("darcy2d", 1.0)["published"]["nrmse"] == pytest.approx(6.4e-2)


def test_time_to_reach_is_the_first_crossing():
    curve = [(1.0, 0.5), (2.0, 0.09), (3.0, 0.2), (4.0, 0.05)]
    assert time_to_reach(curve, 0.1) == 2.0
    assert time_to_reach(curve, 0.05) == 4.0
    assert time_to_reach(curve, 0.01) is None
    assert time_to_reach(curve, None) is None


def test_multitask_ratio_pairs_tasks_by_name_param_and_device():
    def result(device, tasks):
        return {"device": device, "summary": {
            f"{name}{p}": {"task": name, "param": p, "models": {"ours/reported": {"nrmse": {"mean": v}}}}
            for name, p, v in tasks}}

    single = result("cpu", [("burgers1d", 0.01, 0.02)])
    other_device = result("gpu", [("advection1d", 0.1, 0.01)])
    multi = result("cpu", [("burgers1d", 0.01, 0.03), ("advection1d", 0.1, 0.5)])
    rows = multitask_ratios([single, other_device, multi])
    assert rows == [{"task": "burgers1d0.01", "multitask": 0.03, "single": 0.02, "ratio": pytest.approx(1.5)}]


def _exact_codec(grid: tuple[int, ...], tokens: int):
    """A codec whose latent holds the whole field (one cosine mode per point of each cell)."""
    from core.models.grid_codec import GridDecoder, GridEncoder

    modes = grid[0] // tokens
    kw = dict(tokens=tokens, dim=modes, hidden=0, ndims=(1,), modes=modes)
    enc, dec = GridEncoder(1, **kw), GridDecoder(1, **kw)

    class Codec:
        encode = staticmethod(enc)
        decode = staticmethod(dec)
    return Codec


def test_exact_codec_has_no_floor_and_persistence_scores_the_persistence_reference():
    """The error budget of bench.accuracy: a codec that holds the field reconstructs the test
    frames to float rounding, and a latent model that steps nothing (persistence through that
    codec) scores what the field-space persistence reference scores."""
    from bench.accuracy_scores import TaskFields, error_budget, score_latent
    from entry.evaluation.references import IdentityCodec

    g = torch.Generator().manual_seed(0)
    u = torch.randn(6, 9, 1, 32, generator=g).cumsum(1)  # frames that change: persistence is not 0
    fields = TaskFields("adv", 0, False, 3, 0.1, u, u[:2], u)
    ae = _exact_codec((32,), 8)
    budget = error_budget(fields, ae, torch.device("cpu"))
    assert budget["codec_reconstruction_nrmse"] < 1e-6
    persistence = budget["references"]["persistence"]
    assert persistence["nrmse"] > 0.1
    def still(ids, t):
        return lambda z, dt, tid: z
    through_codec = score_latent(fields, u, ae, still, torch.device("cpu")).summary()
    for k in ("nrmse", "one_step_nrmse", "nrmse_pdebench2022"):
        assert through_codec[k] == pytest.approx(persistence[k], rel=1e-5), k
    exact = score_latent(fields, u, IdentityCodec, still, torch.device("cpu")).summary()
    assert exact == persistence  # no codec at all: the same computation, bitwise


def test_seed_statistics_report_mean_spread_and_each_seed():
    from bench.accuracy_report import across_seeds

    def run(seed, ours, fno, reported="ours/operator"):
        model = lambda v: {"test": {"nrmse": v, "nrmse_pdebench2022": v / 2, "one_step_nrmse": v / 10},  # noqa: E731
                           "train_wall_s": 10.0}
        return {"seed": seed, "tasks": {"adv": {
            "task": "advection1d", "param": 0.1, "reference": {}, "reported_variant": reported, "skipped": {},
            "error_budget": {"codec_reconstruction_nrmse": 1e-6, "references": {"persistence": {"nrmse": 0.7}}},
            "time_to_fno": {"fno_final_val_nrmse": 0.1, "ours_time_to_fno_final_s": 2.0,
                            "fno_budget_over_ours_time": 5.0},
            "models": {"ours/operator": model(ours), "ours/operator+diffusion": model(ours * 2), "fno": model(fno)}}}}

    s = across_seeds([run(0, 0.02, 0.08), run(1, 0.04, 0.08, reported="ours/operator+diffusion")])["adv"]
    op = s["models"]["ours/operator"]["nrmse"]
    assert op["mean"] == pytest.approx(0.03) and op["std"] == pytest.approx(np.std([0.02, 0.04], ddof=1))
    assert op["per_seed"] == [0.02, 0.04] and op["n"] == 2
    # the reported model is chosen per seed
    assert s["models"]["ours/reported"]["nrmse"]["per_seed"] == [0.02, 0.08]
    assert s["ours_over_fno"]["per_seed"] == [pytest.approx(0.25), pytest.approx(1.0)]
    assert s["error_budget"]["persistence"]["mean"] == pytest.approx(0.7)
    assert s["time_to_fno"]["fno_budget_over_ours_time"]["mean"] == pytest.approx(5.0)


def test_library_fno_trains_through_the_pdebench_loop():
    pytest.importorskip("neuralop", reason="neuraloperator not installed (extra 'peers')")
    from bench.fno_baseline import fno_validate, train_fno
    from bench.peers import build_neuralop_fno, neuralop_config

    u = torch.randn(8, 6, 1, 32, generator=torch.Generator().manual_seed(0))
    model, history = train_fno(u, initial_step=3, epochs=2, batch_size=4, u_val_NTCS=u[:2], build=build_neuralop_fno)
    assert len(history) == 2 and math.isfinite(history[-1].val_nrmse)
    assert history[-1].val_nrmse == pytest.approx(fno_validate(model, u[:2], 3), rel=1e-5)
    again = build_neuralop_fno(u, 3, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), build_neuralop_fno(u, 3, seed=0).parameters()))
    assert neuralop_config(model)["parameters"] == sum(p.numel() for p in model.parameters())


def test_fno_scores_match_its_validation_convention():
    """`score_fno` (the table) and `fno_validate` (the curve) give the same predicted-steps nRMSE."""
    from bench.accuracy_scores import TaskFields, score_fno
    from bench.fno_baseline import build_fno, fno_validate

    g = torch.Generator().manual_seed(0)
    u = torch.randn(5, 7, 1, 16, generator=g)
    model = build_fno(u, 3)
    fields = TaskFields("adv", 0, False, 3, 0.1, u, u, u)
    s = score_fno(model, fields, u, torch.device("cpu")).summary()
    assert s["nrmse"] == pytest.approx(fno_validate(model, u, 3), rel=1e-5)
    assert s["nrmse_pdebench2022"] == pytest.approx(s["nrmse"] * 4 / 7, rel=1e-5)  # 3 given steps score 0


def _tiny_config(root: Path) -> Path:
    tree = {
        "data": {"root": str(root / "data"), "generate_if_missing": True, "tasks": [
            {"name": "advection1d", "param": 0.1, "samples": 20, "nx": 64, "nt": 21, "reduce_x": 2, "reduce_t": 2,
             "initial_step": 3},
            {"name": "darcy2d", "param": 1.0, "samples": 20, "nx": 16}]},
        "latent": {"tokens": 16, "dim": 8, "hidden": 16},
        "autoencoder": {"steps": 4, "batch_size": 8},
        "operator": {"steps": 6, "batch_size": 8, "pdet": {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2,
                                                            "group_size": 4}},
        "diffusion": {"steps": 2, "batch_size": 8, "noise_levels": 2,
                      "pdet": {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2, "group_size": 4}},
        "consistency": {"steps": 2, "batch_size": 8},
        "steady": {"steps": 4, "batch_size": 8, "pdet": {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2,
                                                          "group_size": 4}},
        "training": {"parallel": "none", "num_workers": 0, "cache_dir": str(root / "cache"), "checkpoint_every": 100},
        "evaluation": {"val_every": 3, "val_samples": 2, "select": "best"},
        "logging": {"run_dir": str(root / "runs"), "run_name": "tiny", "progress": False, "plots": False,
                    "wandb": {"mode": "disabled"}},
    }
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(400)
def test_command_end_to_end_writes_a_well_formed_result(tmp_path):
    cfg = _tiny_config(tmp_path)
    out = tmp_path / "results"
    env = {**tr.env(), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "bench.accuracy", "--config", str(cfg), "--fno-epochs", "2", "--seeds", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = list(out.glob("*-accuracy-tiny.json"))
    r = orjson.loads(path.read_bytes())
    assert r["benchmark"] == "accuracy" and r["device"].startswith("cpu") and r["git_commit"] and r["processor"]
    # two seeds, each its own training seed and run folder, on the same data and split
    assert r["seeds"] == 2 and [run["seed"] for run in r["runs"]] == [0, 1]
    assert [run["run_name"] for run in r["runs"]] == ["tiny-seed0", "tiny-seed1"]
    assert all((tmp_path / "runs" / name / "operator.pt").is_file() for name in ("tiny-seed0", "tiny-seed1"))
    assert len(r["runs"][0]["data_generation"]["generated"]) == 2 and r["runs"][0]["data_generation"]["seconds"] > 0
    assert r["runs"][1]["data_generation"]["generated"] == []  # made once
    first, second = (run["tasks"]["advection1d"] for run in r["runs"])
    assert first["models"]["ours/operator"]["test"]["nrmse"] != second["models"]["ours/operator"]["test"]["nrmse"]
    with_peer = importlib.util.find_spec("neuralop") is not None
    for run in r["runs"]:
        assert set(run["tasks"]) == {"advection1d", "darcy2d"}
        adv, darcy = run["tasks"]["advection1d"], run["tasks"]["darcy2d"]
        baselines = {"fno", "neuralop_fno"} if with_peer else {"fno"}
        assert set(adv["models"]) == {"ours/operator", "ours/operator+diffusion", "ours/operator+consistency"} | baselines
        assert set(darcy["models"]) == {"ours/steady"} | baselines
        assert with_peer or "not installed" in adv["skipped"]["neuralop_fno"]
        # PDEBench's split: 20 samples -> the first 2 are the test set; validation (at most 2 rows)
        # and training share the other 18.
        assert adv["n_test"] == 2 and 1 <= adv["n_val"] <= 2 and adv["n_train"] + adv["n_val"] == 18
        assert adv["reference"]["published"]["nrmse"] == pytest.approx(7.7e-3)
        assert set(adv["error_budget"]["references"]) == {"persistence"}
        assert set(darcy["error_budget"]["references"]) == {"mean_solution"}
        for t in run["tasks"].values():
            assert t["reported_variant"] in t["models"]
            assert 0 <= t["error_budget"]["codec_reconstruction_nrmse"] < 10
            assert t["time_to_fno"]["fno_final_val_nrmse"] == t["models"]["fno"]["val_nrmse_selected"]
            for name, m in t["models"].items():
                s = m["test"]
                for k in ("nrmse", "nrmse_pdebench2022", "one_step_nrmse", "crmse", "brmse", "frmse_low",
                          "frmse_mid", "frmse_high"):
                    assert math.isfinite(s[k]) and s[k] >= 0, (name, k)
                assert s["n_samples"] == t["n_test"]
                assert m["train_wall_s"] > 0 and m["inference_s_per_rollout"] > 0
                times = [p[0] for p in m["val_curve"]]
                assert times == sorted(times) and len(times) >= 1
                assert m["time_to_published_s"] is None or m["time_to_published_s"] in times
        # the operator's curve comes from validation during training: several points
        assert len(adv["models"]["ours/operator"]["val_curve"]) >= 2
        assert adv["models"]["fno"]["epochs"] == 2
        # the given steps count as zero error in the 2022 convention only
        s = adv["models"]["ours/operator"]["test"]
        assert s["nrmse_pdebench2022"] == pytest.approx(s["nrmse"] * (11 - 3) / 11, rel=1e-5)  # T = 21 // 2 + 1
    # the summary is the statistics of the per-seed values
    per_seed = [run["tasks"]["advection1d"]["models"]["fno"]["test"]["nrmse"] for run in r["runs"]]
    fno = r["summary"]["advection1d"]["models"]["fno"]["nrmse"]
    assert fno["per_seed"] == per_seed and fno["mean"] == pytest.approx(np.mean(per_seed))
    assert fno["std"] == pytest.approx(np.std(per_seed, ddof=1))
    for p in r["plots"]:
        assert Path(p).is_file() and Path(p).stat().st_size > 0
    table = path.with_suffix(".md").read_text()
    assert "mean +- std" in table and "## seed 1 (tiny-seed1)" in table and "codec reconstruction" in table
    # --report reads results back without a config
    rep = subprocess.run([sys.executable, "-m", "bench.accuracy", "--report", str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0 and "ours/operator+consistency" in rep.stdout and "2 seed(s)" in rep.stdout


def test_validation_rows_never_come_from_the_test_set(tmp_path):
    """bench.accuracy's model selection reads the val split: disjoint from the test set, which is
    the first 10% of the file (PDEBench's single-file loaders)."""
    from bench.accuracy_scores import load_task_fields
    from entry.config.load import load_config
    from entry.data.files import ensure_data, task_split
    from pipelines.task_data import read_task

    cfg = load_config(_tiny_config(tmp_path), ["data.tasks.0.samples=30", "evaluation.val_samples=3"])
    ensure_data(cfg)
    test, _ = task_split(cfg, 0, "test")
    val, _ = task_split(cfg, 0, "val")
    train, _ = task_split(cfg, 0, "train")
    np.testing.assert_array_equal(test, np.arange(3))
    assert not set(val) & set(test) and not set(train) & set(test) and not set(train) & set(val)
    fields = load_task_fields(cfg, 0)
    task = cfg.data.tasks[0]
    whole = read_task(Path(cfg.data.root) / "1D_Advection_Sols_beta0.1.hdf5", reduce_x=task.reduce_x,
                      reduce_t=task.reduce_t).u
    np.testing.assert_array_equal(fields.test.numpy(), whole[:3])
    np.testing.assert_array_equal(fields.val.numpy(), whole[val[:3]])
    np.testing.assert_array_equal(fields.train.numpy(), whole[train])


def test_a_shared_cache_rebuilt_for_another_run_is_rebuilt_not_reused(tmp_path, monkeypatch):
    """bench.accuracy reuses a stage recorded with the same stage hash, but the cache only while it
    still matches this run's encoder and data: another run with the same training.cache_dir may
    have rebuilt it since (then reading it failed: 'does not match: manifest field encoder_hash')."""
    import logging

    import bench.accuracy as acc
    from entry.config.load import load_config
    from entry.distributed.process_group import DistInfo
    from entry.storage.run_folder import run_dir_for

    cfg = load_config(_tiny_config(tmp_path), ["stages=[autoencoder,cache,evaluate]"])
    run_dir = run_dir_for(cfg)
    run_dir.mkdir(parents=True)
    (run_dir / acc.STAGE_TIMES).write_bytes(orjson.dumps(
        {name: {"stage_hash": acc.stage_hash(cfg, name), "seconds": 1.0} for name in ("autoencoder", "cache")}))
    built = []
    monkeypatch.setattr(acc, "stage_is_complete", lambda run_dir, name, cfg: True)
    monkeypatch.setattr(acc, "run_cache", lambda cfg, info, logger: built.append("cache"))
    info = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)
    for matches, rebuilt in ((True, []), (False, ["cache"])):
        built.clear()
        monkeypatch.setattr(acc, "caches_ready", lambda cfg, info, matches=matches: matches)
        seconds = acc.train_ours(cfg, info, logging.getLogger("acc"))
        assert built == rebuilt and seconds["autoencoder"] == 1.0
