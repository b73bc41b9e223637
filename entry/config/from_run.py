"""The sections a fine-tuning config leaves out, taken from its source run: `finetune.from` names a
finished run folder, and a config that names no `latent` section is completed from the config
that run recorded (its config.json, the resolved config it trained with).

Every section the config gives is merged over the source's key by key, as a file is merged over
its `base:` (`operator: {lr: 1e-4}` changes the learning rate alone); a list (`data.tasks`)
replaces the source's. The source's `logging`, `derived` and `finetune` are not taken: where this
run is written, and what the source itself was derived or fine-tuned from, are not this run's.
What came from where is `Config.derived` (printed at start-up and recorded in config.json, as for
a config derived from its data: entry.config.from_data). Nothing here writes a file.
"""

from __future__ import annotations

import os
from pathlib import Path

from entry.config.base import ConfigError, merge_trees
from entry.config.schema import shown_path
from pipelines.atomic import read_json

__all__ = ["NOT_TAKEN", "source_folder", "recorded_tree", "finetune_source", "complete_from_run"]

NOT_TAKEN = ("logging", "derived", "finetune")
"""Sections of the source's config a fine-tuning config never takes."""

RUN_HINT = "name a finished run folder (runs/<name>: its config.json and each trained stage's <stage>.pt)"


def source_folder(text: str) -> Path:
    """The run folder `finetune.from` names, `$VAR` and `~` expanded in this process."""
    return Path(os.path.expanduser(os.path.expandvars(text)))


def recorded_tree(run_dir: str | Path, *, key: str = "finetune.from") -> dict:
    """The config tree a run folder recorded (`config.json`'s "config"). Raises `ConfigError`,
    one line starting with `key`, for a folder that is missing or holds no readable config.json."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{key}: {shown_path(run_dir)} is not a folder; {RUN_HINT}")
    path = run_dir / "config.json"
    try:
        found = read_json(path)
    except ValueError as e:
        raise ConfigError(f"{key}: {shown_path(run_dir)} is not a finished run: {shown_path(path)} is unreadable "
                          f"({e}); {RUN_HINT}") from None
    if not isinstance(found, dict) or not isinstance(found.get("config"), dict):
        raise ConfigError(f"{key}: {shown_path(run_dir)} is not a finished run: {shown_path(path)} is missing; "
                          f"train it first (python -m entry.pipeline --config CFG) or {RUN_HINT}")
    return found["config"]


def finetune_source(tree: dict) -> str:
    """The `finetune.from` a config tree gives ("" when none)."""
    section = tree.get("finetune")
    source = section.get("from") if isinstance(section, dict) else None
    return source if isinstance(source, str) else ""


def complete_from_run(tree: dict, source: str) -> dict:
    """`tree` (a config naming `finetune.from` = `source` and no `latent`) merged over the
    sections its source run recorded (less `NOT_TAKEN`), with `derived` saying what came from
    where. Raises `ConfigError` for a source that is no run folder."""
    recorded = recorded_tree(source_folder(source))
    base = {k: v for k, v in recorded.items() if k not in NOT_TAKEN}
    merged = merge_trees(base, tree)
    taken = [k for k in base if k not in tree]
    over = [k for k in base if k in tree]
    own = [k for k in tree if k not in base]
    lines = [f"derived from the source run {source} (finetune.from; the config it recorded in config.json):",
             f"  taken from the source: {', '.join(taken) or '(none)'}",
             f"  this config's keys merged over the source's: {', '.join(over) or '(none)'}",
             f"  this config's own: {', '.join(own) or '(none)'}"]
    return {**merged, "derived": lines}
