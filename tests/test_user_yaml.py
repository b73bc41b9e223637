"""The one YAML loader for what a user writes (`pipelines.user_yaml`, issue 47 bug 3): its count of a
document's values with aliases unfolded equals a plain recursive count, for any tree and any
sharing; a document that unfolds past the cap, or into itself, is a YAML error in one short line."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.user_yaml import MAX_VALUES, load_yaml, unfolded_values, yaml_problem

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.text(max_size=5))
_trees = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=3), inner, max_size=4)),
                      max_leaves=30)


def _count(node) -> int:
    """Values of `node` as YAML unfolds them: itself, then every key and value, recursively."""
    if isinstance(node, list):
        return 1 + sum(_count(v) for v in node)
    if isinstance(node, dict):
        return 1 + len(node) + sum(_count(v) for v in node.values())
    return 1


@settings(max_examples=150, deadline=None)
@given(tree=_trees, shared=_trees, copies=st.integers(1, 5))
def test_the_count_over_shared_aliases_is_the_unfolded_count(tree, shared, copies):
    """`shared` appears `copies` times beside `tree`; dumped, YAML writes it once with an anchor and
    aliases (`&id001`, `*id001`) and loads it back shared: counted once, it still counts as unfolded."""
    doc = {"tree": tree, "copies": [shared] * copies}
    loaded = load_yaml(yaml.safe_dump(doc))
    assert loaded == doc
    assert unfolded_values(loaded) == _count(doc)
    assert unfolded_values(loaded, limit=_count(doc) - 1) is None


def _laughs(levels: int) -> str:
    names = "abcdefghijkl"[:levels]
    anchors = ["&a [1,1,1,1,1,1,1,1,1]"] + [f"&{n} [" + ",".join([f"*{p}"] * 9) + "]"
                                            for p, n in zip(names, names[1:])]
    return "[" + ", ".join(anchors) + "]"


@pytest.mark.parametrize("text", [_laughs(6), _laughs(9), "a: &r [1, *r]", "a: &m {b: [*m]}"],
                         ids=["6 levels", "9 levels", "a list in itself", "a mapping in a list in itself"])
def test_a_bomb_or_a_cycle_is_one_short_yaml_error(text):
    with pytest.raises(yaml.YAMLError) as caught:
        load_yaml(text)
    line = yaml_problem(caught.value)
    assert "unfold" in line and f"{MAX_VALUES:,}" in line and "\n" not in line and len(line) <= 160, line


def test_five_levels_of_aliases_are_below_the_cap_and_load():
    """Level 1 holds nine ones (10 values), level k nine of level k - 1: five levels and the list
    that holds them unfold to 74,733 values, a large document below the cap, not a bomb."""
    levels = [10]
    for _ in range(4):
        levels.append(1 + 9 * levels[-1])
    assert unfolded_values(load_yaml(_laughs(5))) == 1 + sum(levels) == 74_733 < MAX_VALUES
