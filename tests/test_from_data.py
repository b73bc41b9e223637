"""A config that names only its data (`data.tasks` declared, `logging`) gets every other section from
the data's description (entry.config.from_data): valid configs for 1D/2D, 1 or 3 channels, steady
or not; the choices printed in one block and recorded in config.json; a section the user gives
wins; and a stage that published its untrained start says so.

Legend: N trajectories, T stored steps, C channels, X/Y grid points.
"""

from __future__ import annotations

import math

import h5py
import numpy as np
import orjson
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from entry.check_config import main as check_config
from entry.config.from_data import DataFacts, derive_sections, latent_section
from entry.config.load import ConfigError, config_hash, config_to_dict, load_config
from entry.config.schema import LatentConfig
from entry.distributed.process_group import DistInfo
from entry.evaluation.table import format_table
from entry.storage.run_folder import write_run_header
from tests import tiny_run as tr

INFO = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)

CASES = {
    # name: (axes of the state, shape [N, T?, X, Y?, C?], an input field's shape or None)
    "1d_1ch": ("n t x", (20, 11, 64), None),
    "1d_3ch": ("n t x c", (20, 11, 64, 3), None),
    "2d_1ch": ("n t x y", (20, 6, 32, 32), None),
    "2d_3ch_64": ("n t x y c", (20, 6, 64, 64, 3), None),
    "2d_steady": ("n x y", (20, 32, 32), (20, 32, 32)),
}


def _declared(tmp_path, case: str) -> dict:
    """A user's HDF5 file of `case` (random smooth-enough values: only shapes matter here) and the
    three-key config tree that declares it."""
    axes, shape, inputs = CASES[case]
    rng = np.random.default_rng(0)
    path = tmp_path / f"{case}.h5"
    fields = [{"key": "u", "axes": axes}]
    with h5py.File(path, "w") as f:
        f["u"] = rng.standard_normal(shape).astype(np.float32)
        if inputs is not None:
            f["a"] = rng.standard_normal(inputs).astype(np.float32)
            fields.append({"key": "a", "axes": "n x y", "input": True})
    task = {"path": str(path), "layout": "hdf5", "hdf5": {"fields": fields}}
    return {"data": {"tasks": [task]},
            "logging": {"run_dir": str(tmp_path / "runs"), "wandb": {"mode": "disabled"}, "progress": False}}


