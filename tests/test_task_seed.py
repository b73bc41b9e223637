"""A generated task's root seed: where it comes from, that it is in the hash only when it changes the data, and
that a file drawn with another seed (another config made it, the task at another place) is refused in one line
instead of silently trained on."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from entry.config.load import ConfigError, config_hash, load_config
from entry.data.files import ensure_data, is_declared, task_path
from pipelines.generate import generated_seed

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if not p.name.startswith("_"))
SMALL = {"samples": 4, "nx": 32, "nt": 5}


def _tree(root: Path, *tasks: dict, seed: int = 0) -> dict:
    tree = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    tree["data"] = {"root": str(root), "generate_if_missing": True, "seed": seed, "tasks": list(tasks)}
    return tree


ADVECTION = {"name": "advection1d", "param": 0.1, **SMALL}
BURGERS = {"name": "burgers1d", "param": 0.01, **SMALL}


def test_a_task_draws_the_data_seed_plus_its_place_unless_it_sets_its_own(tmp_path):
    cfg = load_config(tree=_tree(tmp_path, ADVECTION, BURGERS, {**BURGERS, "param": 0.1, "seed": 9}, seed=5))
    assert [cfg.data.task_seed(i) for i in range(3)] == [5, 6, 9]


def test_a_seed_is_hashed_only_where_it_changes_the_data(tmp_path):
    base = config_hash(load_config(tree=_tree(tmp_path, ADVECTION, BURGERS, seed=5)))
    same = config_hash(load_config(tree=_tree(tmp_path, ADVECTION, {**BURGERS, "seed": 6}, seed=5)))
    other = config_hash(load_config(tree=_tree(tmp_path, ADVECTION, {**BURGERS, "seed": 5}, seed=5)))
    assert same == base != other


def test_a_declared_file_takes_no_seed(tmp_path):
    with pytest.raises(ConfigError, match="seed applies to generated tasks"):
        load_config(tree=_tree(tmp_path, {"path": str(tmp_path / "x.h5"), "layout": "pdebench", "seed": 1}))


def test_a_file_drawn_with_another_seed_is_refused_naming_the_seed_that_reads_it(tmp_path):
    """The mixture (Burgers second: seed 1) makes the file; the single-task config (Burgers first: seed 0) is
    refused before anything is written, and trains on it once it sets the file's seed."""
    (path,) = ensure_data(load_config(tree=_tree(tmp_path, ADVECTION, BURGERS)))[1:]
    assert generated_seed(path) == 1
    before = path.read_bytes()
    alone = load_config(tree=_tree(tmp_path, BURGERS))
    with pytest.raises(ConfigError) as err:
        ensure_data(alone)
    line = str(err.value)
    assert "\n" not in line and "data.tasks[0]" in line and "seed 1" in line and "set seed: 1" in line
    assert path.read_bytes() == before
    assert ensure_data(load_config(tree=_tree(tmp_path, {**BURGERS, "seed": 1}))) == [path]


def test_check_config_exits_2_on_a_file_of_another_seed(tmp_path):
    ensure_data(load_config(tree=_tree(tmp_path / "data", ADVECTION, BURGERS)))
    cfg_file = tmp_path / "alone.yaml"
    cfg_file.write_text(yaml.safe_dump(_tree(tmp_path / "data", BURGERS)))
    proc = subprocess.run([sys.executable, "-m", "entry.check_config", "--config", str(cfg_file)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "set seed: 1" in proc.stderr, proc.stderr


def test_no_two_shipped_configs_draw_one_generated_file_with_different_seeds():
    """Configs that share a data folder share its files: a task listed at another place pins the seed of the
    config that draws it first (its single-task config), or a user running both is refused."""
    seeds = collections.defaultdict(dict)
    for path in SHIPPED:
        cfg = load_config(path)
        for i, task in enumerate(cfg.data.tasks):
            if not is_declared(task):
                seeds[str(task_path(cfg, task))][path.relative_to(ROOT).as_posix()] = cfg.data.task_seed(i)
    clashes = {file: by for file, by in seeds.items() if len(set(by.values())) > 1}
    assert not clashes
