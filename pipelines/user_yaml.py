"""YAML a user wrote (a config file, a `--set` value, `pipelines.inspect --options`), parsed strictly
and with caps: the one loader every command uses.

Strict: a key that appears twice in one mapping is an error (plain YAML keeps the last one
silently). Capped: a document whose aliases unfold to more than `MAX_VALUES` values (a "billion
laughs": a few hundred bytes of nested aliases that unfold to gigabytes), or a list or mapping that
contains itself, is an error before anything walks it. The loaded tree keeps its aliases as shared
references, so the check costs the document as written, not as unfolded; a consumer may then walk,
copy or serialise the tree whole. Whatever the text holds, a problem with it is a `yaml.YAMLError`
whose `yaml_problem` is one short line.
"""

from __future__ import annotations

from typing import Any

import yaml

from pipelines.shown import SHOWN_CHARS, cut, shown

__all__ = ["MAX_VALUES", "load_yaml", "unfolded_values", "yaml_problem"]

MAX_VALUES = 100_000
"""The most values (scalars, keys, lists and mappings) a document may hold with its aliases unfolded:
a config holds a few hundred, layout options a few dozen; nine levels of nine aliases hold 9**9."""


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key that appears twice in one mapping (plain YAML keeps the
    last one silently, so an edited config could train with a value nobody meant)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            again = key in seen
        except TypeError:  # a list or mapping as a key: construct_mapping names it
            continue
        if again:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {shown(key)} (first on line {seen[key] + 1})",
                key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _children(node: list | dict) -> list:
    return [*node.keys(), *node.values()] if isinstance(node, dict) else node


def unfolded_values(tree: Any, limit: int = MAX_VALUES) -> int | None:
    """How many values `tree` holds with every shared list or mapping counted each time it is
    reached (its aliases unfolded), or None when that passes `limit` or a list or mapping contains
    itself. Each list or mapping is visited once (its count kept by identity), without recursion:
    time and memory are those of the tree as written, whatever it unfolds to."""
    counts: dict[int, int] = {}
    open_ids: set[int] = set()  # the lists and mappings whose counts wait on their children's
    stack: list[tuple[Any, bool]] = [(tree, False)]
    while stack:
        node, children_done = stack.pop()
        if not isinstance(node, (list, dict)) or (not children_done and id(node) in counts):
            continue
        if children_done:
            total = 1 + sum(counts[id(c)] if isinstance(c, (list, dict)) else 1 for c in _children(node))
            if total > limit:
                return None
            counts[id(node)] = total
            open_ids.discard(id(node))
            continue
        open_ids.add(id(node))
        stack.append((node, True))
        for child in _children(node):
            if isinstance(child, (list, dict)) and id(child) in open_ids:
                return None  # an alias to a list or mapping it sits in: unfolds without end
            stack.append((child, False))
    return counts.get(id(tree), 1)


def load_yaml(text: str) -> Any:
    """Parse YAML `text` with the strict loader and return its tree (aliases stay shared references).

    Raises:
        yaml.YAMLError: the text is not YAML, repeats a key, nests too deeply to read, holds an
            integer Python cannot convert, or unfolds to more than `MAX_VALUES` values.
    """
    try:
        tree = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        problem = "lists or mappings nested too deeply to read (no config key nests more than a few levels)"
    except ValueError as e:  # a scalar YAML resolves but Python cannot build
        problem = ("an integer of more digits than Python converts (4300)" if "integer string conversion" in str(e)
                   else f"a value that cannot be read ({cut(str(e))})")
    else:
        if unfolded_values(tree) is not None:
            return tree
        problem = (f"aliases (*name) that unfold to more than {MAX_VALUES:,} values, or into themselves "
                   f"(a 'billion laughs'); write the values out")
    raise yaml.MarkedYAMLError(problem=problem)


def yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one short line: the problem and where it is."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return cut(" ".join(f"{problem}{where}".split()), 2 * SHOWN_CHARS)
