"""Read config files into YAML trees: strict YAML, and the `base:` files a config builds on.

A config file may name `base: PATH` (or a list of paths, merged in order), relative to the folder
of the file that names it; a base may have a base of its own. The file's tree is merged over its
bases: mappings key by key, while lists, scalars and an explicit `null` replace what the base
had. The merged tree, without `base`, is exactly what the same settings written out in one file
give, so `entry.config.load` validates and hashes it the same way. Nothing here writes a file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from entry.config.schema import PATH_CHARS, cut, shown, shown_path
# The strict, capped YAML loader is pipelines' (inspect's --options read YAML too): one loader for
# every YAML a user passes.
from pipelines.user_yaml import load_yaml, yaml_problem

BASE_KEY = "base"
"""The top-level key naming the file(s) a config builds on; never part of the resolved tree."""


class ConfigError(ValueError):
    """A user error in a config file or override; the message names the key path."""


def read_tree(p: Path) -> Any:
    """The YAML tree of config file `p` (`{}` for an empty file), bases not yet merged;
    `ConfigError` when it is missing, not text or not YAML."""
    try:
        if not p.is_file():
            what = "is a directory, not a config file" if p.is_dir() else "not found"
            raise ConfigError(f"config file {shown_path(p)} {what} (pass --config with a YAML file from configs/)")
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{shown_path(p)} is not a text file (not UTF-8); pass --config with a YAML file "
                          f"from configs/") from None
    except OSError as e:  # a name too long, a folder we may not read
        raise ConfigError(f"config file {shown_path(p)} cannot be read ({e.strerror}); pass --config with a YAML "
                          f"file from configs/") from None
    try:
        return load_yaml(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{shown_path(p)} is not valid YAML: {yaml_problem(e)}") from None


def resolve_bases(tree: dict, path: Path | None) -> dict:
    """`tree`, the top level of config file `path`, merged over the bases it names (recursively),
    without the `base` key; `tree` itself when it names none. Neither `tree` nor a base is changed;
    the result shares their values (a caller that edits it copies it first).

    Raises `ConfigError` naming the file and `base` (or `base[i]`) for a base of a wrong type,
    a missing or unreadable base, a base that is not a mapping, and a cycle of bases (the chain).
    `path` None (a ready tree) may name no base: a base is found relative to its file.
    """
    if BASE_KEY not in tree:
        return tree
    chain = () if path is None else (_Link(shown_path(path), _identity(path, shown_path(path))),)
    try:
        return _resolve(tree, path, chain)
    except RecursionError:
        raise ConfigError(f"{shown_path(path)}: lists or mappings nested too deeply to merge with its bases "
                          f"(no config key nests more than a few levels)") from None


class _Link(NamedTuple):
    """One file of a chain of bases: the name messages show, and the resolved path compared."""

    shown: str
    resolved: Path


def _identity(p: Path, named: str) -> Path:
    """The absolute path `p` stands for (`..` and links followed), what a cycle is found by;
    `named` (the file and key naming `p`) starts the message when it has none."""
    try:
        return p.resolve()
    except (OSError, RuntimeError, ValueError) as e:  # a loop of symbolic links, a NUL in the name
        raise ConfigError(f"{named} cannot be resolved ({cut(str(e))})") from None


def _resolve(tree: dict, path: Path | None, chain: tuple[_Link, ...]) -> dict:
    """`tree` (of file `path`, reached through `chain`) merged over its bases, without `base`."""
    if BASE_KEY not in tree:
        return tree
    where = "a config given as a tree" if path is None else shown_path(path)
    merged: dict = {}
    for key, name in _base_names(tree[BASE_KEY], where):
        if path is None:
            raise ConfigError(f"{where}: {key} {shown(name)}: a base is found relative to the file that names "
                              f"it, so load the config from its file")
        base_path = Path(os.path.normpath(path.parent / name))
        named = f"{where}: {key} {shown(name)}"  # how every message about this base starts
        link = _Link(shown_path(base_path), _identity(base_path, named))
        if any(link.resolved == seen.resolved for seen in chain):
            names = cut(" -> ".join(seen.shown for seen in (*chain, link)), 3 * PATH_CHARS)
            raise ConfigError(f"{where}: {key} makes a cycle of bases: {names}")
        _check_is_file(base_path, link.resolved, named)
        try:
            base_tree = read_tree(base_path)
        except ConfigError as e:  # unreadable or not YAML: name the file that names it too
            raise ConfigError(f"{named}: {e}") from None
        if not isinstance(base_tree, dict):
            raise ConfigError(f"{named} must be a mapping of sections, got {type(base_tree).__name__} "
                              f"{shown(base_tree)}")
        merged = merge_trees(merged, _resolve(base_tree, base_path, (*chain, link)))
    return merge_trees(merged, {k: v for k, v in tree.items() if k != BASE_KEY})


def _check_is_file(p: Path, resolved: Path, named: str) -> None:
    """Raise `ConfigError` (starting with `named`: the file and key naming `p`) unless `p` is a file."""
    try:
        if p.is_file():
            return
        what = "is a directory, not a config file" if p.is_dir() else "not found"
    except OSError as e:  # a name too long for the file system
        what = f"cannot be read ({e.strerror})"
    raise ConfigError(f"{named} {what} (resolved to {shown_path(resolved)})")


def _base_names(value: Any, where: str) -> list[tuple[str, str]]:
    """(key path, name) of each base `value` names: one path or a list of paths."""
    names = value if isinstance(value, list) else [value]
    wrong = f"{where}: base must be a path (relative to this file) or a list of paths, got"
    if not isinstance(value, (str, list)):
        raise ConfigError(f"{wrong} {type(value).__name__} {shown(value)}")
    found = []
    for i, name in enumerate(names):
        key = f"base[{i}]" if isinstance(value, list) else "base"
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{wrong} {key} = {shown(name)}")
        found.append((key, name))
    return found


def merge_trees(base: dict, over: dict) -> dict:
    """A new tree: `over` merged over `base`. Mappings merge key by key (recursively); any other
    value of `over` (a list, a scalar, `None`) replaces the base's. Neither argument is changed;
    values not merged are shared, not copied.
    """
    return _merge(base, over, {})


def _merge(base: dict, over: dict, memo: dict[tuple[int, int], dict]) -> dict:
    # YAML aliases make a tree a graph (shared and even self-containing mappings): each pair of
    # mappings is merged once and reused, so the walk is as small as the two graphs, not as the
    # trees they unfold into.
    pair = (id(base), id(over))
    if pair in memo:
        return memo[pair]
    merged = memo[pair] = dict(base)
    for key, value in over.items():
        below = base.get(key)
        merged[key] = _merge(below, value, memo) if isinstance(value, dict) and isinstance(below, dict) else value
    return merged
