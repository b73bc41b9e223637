"""The race across tasks (`bench.race_summary`): its table holds every store's scored records (means,
spreads, the best peer, ours over it), names a model that got worse with more budget beyond its seed
spread and the seeds still owed, scores a published field alone where a task has one, and README's
race section is its output verbatim."""

from __future__ import annotations

import statistics

import pytest

from bench import race_summary
from bench.result_store import record
from tests.tiny_run import ROOT


def _store(path, task: str, scores: dict[tuple[str, int], list[float]], *, channels: int = 1, base_s: float = 60):
    """A race store of ``task``: per (model, rung), one scored record per seed with that test nRMSE
    (field c of a task at the score times c + 2, so that each field differs from the mean), plus records
    the summary must skip: a recipe sweep's, a calibration's, an ablation of ours."""
    for (model, rung), values in scores.items():
        for seed, v in enumerate(values):
            per_channel = [v * (c + 2) for c in range(channels)]
            record(path, f"{model}@{rung}", seed, {"task": task, "budget_s": base_s * rung, "test_nrmse": v,
                                                  "test": {"nrmse_per_channel": per_channel}})
            record(path, f"{model}@{rung}@loop:one_step:b16:lr=0.001", seed, {"task": task, "test_nrmse": 9.0})
    record(path, "ours@calibration", 0, {"step_s": 0.1, "task": task})
    record(path, "ours-no_codec@1", 0, {"task": task, "budget_s": base_s, "test_nrmse": 1e-9})
    return path


def test_the_table_holds_every_model_mean_spread_best_peer_and_ratio(tmp_path):
    ours, fno, unet = [0.30, 0.34, 0.32], [0.10, 0.11, 0.12], [0.50, 0.52, 0.54]
    store = _store(tmp_path / "race-burgers1d.jsonl", "burgers1d",
                   {("ours", 1): ours, ("fno", 1): fno, ("unet", 1): unet,
                    ("ours", 4): [0.05, 0.07, 0.06], ("fno", 4): [0.08, 0.09, 0.10], ("unet", 4): [0.4, 0.41, 0.42]})
    text = race_summary.summary([store])
    lines = text.splitlines()
    assert lines[0] == "| task | budget | ours | best peer | ours / best peer | fno | unet |"
    first = lines[2].split(" | ")
    assert first[:4] == ["| burgers1d", "60 s", f"0.32 ± {statistics.stdev(ours):.2g}", "fno"]
    assert first[5] == f"**0.11 ± {statistics.stdev(fno):.2g}**" and first[6].startswith("0.52 ± ")
    assert first[4].startswith(f"{0.32 / 0.11:.2f}x ± ")
    second = lines[3].split(" | ")
    assert second[1] == "240 s" and second[4].startswith(f"{0.06 / 0.09:.2f}x")
    # Ours is ahead at 240 s only; no model got worse with the budget; nothing owed.
    assert "Ours is below the best peer's mean at burgers1d at 240 s, and behind on the other 1 rows" in text
    assert "No model's mean rises from one rung to the next by more than its seed spread." in text
    assert "owed" not in text and "ours-no_codec" not in text


def test_a_model_worse_with_more_budget_beyond_its_spread_is_named_and_within_it_is_not(tmp_path):
    store = _store(tmp_path / "race-advection1d.jsonl", "advection1d",
                   {("ours", 1): [0.2, 0.2, 0.2], ("fno", 1): [0.10, 0.11, 0.12], ("unet", 1): [0.50, 0.6, 0.7],
                    ("ours", 4): [0.1, 0.1, 0.1], ("fno", 4): [0.20, 0.21, 0.22], ("unet", 4): [0.55, 0.65, 0.75]})
    assert race_summary.rises(race_summary.scored(store)[2]) == ["fno 1 → 4: 0.11 → 0.21 (spread 0.01)"]
    assert "advection1d: fno 1 → 4: 0.11 → 0.21" in race_summary.summary([store])


def test_a_published_field_gets_its_own_rows_and_missing_seeds_are_owed(tmp_path):
    store = _store(tmp_path / "race-ns2d.jsonl", "ns2d",
                   {("ours", 1): [0.3, 0.3, 0.3], ("fno", 1): [0.1, 0.1, 0.1], ("unet", 1): [0.2, 0.2, 0.2],
                    ("ours", 4): [0.2, 0.2, 0.2], ("fno", 4): [0.05, 0.05]}, channels=3, base_s=120)
    text = race_summary.summary([store])
    vorticity = [line for line in text.splitlines() if line.startswith("| ns2d, vorticity alone |")]
    # Vorticity is ns2d's first field (pipelines.tasks): twice each record's score here.
    assert [line.split(" | ")[1:4] for line in vorticity] == [["120 s", "0.6 ± 0", "fno"], ["480 s", "0.4 ± 0", "fno"]]
    assert "| ns2d | 480 s | 0.2 ± 0 | fno | 4.00x ± 0.00 | **0.05 ± 0 (2)** | — |" in text
    assert "Seeds still owed: ns2d at 480 s: fno 2 of 3, unet 0 of 3." in text


def test_write_fills_the_markers_and_check_tells_a_stale_page(tmp_path, capsys):
    store = tmp_path / "race-darcy2d.jsonl"
    _store(store, "darcy2d", {("ours", 1): [0.2, 0.3], ("fno", 1): [0.1, 0.2]})
    page = tmp_path / "README.md"
    page.write_text(f"intro\n{race_summary.BEGIN}\nold table\n{race_summary.END}\nmore\n")
    assert race_summary.main([str(store), "--check", str(page)]) == 1
    assert "differs from the stores'" in capsys.readouterr().err
    assert race_summary.main([str(store), "--write", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{race_summary.END}\nmore\n") and "old table" not in text
    assert race_summary.summary([store]) in text and race_summary.main([str(store), "--check", str(page)]) == 0
    _store(store, "darcy2d", {("fno", 4): [0.05]})  # a new record: the page is stale again
    assert race_summary.main([str(store), "--check", str(page)]) == 1
    (tmp_path / "cfg.yaml").write_text("no markers\n")
    (tmp_path / "other.jsonl").write_text('{"model": "fno@calibration", "seed": 0, "payload": {}}\n')
    for argv in ([str(tmp_path / "missing.jsonl")], [str(tmp_path / "other.jsonl")],
                 [str(store), "--write", str(tmp_path / "cfg.yaml")]):
        with pytest.raises(SystemExit) as exit_:
            race_summary.main(argv)
        assert exit_.value.code == 2
    assert (tmp_path / "cfg.yaml").read_text() == "no markers\n"


def test_readme_race_section_is_the_summary_of_the_committed_stores():
    stores = race_summary.default_stores()
    assert [s.name for s in stores] == [f"race-{t}.jsonl" for t in ("advection1d", "burgers1d", "darcy2d", "ns2d")]
    assert race_summary.main(["--check", str(ROOT / "README.md")]) == 0, "run python -m bench.race_summary"
