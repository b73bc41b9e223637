"""Configs that build on a base (`base:`, entry.config.base; issue 25, item 4): a config on bases
resolves to the tree and hash of the same settings in one file, lists and nulls replace, overrides
come after the merge, each mistake is one `ConfigError` line naming the file, and the shipped
configs are short files on their bases whose comments say what a setting is, not what a run gave."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from entry.config.base import merge_trees
from entry.config.load import ConfigError, config_hash, config_to_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def is_base(path: Path) -> bool:
    """A base file (`_*.yaml`) only completes the configs that name it; it is never run alone."""
    return path.name.startswith("_")


SHIPPED = sorted(p for p in CONFIGS.rglob("*.yaml") if not is_base(p))
BASES = sorted(p for p in CONFIGS.rglob("*.yaml") if is_base(p))
REDUCED = [p for p in SHIPPED if p.parent == CONFIGS / "reduced"]

BASE = """\
data: {root: data/x, tasks: [{name: advection1d, param: 0.1}, {name: burgers1d, param: 0.01}]}
latent: {tokens: 8, dim: 8}
operator: {steps: 10, lr: 1.0e-3, pdet: {hidden_dim: 32, num_heads: 2, depths: [2, 2, 2]}}
logging: {run_name: base}
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def resolved(path: Path, overrides: list[str] = ()) -> tuple[dict, str]:
    cfg = load_config(path, overrides)
    return config_to_dict(cfg), config_hash(cfg)


def test_a_config_on_a_base_equals_the_same_settings_in_one_file(tmp_path):
    write(tmp_path, "_base.yaml", BASE)
    child = write(tmp_path, "child.yaml", "base: _base.yaml\noperator: {steps: 20, pdet: {hidden_dim: 64}}\n"
                                          "logging: {run_name: child}\n")
    one = write(tmp_path, "one.yaml", """\
data: {root: data/x, tasks: [{name: advection1d, param: 0.1}, {name: burgers1d, param: 0.01}]}
latent: {tokens: 8, dim: 8}
operator: {steps: 20, lr: 1.0e-3, pdet: {hidden_dim: 64, num_heads: 2, depths: [2, 2, 2]}}
logging: {run_name: child}
""")
    tree, digest = resolved(child)
    assert (tree, digest) == resolved(one)
    assert "base" not in tree  # config.json records the resolved tree
    assert tree["operator"]["pdet"]["num_heads"] == 2 and tree["operator"]["lr"] == 1e-3  # merged, not replaced


def test_bases_nest_and_are_found_relative_to_the_file_that_names_them(tmp_path):
    write(tmp_path, "common/_root.yaml", BASE)
    write(tmp_path, "common/_mid.yaml", "base: _root.yaml\noperator: {steps: 30}\nlatent: {dim: 16}\n")
    child = write(tmp_path, "runs/deep/child.yaml", "base: ../../common/_mid.yaml\nlatent: {tokens: 4}\n")
    tree, _ = resolved(child)
    assert tree["operator"]["steps"] == 30 and tree["operator"]["pdet"]["hidden_dim"] == 32
    assert (tree["latent"]["tokens"], tree["latent"]["dim"]) == (4, 16)


def test_a_list_of_bases_merges_in_order(tmp_path):
    write(tmp_path, "_base.yaml", BASE)
    write(tmp_path, "_a.yaml", "operator: {steps: 1, lr: 2.0e-3}\n")
    write(tmp_path, "_b.yaml", "operator: {steps: 2}\n")
    tree, _ = resolved(write(tmp_path, "c.yaml", "base: [_base.yaml, _a.yaml, _b.yaml]\n"))
    assert (tree["operator"]["steps"], tree["operator"]["lr"]) == (2, 2e-3)
    assert resolved(write(tmp_path, "none.yaml", "base: []\n" + BASE)) == resolved(write(tmp_path, "p.yaml", BASE))


def test_a_list_replaces_the_bases_list(tmp_path):
    write(tmp_path, "_base.yaml", BASE)
    child = write(tmp_path, "c.yaml", "base: _base.yaml\ndata: {tasks: [{name: burgers1d, param: 0.02}]}\n"
                                      "operator: {pdet: {depths: [1]}}\n")
    tree, _ = resolved(child)
    assert [t["param"] for t in tree["data"]["tasks"]] == [0.02] and tree["data"]["root"] == "data/x"
    assert tree["operator"]["pdet"]["depths"] == [1]


def test_merge_trees_replaces_lists_scalars_and_null_and_changes_neither_input():
    base = {"a": {"b": 1, "c": [1, 2]}, "d": {"e": 1}, "f": 1}
    over = {"a": {"c": [3]}, "d": None, "g": {"h": 2}}
    assert merge_trees(base, over) == {"a": {"b": 1, "c": [3]}, "d": None, "f": 1, "g": {"h": 2}}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": {"e": 1}, "f": 1} and over["a"] == {"c": [3]}


