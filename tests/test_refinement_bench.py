"""`bench.refinement` (issue 28's driver): the statistics over seeds of every variant's long-rollout
scores from the seeds' eval.json trees, its report and plot, and a user error's one line."""

from __future__ import annotations

import os
import statistics

import pytest

import bench.refinement as refinement


def _variant(nrmse: float, corr: float, ms: float, members: int) -> dict:
    window = {"nrmse": nrmse, "ensemble_mean_nrmse": nrmse * 0.9, "crps": nrmse / 2,
              "spread_skill": None if members == 1 else 0.8}
    return {"nrmse": nrmse, "one_step_nrmse": nrmse / 10, "correlation_time": corr, "spectrum_error": 0.1,
            "rollout_step_ms": ms, "ensemble_members": members, "nrmse_per_step": [nrmse / 2, nrmse, 1.5 * nrmse],
            "correlation_per_step": [1.0, 0.9, 0.5 - nrmse / 10],
            "spectrum_last_step": {"prediction": [4.0, 2.0 * nrmse], "truth": [4.0, 1.0]},
            "ensemble_fan": {"point": [1, 1], "members": [[0.1, 0.2, 0.3]] * members, "truth": [0.1, 0.2, 0.4]},
            "windows": {"1-1": window, "2-3": window}}


def _eval(shift: float) -> dict:
    return {"tasks": {
        "ns2d_kolmogorov": {"references": {"persistence": {"nrmse": 1.3}, "training_mean": {"nrmse": 1.0}},
                            "variants": {"operator": _variant(1.0 + shift, 4.0 + shift, 2.0, 1),
                                         "operator+diffusion": _variant(0.8 + shift, 6.0, 9.0, 4)}},
        "darcy2d": {"references": {}, "variants": {"steady": {"nrmse": 0.1}}}}}


def test_scores_over_seeds_are_mean_and_sample_std_of_each_seed(tmp_path):
    stats = refinement.across_seeds([_eval(0.0), _eval(0.2), _eval(0.4)])
    assert list(stats) == ["ns2d_kolmogorov"]  # the steady task has no lead times
    op = stats["ns2d_kolmogorov"]["variants"]["operator"]
    assert op["nrmse"]["per_seed"] == [1.0, 1.2, 1.4]
    assert op["nrmse"]["mean"] == pytest.approx(1.2) and op["nrmse"]["std"] == pytest.approx(0.2)
    assert op["correlation_time"]["mean"] == pytest.approx(4.2)
    assert op["windows"]["2-3"]["spread_skill"]["mean"] is None  # a point forecast has none
    diff = stats["ns2d_kolmogorov"]["variants"]["operator+diffusion"]
    assert diff["windows"]["1-1"]["ensemble_mean_nrmse"]["mean"] == pytest.approx(0.9 * 1.0)
    assert diff["nrmse_per_step_mean"] == pytest.approx([statistics.mean([0.4, 0.5, 0.6]), 1.0, 1.5])
    assert op["correlation_per_step_mean"] == pytest.approx([1.0, 0.9, 0.5 - 0.12])
    # Key by key: pytest 9.2's approx refuses a dict whose values are lists.
    spectrum = op["spectrum_last_step_mean"]
    assert sorted(spectrum) == ["prediction", "truth"]
    assert spectrum["prediction"] == pytest.approx([4.0, 2.4]) and spectrum["truth"] == pytest.approx([4.0, 1.0])
    text = refinement.report(stats, "# head")
    assert text.count("| operator+diffusion | ") == 1 + 2  # its run row and one per window
    assert "| operator | 1 | 1.2 ± 0.2 |" in text
    assert "persistence 1.3 ± 0, training_mean 1 ± 0" in text
    png = refinement.write_plot(stats, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_seeds_exit_2_with_one_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {tasks: [{name: advection1d, param: 0.1}]}\nlatent: {tokens: 16, dim: 8}\n")
    assert refinement.main(["--config", str(cfg), "--seeds", "0,x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--seeds" in err[0], err


def test_an_evaluation_of_this_exact_config_is_read_back_and_any_other_is_run(tmp_path, monkeypatch):
    import orjson

    from entry.config.cli import load_resolved
    from entry.config.load import config_hash
    from entry.storage.run_folder import evaluation_file, run_dir_for

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("data: {tasks: [{name: advection1d, param: 0.1}]}\nlatent: {tokens: 16, dim: 8}\n"
                        f"logging: {{run_dir: {tmp_path / 'runs'}}}\n")
    calls = []

    def fake_pipeline(cmd, env):  # what entry.pipeline leaves behind: the evaluation file of its config
        calls.append(cmd)
        sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
        cfg = load_resolved(str(cfg_file), sets)  # as entry.pipeline runs it
        path = evaluation_file(run_dir_for(cfg), cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps({"config_hash": config_hash(cfg), "run": len(calls)}))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(refinement.subprocess, "run", fake_pipeline)
    first = refinement.run_seed(str(cfg_file), [], "c", 0)
    assert first["run"] == 1 and len(calls) == 1
    assert refinement.run_seed(str(cfg_file), [], "c", 0)["run"] == 1 and len(calls) == 1  # read back
    # Run control changes what the evaluation measures, so another sampler is evaluated again.
    assert refinement.run_seed(str(cfg_file), ["consistency.sample_steps=2"], "c", 0)["run"] == 2
    assert refinement.run_seed(str(cfg_file), [], "c", 0, fresh=True)["run"] == 3
    weights = tmp_path / "runs" / "c-s0" / "operator.pt"  # a stage trained again after the evaluation
    weights.write_bytes(b"")
    later = (tmp_path / "runs" / "c-s0" / "eval.json").stat().st_mtime + 1
    os.utime(weights, (later, later))
    assert refinement.run_seed(str(cfg_file), [], "c", 0)["run"] == 4
    assert refinement.run_seed(str(cfg_file), [], "c", 1)["run"] == 5  # another seed, its own folder


def test_the_command_writes_its_scores_and_a_report_naming_the_commit(tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {tasks: [{name: ns2d_kolmogorov, param: 0.01}]}\nlatent: {tokens: 16, dim: 8}\n"
                   f"logging: {{run_dir: {tmp_path / 'runs'}, plots: false}}\n")
    monkeypatch.setattr(refinement, "run_seed", lambda config, more, name, seed, fresh: _eval(0.2 * seed))
    monkeypatch.setattr(refinement, "record_stamp", lambda device: {"git_commit": "0123456789abcdef", "dirty": True})
    out = tmp_path / "r.json"
    assert refinement.main(["--config", str(cfg), "--seeds", "0,1", "--out", str(out)]) == 0
    head = out.with_suffix(".md").read_text().splitlines()[2]
    assert head.endswith("--seeds 0,1`, commit 0123456789 (uncommitted changes)"), head
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