def _write(tmp_path, tree: dict, name: str = "cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_derived_config_passes_check_config_and_prints_its_block(tmp_path, case, capsys):
    path = _write(tmp_path, _declared(tmp_path, case))
    assert check_config(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    cfg = load_config(path)
    assert cfg.derived and cfg.derived[0].startswith("derived from the data")
    assert all(line in out for line in cfg.derived)  # one block, every line of it
    steady = case.endswith("steady")
    assert ("steady" in cfg.stages) == steady and ("operator" in cfg.stages) == (not steady)
    assert "diffusion" not in cfg.stages and any("refiners" in line for line in cfg.derived)
    assert cfg.training.max_train_s > 0 and cfg.evaluation.select == "best"
    # Never the global linear path's dense covariance (minutes to fit at 64^2 x 3).
    assert cfg.latent.linear == "local"


def test_small_fields_get_the_exact_codec_and_large_ones_a_conv_patch_that_divides_the_grid(tmp_path):
    small = load_config(_write(tmp_path, _declared(tmp_path, "2d_1ch"), "small.yaml")).latent
    assert small.codec == "grid" and small.dim == 16 * 1 and small.tokens == 64  # 8 x 8 cells of 4 x 4 points
    large = load_config(_write(tmp_path, _declared(tmp_path, "2d_3ch_64"), "large.yaml")).latent
    assert large.codec == "conv" and 64 % large.patch == 0 and (64 // large.patch) == 8
    assert large.dim <= 3 * large.patch ** 2


def test_a_section_the_config_gives_is_merged_over_the_derived_one_and_set_wins(tmp_path):
    tree = _declared(tmp_path, "1d_1ch")
    derived = load_config(_write(tmp_path, tree, "plain.yaml"))
    tree["operator"] = {"steps": 7}
    tree["stages"] = ["autoencoder", "cache", "operator"]
    cfg = load_config(_write(tmp_path, tree), ["latent.dim=32", "training.max_train_s=0"])
    assert cfg.operator.steps == 7 and cfg.stages == ("autoencoder", "cache", "operator")
    # The rest of the derived operator stays.
    assert cfg.operator.pdet == derived.operator.pdet and cfg.operator.batch_size == derived.operator.batch_size
    assert cfg.latent.dim == 32 and cfg.latent.tokens == derived.latent.tokens  # --set changes one derived key
    assert cfg.training.max_train_s == 0


def test_a_config_that_names_its_latent_derives_nothing(tmp_path):
    tree = _declared(tmp_path, "1d_1ch") | {"latent": {"tokens": 8, "dim": 8}}
    cfg = load_config(_write(tmp_path, tree))
    assert cfg.derived == () and cfg.operator.steps == 100  # the schema's defaults, as before


def test_derived_is_the_loaders_to_write(tmp_path):
    tree = _declared(tmp_path, "1d_1ch") | {"derived": ["mine"]}
    with pytest.raises(ConfigError, match="derived: the loader writes it"):
        load_config(_write(tmp_path, tree))


def test_a_generated_task_without_latent_names_what_to_do(tmp_path):
    tree = {"data": {"tasks": [{"name": "burgers1d", "param": 0.01}]}}
    with pytest.raises(ConfigError, match=r"missing required key\(s\) \['latent'\]: .*declared"):
        load_config(tree=tree)


def test_config_json_records_the_derived_sections_and_their_block_and_the_hash_is_the_written_out_config(tmp_path):
    cfg = load_config(_write(tmp_path, _declared(tmp_path, "2d_3ch_64")))
    write_run_header(tmp_path / "run", cfg, INFO)
    recorded = orjson.loads((tmp_path / "run" / "config.json").read_bytes())
    assert recorded["config"]["derived"] == list(cfg.derived)
    assert recorded["config"]["latent"] == config_to_dict(cfg.latent)
    assert recorded["config"]["operator"] == config_to_dict(cfg.operator)
    # The same config written out by hand (every section named) has the same hash: the derived
    # block is a record, not an input.
    written = {k: v for k, v in recorded["config"].items() if k != "derived"}
    again = load_config(tree=written)
    assert again.derived == () and config_hash(again) == config_hash(cfg) == recorded["config_hash"]
    # A run's config.json reloads as it is (entry.inference.load_run, a config_to_dict tree): the
    # derived block is kept, nothing is derived again.
    reloaded = load_config(tree=recorded["config"])
    assert reloaded == cfg and config_hash(reloaded) == recorded["config_hash"]


@settings(max_examples=60, deadline=None)
@given(dims=st.sampled_from([1, 2, 3]), channels=st.integers(1, 6), side=st.sampled_from([16, 24, 32, 48, 64, 100, 128, 256]),
       steps=st.integers(1, 60), trajectories=st.integers(1, 400))
def test_every_derived_latent_is_a_valid_codec_the_frames_support(dims, channels, side, steps, trajectories):
    side = side if dims < 3 else min(side, 64)
    grid = (side * (4 if dims == 1 else 1),) + (side,) * (dims - 1)
    facts = DataFacts(name="t", dims=dims, channels=channels, grid=grid, same_grid=True, steps=steps,
                      steady=steps == 1, dynamic=steps > 1, train_trajectories=trajectories)
    tree, _ = latent_section(facts)
    latent = LatentConfig(**tree)
    numbers = channels * math.prod(grid)
    if latent.codec == "conv":
        cells = [n // latent.patch for n in grid]
        assert all(n % latent.patch == 0 for n in grid)
        assert dims == 1 or (len(set(cells)) == 1 and cells[0] & (cells[0] - 1) == 0)  # pdet_unet's Morton grid
        assert latent.dim <= channels * latent.patch ** dims
    tokens = latent.tokens or math.prod(n // latent.patch for n in grid)
    # Never the global path's dense covariance of whole fields (minutes to fit at 64^2 x 3).
    assert tokens <= 512 and latent.linear == "local" and latent.hidden == 0
    # A compressed latent keeps at least 10 fitted samples (cells x frames) per number it keeps.
    if latent.dim * tokens < numbers:
        assert min(trajectories * steps, 8192) * tokens >= 10 * latent.dim or latent.dim == channels
    sections, lines = derive_sections(facts)
    assert ("operator" in sections) == (steps > 1) and ("steady" in sections) == (steps == 1)
    assert sections["stages"][-1] == "evaluate" and len(lines) >= 4


def test_the_summary_says_when_a_stage_published_its_untrained_start_or_a_model_is_no_better_than_persistence():
    scores = {"nrmse": 0.5, "nrmse_pdebench2022": 0.4, "one_step_nrmse": 0.1, "rmse": 1.0, "max_error": 2.0,
              "frmse_high": 0.1}
    tree = {"published": {"operator": {"best_step": 0, "best_val_nrmse": 0.52}},
            "tasks": {"flow": {"n_test_samples": 3, "codec": {"nrmse": 0.01, "rmse": 0.1, "max_error": 0.2},
                               "references": {"persistence": scores},
                               "variants": {"operator": scores | {"nrmse": 0.6}}}}}
    text = format_table(tree)
    assert "operator: the published weights are its untrained start" in text
    assert "operator does not beat persistence on flow: test nRMSE 0.6 against 0.5" in text
    assert "more training trajectories" in text
    tree["published"]["operator"]["best_step"] = 300
    tree["tasks"]["flow"]["variants"]["operator"]["nrmse"] = 0.2
    assert "untrained start" not in format_table(tree) and "does not beat" not in format_table(tree)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stage_that_publishes_its_untrained_start_says_so_in_its_log(tmp_path):
    """A tiny run whose learning rate cannot move a float32 weight: no validation beats step 0's."""
    tree = tr.tiny_tree(tmp_path)
    tree["operator"].update(steps=4, lr=1e-30)
    tree["evaluation"] = {"val_every": 2, "val_samples": 2, "select": "best"}
    tr.prepare(tmp_path, tree)
    proc = tr.launch(tmp_path, ["--set", "logging.run_name=base"], nproc=1, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = orjson.loads((tmp_path / "runs" / "base" / "operator.done.json").read_bytes())
    assert done["best_step"] == 0
    log = (tmp_path / "runs" / "base" / "rank0.log").read_text()
    lines = [line for line in log.splitlines() if "the published weights are its untrained start" in line]
    assert len(lines) == 1 and "persistence" in lines[0] and "try more training trajectories" in lines[0]