def test_an_explicit_null_replaces_a_section(tmp_path):
    write(tmp_path, "_base.yaml", BASE)
    with pytest.raises(ConfigError, match=r"^operator must be a mapping .*got NoneType None$"):
        load_config(write(tmp_path, "c.yaml", "base: _base.yaml\noperator: null\n"))


def test_merging_an_alias_graph_walks_the_graph_not_its_unfolding():
    """YAML aliases make a few hundred bytes a graph of 9**12 paths, or one that holds itself."""
    level: dict = {"x": 1}
    for _ in range(12):
        level = {f"k{i}": level for i in range(9)}
    looped: dict = {"x": 1}
    looped["self"] = looped
    start = time.perf_counter()
    assert merge_trees(level, level)["k0"]["k8"]["k3"] is not None
    assert merge_trees(looped, looped)["self"]["self"]["x"] == 1
    assert time.perf_counter() - start < 10.0  # milliseconds walked; hours unfolded: no machine is near the bound


def test_overrides_apply_after_the_merge(tmp_path):
    write(tmp_path, "_base.yaml", BASE)
    child = write(tmp_path, "c.yaml", "base: _base.yaml\noperator: {steps: 20}\n")
    tree, digest = resolved(child, ["operator.steps=7", "operator.pdet.num_heads=4", "data.tasks.1.param=0.02"])
    assert (tree["operator"]["steps"], tree["operator"]["pdet"]["num_heads"], tree["data"]["tasks"][1]["param"]) \
        == (7, 4, 0.02)
    assert digest != resolved(child)[1]
    with pytest.raises(ConfigError, match=r"unknown key 'base'"):  # a base is named in a file, not by --set
        load_config(child, ["base=_base.yaml"])


def test_validation_sees_the_merged_tree(tmp_path):
    write(tmp_path, "_base.yaml", BASE)
    with pytest.raises(ConfigError, match=r"unknown key 'operator.stpes' \(did you mean 'operator.steps'\?\)"):
        load_config(write(tmp_path, "c.yaml", "base: _base.yaml\noperator: {stpes: 20}\n"))
    write(tmp_path, "_bad.yaml", "operator: {lr: -1}\n")
    with pytest.raises(ConfigError, match=r"operator.lr must be > 0"):  # a bad value in a base is found too
        load_config(write(tmp_path, "d.yaml", "base: [_base.yaml, _bad.yaml]\n"))


def one_line_error(path: Path) -> str:
    """The ConfigError loading `path` raises: one line, naming `path`."""
    with pytest.raises(ConfigError) as e:
        load_config(path)
    message = str(e.value)
    # Short whatever the value: what is left without the folder's name (a temporary folder's name
    # is over 100 characters on macOS, and messages show paths whole).
    assert "\n" not in message and len(message.replace(str(path.parent), "")) < 500 and str(path) in message, message
    return message


def test_a_missing_base_names_the_resolved_path_and_the_file_naming_it(tmp_path):
    child = write(tmp_path, "sub/c.yaml", "base: ../nowhere/_base.yaml\n" + BASE)
    message = one_line_error(child)
    assert f"base '../nowhere/_base.yaml' not found (resolved to {(tmp_path / 'nowhere/_base.yaml').resolve()})" \
        in message
    (tmp_path / "_dir.yaml").mkdir()
    assert "base[0] '_dir.yaml' is a directory" in one_line_error(write(tmp_path, "d.yaml", "base: [_dir.yaml]\n"))


def test_a_cycle_of_bases_names_the_chain(tmp_path):
    a = write(tmp_path, "a.yaml", "base: _b.yaml\n" + BASE)
    write(tmp_path, "_b.yaml", "base: sub/../_c.yaml\n")
    write(tmp_path, "_c.yaml", "base: a.yaml\n")
    message = one_line_error(a)
    assert message == (f"{tmp_path / '_c.yaml'}: base makes a cycle of bases: {a} -> {tmp_path / '_b.yaml'} -> "
                       f"{tmp_path / '_c.yaml'} -> {a}")
    itself = write(tmp_path, "self.yaml", "base: [self.yaml]\n")
    assert one_line_error(itself).endswith(f"base[0] makes a cycle of bases: {itself} -> {itself}")


def test_a_base_reached_twice_without_a_cycle_is_fine(tmp_path):
    write(tmp_path, "_root.yaml", BASE)
    write(tmp_path, "_a.yaml", "base: _root.yaml\noperator: {steps: 1}\n")
    write(tmp_path, "_b.yaml", "base: _root.yaml\nlatent: {dim: 4}\n")
    tree, _ = resolved(write(tmp_path, "c.yaml", "base: [_a.yaml, _b.yaml]\n"))
    assert (tree["operator"]["steps"], tree["latent"]["dim"]) == (10, 4)  # _b's copy of _root comes last


