"""Reference numbers: bench/reference/pdebench.json is well formed, and configs/multitask.yaml names the three tasks."""

import json
import math
from pathlib import Path

import pytest

from entry.config.load import load_config

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "bench" / "reference" / "pdebench.json"
MULTITASK = ROOT / "configs" / "multitask.yaml"

TASKS = {"advection1d", "burgers1d", "darcy2d"}
MODELS = {"FNO", "U-Net", "PINN"}
CONVENTIONS = {"pdebench2022", "predicted_steps_only"}


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


def test_reference_top_level(reference):
    assert isinstance(reference["metric_note"], str) and reference["metric_note"].strip()
    assert isinstance(reference["entries"], list) and reference["entries"]
    assert isinstance(reference["timing"], list)
    assert isinstance(reference["metric_issue"], dict)
    assert isinstance(reference.get("missing", []), list)


def test_reference_entries_have_valid_fields(reference):
    for i, entry in enumerate(reference["entries"]):
        where = f"entries[{i}]"
        assert entry["task"] in TASKS, where
        assert isinstance(entry["param"], (int, float)) and not isinstance(entry["param"], bool), where
        assert entry["param"] > 0, where
        assert entry["model"] in MODELS, where
        nrmse = entry["nrmse"]
        assert isinstance(nrmse, (int, float)) and not isinstance(nrmse, bool), where
        assert math.isfinite(nrmse) and 0 < nrmse < 1, where
        assert entry["convention"] in CONVENTIONS, where
        assert isinstance(entry["source"], str), where
        assert isinstance(entry["verified"], bool), where
        assert isinstance(entry["note"], str), where


def test_verified_values_name_a_source(reference):
    for i, entry in enumerate(reference["entries"]):
        if entry["verified"]:
            assert entry["source"].strip(), f"entries[{i}] is verified but has no source"
    issue = reference["metric_issue"]
    if issue.get("verified"):
        assert issue.get("url", "").strip()
    for i, item in enumerate(reference["timing"]):
        assert isinstance(item.get("verified"), bool), f"timing[{i}]"
        if item["verified"]:
            assert item.get("source", "").strip(), f"timing[{i}] is verified but has no source"


def test_unverified_values_say_so(reference):
    for i, entry in enumerate(reference["entries"]):
        if not entry["verified"]:
            assert entry["note"].strip(), f"entries[{i}] is unverified and its note does not say what was found"


def test_multitask_config_names_the_three_tasks():
    cfg = load_config(MULTITASK)
    by_name = {t.name: t for t in cfg.data.tasks}
    assert set(by_name) == TASKS and len(cfg.data.tasks) == 3
    assert by_name["advection1d"].param == pytest.approx(0.1)
    assert by_name["burgers1d"].param == pytest.approx(0.01)
    assert by_name["darcy2d"].param == pytest.approx(1.0)
    tokens = cfg.latent.tokens
    assert tokens > 0 and 4 ** round(math.log(tokens, 4)) == tokens, "latent.tokens must be a power of 4"
    assert "steady" in cfg.stages
