# long file: one loader: YAML, overrides, the derived and fine-tuned sections, hashing and the key tables, which change together
"""Load YAML experiment files into the frozen dataclasses of `entry.config.schema`.

Strict: an unknown key (with a did-you-mean), a wrong type or an out-of-range value raises
`ConfigError` naming the key's full path (`operator.pdet.depths`, `data.tasks[1].param`).
A file's bases (`base:`, entry.config.base) are merged first; `--set a.b.c=VALUE` overrides are then
applied to the YAML tree before validation, so they are checked the same way. Nothing here writes a
file.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import hashlib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import orjson
import yaml

from core.models.registry import with_settings
# ConfigError is defined with the file reader (the lowest module that raises it) and is this
# module's too: callers import it from here.
from entry.config.base import ConfigError, read_tree, resolve_bases
from entry.config.from_data import complete_from_data, derivable
from entry.config.from_run import complete_from_run, finetune_source
from entry.config.schema import STAGE_CONFIGS, Config, DataConfig, cut, shown, shown_path
from pipelines.user_yaml import load_yaml, yaml_problem

# Sections that only say where and how results are reported; they do not change the math.
HASH_EXCLUDED_SECTIONS = ("logging", "derived")

SECTIONS_HASHED_WHEN_SET = ("finetune",)
"""Sections added after runs were recorded, hashed only when some key is set away from its
default: a config that leaves the section alone keeps the hash it had."""

HASHED_WHEN_SET = {"data": ("task_weights",), "latent": ("codec", "patch", "blocks"),
                   "evaluation": ("lead_windows", "ensemble_members", "val_rollout_steps", "split", "time_rollout"),
                   "training": ("max_train_s", "anneal_to"), "finetune": ("new_fields",),
                   **{name: section.HASHED_WHEN_SET for name, section in STAGE_CONFIGS.items()}}
"""Keys added after runs were recorded, hashed only when set away from their default: a config
that leaves them alone keeps the hash it had (its run folder, done files and latent caches). A
stage's section declares its own (`StageConfig.HASHED_WHEN_SET`)."""

TASK_KEYS_HASHED_WHEN_SET = {"train_trajectories": 0, "t_end": 0.0, "seed": -1}
"""Keys of a ``data.tasks`` entry added after runs were recorded, with their defaults: hashed only
when set away from them, so a config that leaves them alone keeps the hash it had."""

HASHED_AS_REMOVED = {"operator": {"decoded_loss_weight": 0.0}}
"""Keys taken out of the schema, hashed at the one value every config could then give them, so
the runs recorded before keep their hashes (nothing retrains because a dead key went away)."""