@pytest.mark.parametrize("text, needle", [
    ("[1, 2]", "base '_base.yaml' must be a mapping of sections, got list [1, 2]"),
    ("just text", "base '_base.yaml' must be a mapping of sections, got str 'just text'"),
    ("a: [1", "_base.yaml is not valid YAML"),
    ("a: 1\na: 2\n", "duplicate key 'a'"),
])
def test_a_base_that_is_not_a_mapping_of_sections(tmp_path, text, needle):
    write(tmp_path, "_base.yaml", text)
    assert needle in one_line_error(write(tmp_path, "c.yaml", "base: _base.yaml\n" + BASE))


@pytest.mark.parametrize("value, needle", [
    ("3", "base must be a path (relative to this file) or a list of paths, got int 3"),
    ("{a: 1}", "got dict {'a': 1}"),
    ("null", "got NoneType None"),
    ("''", "got base = ''"),
    ("[_a.yaml, 3]", "got base[1] = 3"),
    ("[[_a.yaml]]", "got base[0] = ['_a.yaml']"),
])
def test_base_of_a_wrong_type(tmp_path, value, needle):
    write(tmp_path, "_a.yaml", BASE)
    message = one_line_error(write(tmp_path, "c.yaml", f"base: {value}\n" + BASE))
    assert message.startswith(f"{tmp_path / 'c.yaml'}: ") and needle in message


@pytest.mark.parametrize("value, needle", [
    ('"a\\0b.yaml"', "base 'a\\x00b.yaml' cannot be resolved (embedded null byte)"),
    ("x" * 40000 + ".yaml", "cannot be read (File name too long)"),
])
def test_a_hostile_base_name_is_one_short_line(tmp_path, value, needle):
    assert needle in one_line_error(write(tmp_path, "c.yaml", f"base: {value}\n" + BASE))


def test_a_ready_tree_names_no_base():
    with pytest.raises(ConfigError, match=r"base '_a.yaml': a base is found relative to the file that names it"):
        load_config(tree={"base": "_a.yaml"})


def test_a_bad_base_exits_2_with_one_line(tmp_path, capfd):
    from entry.check_config import main

    child = write(tmp_path, "c.yaml", "base: _gone.yaml\n" + BASE)
    assert main(["--config", str(child)]) == 2
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: ") and "_gone.yaml" in lines[0], lines


# --- the shipped configs ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_config_resolves(path):
    cfg = load_config(path)
    assert cfg.data.tasks and "base" not in config_to_dict(cfg)


def named_bases(path: Path) -> set[Path]:
    """The files `path` builds on, directly or through its bases."""
    import yaml

    names = yaml.safe_load(path.read_text()).get("base", [])
    direct = {(path.parent / n).resolve() for n in ([names] if isinstance(names, str) else names)}
    return direct.union(*(named_bases(p) for p in direct))


def test_every_base_file_is_named_by_a_config():
    """A `_*.yaml` file is a base: only a config naming it makes it a whole config, so the tests that
    load every file of configs/ skip it, and one no config names is a leftover."""
    used = set().union(*(named_bases(p) for p in SHIPPED))
    assert BASES and {p.resolve() for p in BASES} <= used, sorted(str(p) for p in BASES if p.resolve() not in used)


def own_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("path", REDUCED, ids=lambda p: p.name)
def test_each_reduced_config_is_a_few_lines_on_its_base(path):
    assert "base:" in path.read_text()
    assert len(own_lines(path)) <= 15, f"{path.name}: {len(own_lines(path))} non-blank lines of its own"


DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
RESULTS = {
    "an error measured": re.compile(r"\bn?RMSE\s+\d|\b(?:nRMSE|reconstruction|validation)\b[^.;]*\b0\.\d"),
    "a time measured": re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|s|min|h)\b"),
    "a speed-up measured": re.compile(r"\b\d+(?:\.\d+)?x (?:faster|slower)\b"),
    "a value measured": re.compile(r"\bmeasured\b[^.;]*\d"),
    "a run's state": re.compile(r"\b(?:not yet|never) run\b", re.IGNORECASE),
}


def recorded_results(text: str) -> list[str]:
    """What in comment text `text` is a date or a measured result, by kind."""
    found = ["a date"] if DATE.search(text) else []
    return found + [kind for kind, pattern in RESULTS.items() if pattern.search(text)]


def comments(path: Path) -> str:
    """The comment text of a config file (no config value holds a '#')."""
    return " ".join(line.split("#", 1)[1] for line in path.read_text().splitlines() if "#" in line)


@pytest.mark.parametrize("path", SHIPPED + BASES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_no_config_comment_records_a_date_or_a_result(path):
    assert recorded_results(comments(path)) == [], "move it to bench/results/config-history.md"


def test_the_check_sees_every_note_moved_out_of_the_configs():
    """Each note bench/results/config-history.md keeps (an indented block) is one the check refuses."""
    history = (ROOT / "bench" / "results" / "config-history.md").read_text()
    notes = [" ".join(block.split()) for block in re.findall(r"(?:^    #.*\n)+", history, re.MULTILINE)]
    assert len(notes) >= 8
    assert [n for n in notes if not recorded_results(n)] == []