ARCH_SECTIONS_ALWAYS_HASHED = ("pdet", "transformer")
"""The operator sections of the model registry every config hashed before models owned their
settings. Any other registered operator's section is hashed only when it is the chosen arch's or
set away from its defaults: registering a model changes no config's hash."""


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        args = get_args(tp)
        return repr(args[0]) if len(args) == 1 else "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if tp is bool:
        return "true or false"
    if origin is tuple:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against the annotation `tp` and convert lists to tuples, dicts to dataclasses."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        # A section whose keys the model registry supplies (`OperatorConfig`) is read as it has them now.
        tp = tp.registered() if hasattr(tp, "registered") else tp
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be {_type_name(tp)}, got {type(value).__name__} {shown(value)}")
        return _build(tp, value, path)
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{path} must be {_type_name(tp)}, got {shown(value)}")
        return value
    if origin is tuple:
        item_tp = get_args(tp)[0]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be {_type_name(tp)}, got {type(value).__name__} {shown(value)}")
        return tuple(_coerce(v, item_tp, _join(path, i)) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in get_args(tp):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, option, path)
            except ConfigError as e:
                errors.append(str(e))
        # One option (X | None): its own message names the problem best; several: name them all.
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path} must be {_type_name(tp)}, got {shown(value)}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} must be true or false, got {shown(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer, got {shown(value)}")
        return value
    if tp is float:
        # YAML 1.1 reads `1e-3` (no dot) as a string; accept any string float() accepts.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {shown(value)}")
        # No setting means anything at NaN or infinity (`.nan`, `.inf`), and range checks
        # written as `x <= 0` would let NaN through.
        if not math.isfinite(value):
            raise ConfigError(f"{path} must be a finite number, got {shown(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {shown(value)}")
        return value
    raise AssertionError(f"unsupported annotation {tp!r} at {path}")


def _build(cls: type, tree: dict, path: str) -> Any:
    hints = typing.get_type_hints(cls)
    # A field whose YAML key is another word (`finetune.from`, a Python keyword) is known by that key alone.
    spelled = getattr(cls, "YAML_KEYS", {})
    fields = {spelled.get(f.name, f.name): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in tree.items():
        if key not in fields:
            # A key is shown cut short (a 40,000-character key), and only a short one is matched.
            name = cut(str(key)) if isinstance(key, str) else shown(key)
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f" (did you mean '{_join(path, close[0])}'?)" if close else ""
            raise ConfigError(f"unknown key '{_join(path, name)}'{hint}; allowed keys: {sorted(fields)}")
        kwargs[fields[key].name] = _coerce(value, hints[fields[key].name], _join(path, key))
    missing = [
        name for name, f in fields.items()
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing required key(s) {[_join(path, m) for m in missing]}")
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(f"{_join(path, '')}{e}" if path else str(e)) from None


def apply_override(tree: dict, assignment: str) -> None:
    """Apply one `a.b.c=VALUE` override in place; VALUE is parsed as YAML (`[1, 2]`, `true`, `0.5`).

    Raises `ConfigError` (the key and the value shown cut short) for a malformed assignment.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set expects KEY=VALUE, got {shown(assignment)}")
    key, raw = assignment.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set expects KEY=VALUE with a non-empty key, got {shown(assignment)}")
    name = cut(key)  # what messages show of the key
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {name}: the value {shown(raw)} is not valid YAML ({yaml_problem(e)}); quote "
                          f"strings and close brackets, e.g. --set {name}=[1,2]") from None
    node: Any = tree
    for depth, part in enumerate(parts[:-1]):
        where = cut(".".join(parts[: depth + 1]))
        slot = _list_index(node, part, where) if isinstance(node, list) else part
        child = node[slot] if isinstance(node, list) else node.get(part, {})
        if not isinstance(child, (dict, list)):
            raise ConfigError(f"--set {name}: '{where}' is a value, not a section")
        # Each section on the key's path is copied (shallow) before it is changed: a YAML alias
        # (`diffusion: {pdet: *op}`) shares one mapping between two keys, and `--set` names one key.
        child = copy.copy(child)
        node[slot] = child
        node = child
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(node, last, name)] = value
    else:
        node[last] = value


def _list_index(node: list, part: str, where: str) -> int:
    # ASCII digits only ('²'.isdigit() is true), and few of them: int() refuses 4300+ digits.
    if not (part.isascii() and part.isdigit()) or len(part) > 9 or int(part) >= len(node):
        raise ConfigError(f"--set {where}: expected a list index below {len(node)}, got {shown(part)}")
    return int(part)


def load_config(path: str | Path | None = None, overrides: list[str] = (), *, tree: dict | None = None) -> Config:
    """Read a YAML file (or a ready `tree`), merge it over the bases it names (`base:`, see
    `entry.config.base`), apply `--set` overrides and return a validated `Config`.

    Raises `ConfigError` naming the key (its value shown cut short) for any user mistake.
    """
    if tree is None:
        if path is None:
            raise ConfigError("no config given: pass --config PATH (see configs/)")
        tree = read_tree(Path(path))
    if not isinstance(tree, dict):
        raise ConfigError(f"{shown_path(path)}: the top level must be a mapping of sections")
    # Bases first, then overrides and validation: a config split over files is checked (and hashed)
    # as the one file it stands for.
    tree = resolve_bases(tree, None if path is None else Path(path))
    try:
        tree = copy.deepcopy(tree)  # overrides must not leak into the caller's tree (aliases stay shared)
    except RecursionError:
        raise ConfigError(f"{shown_path(path)}: lists or mappings nested too deeply (no config key nests more than "
                          f"a few levels)") from None
    # Whether the file names its latent is read before the overrides: `--set latent.dim=N` changes a
    # derived latent, it does not turn the derivation off.
    derive = derivable(tree)
    names_latent = "latent" in tree
    # `derived` is the loader's record of what it chose. A complete config (a run's config.json, a
    # config_to_dict tree) carries it from an earlier load and keeps it; in a config that is about
    # to be derived it can only have been written by hand.
    if "derived" in tree and (derive or (finetune_source(tree) and not names_latent)):
        raise ConfigError("derived: the loader writes it (what a config that names only its data gets from the "
                          "data); remove it and set the sections themselves")
    for assignment in overrides:
        apply_override(tree, assignment)
    # A fine-tuning config without a latent takes what it leaves out from its source run, not from
    # its data (`--set finetune.from=RUN` counts: the source is read after the overrides).
    if finetune_source(tree) and not names_latent:
        if "derived" in tree:
            raise ConfigError("derived: the loader writes it (what a fine-tuning config gets from its source run); "
                              "remove it and set the sections themselves")
        tree = complete_from_run(tree, finetune_source(tree))
    elif derive:
        tree = complete_from_data(tree, _build(DataConfig, tree["data"], "data"))
    elif "latent" not in tree and isinstance(tree.get("data"), dict):
        raise ConfigError("missing required key(s) ['latent']: a config derives it and every section it leaves out "
                          "from its data only when each data.tasks entry is declared (path and layout); for "
                          "generated tasks name the latent (e.g. base: configs/reduced/_base_1d.yaml)")
    return _build(Config, tree, "")


def config_to_dict(cfg: Any) -> Any:
    """Plain JSON-ready tree of a config (tuples become lists)."""
    if dataclasses.is_dataclass(cfg):
        spelled = getattr(cfg, "YAML_KEYS", {})  # keyed as a YAML file spells them, so the tree loads back
        return {spelled.get(f.name, f.name): config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [config_to_dict(v) for v in cfg]
    return cfg


def hashed_tree(cfg: Config) -> dict:
    """The tree every config hash reads: `config_to_dict(cfg)` without `HASH_EXCLUDED_SECTIONS` and
    without the `HASHED_WHEN_SET` keys that hold their defaults, with the `HASHED_AS_REMOVED` keys."""
    tree = config_to_dict(cfg)
    for name in HASH_EXCLUDED_SECTIONS:
        tree.pop(name, None)
    for name in SECTIONS_HASHED_WHEN_SET:
        if getattr(cfg, name) == type(getattr(cfg, name))():
            tree.pop(name, None)
    for section, keys in HASHED_WHEN_SET.items():
        if section not in tree:  # a section hashed when set (`SECTIONS_HASHED_WHEN_SET`), left at its defaults
            continue
        # As config_to_dict writes them (a tuple default is a list in the tree).
        defaults = {f.name: config_to_dict(f.default) for f in dataclasses.fields(type(getattr(cfg, section)))}
        tree[section] = {k: v for k, v in tree[section].items() if k not in keys or v != defaults[k]}
    for section, removed in HASHED_AS_REMOVED.items():
        tree[section] = {**tree[section], **removed}
    # A task's seed is hashed as the seed it is generated with: set to the one its place gives, it is left out.
    tree["data"] = {**tree["data"], "tasks": [
        {k: v for k, v in t.items() if k not in TASK_KEYS_HASHED_WHEN_SET or v != TASK_KEYS_HASHED_WHEN_SET[k]
         and not (k == "seed" and v == cfg.data.place_seed(i))}
        for i, t in enumerate(tree["data"]["tasks"])]}
    op = cfg.operator
    left_out = {e.section for name, e in with_settings("operator") if name != op.arch
                and e.section not in ARCH_SECTIONS_ALWAYS_HASHED and getattr(op, e.section, None) == e.settings()}
    tree["operator"] = {k: v for k, v in tree["operator"].items() if k not in left_out}
    return tree


def config_hash(cfg: Config, *, sections: tuple[str, ...] | None = None) -> str:
    """Stable 16-hex-digit hash of the config, independent of key order and of logging keys.

    `sections` restricts the hash to some top-level sections (e.g. what a cache depends on).
    """
    tree = hashed_tree(cfg)
    if sections is not None:
        tree = {k: v for k, v in tree.items() if k in sections}
    return tree_hash(tree)


def tree_hash(tree: dict) -> str:
    """Stable 16-hex-digit hash of a config tree (key order ignored)."""
    return hashlib.sha256(orjson.dumps(tree, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def add_config_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `--config PATH` and repeated `--set KEY=VALUE` options every entry shares."""
    parser.add_argument("--config", required=True, help="YAML experiment file (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set operator.steps=200 (repeatable)")
    return parser
