"""A latent cache's plan: where it lives, what it encodes and what a valid copy must record,
resolved once from the config (`cache_plan`), and opening a copy that matches it (`open_cache`).
Building one is entry/data/latent_cache.py; the on-disk format is pipelines/latent_cache.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from entry.config.identity import math_hash
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.files import require_task_file, task_key, task_path, task_split
from entry.storage.probe import expand_path
from entry.storage.run_folder import run_dir_for
from entry.storage.weights_fingerprint import weights_fingerprint
from entry.training.stage_record import weights_file
from pipelines.latent_cache import file_fingerprint, load_cache
from pipelines.tasks import get_task

CACHE_KINDS = ("dynamic", "steady")
CACHE_SPLITS = ("train", "val")


def rebuild_hint(cfg_path: str = "CFG") -> str:
    return f"python -m entry.cache --config {cfg_path}"


def cache_root(cfg: Config) -> Path:
    """`training.cache_dir`, environment variables expanded in this process."""
    return expand_path(cfg.training.cache_dir)


def encoder_weights(cfg: Config) -> Path:
    """The trained encoder every cache of this run is encoded with (the autoencoder's weights)."""
    return weights_file(run_dir_for(cfg), "autoencoder")


@dataclass(frozen=True, eq=False)
class TaskRows:
    """The rows of one task file a cache encodes, and how to read them."""

    index: int
    """The task's index in `data.tasks` (its task id)."""
    key: str
    """Its identity in the manifest (`entry.data.files.task_key`)."""
    name: str
    path: Path
    reduce_x: int
    reduce_t: int
    rows: np.ndarray


@dataclass(frozen=True, eq=False)
class CachePlan:
    """One latent cache of a run, resolved once from the config: where it lives, what it encodes,
    and what a valid copy must record. Everything below it (building, loading, the pair loaders)
    reads the plan, not the config."""

    kind: str
    """`dynamic` (time-dependent tasks) or `steady`."""
    split: str
    """`train` or `val` (the test split is never cached)."""
    folder: Path
    tasks: tuple[TaskRows, ...]
    """The config's tasks of this kind, in config order."""
    task_names: tuple[str, ...]
    """Every task of the config, in order (a task id indexes it)."""
    encoder: Path
    config_hash: str
    """Hash of the config sections a cache depends on (data, latent, autoencoder)."""

    @property
    def needed(self) -> bool:
        """Whether there is anything to cache (a kind without tasks, or an empty split, has none)."""
        return any(len(t.rows) for t in self.tasks)

    @property
    def trajectories(self) -> int:
        return sum(len(t.rows) for t in self.tasks)


def cache_plan(cfg: Config, kind: str, split: str) -> CachePlan:
    """The plan of the `kind`/`split` cache of this config (files and splits resolved here, once)."""
    tasks = tuple(TaskRows(i, task_key(cfg, i), t.name, task_path(cfg, t), t.reduce_x, t.reduce_t,
                           task_split(cfg, i, split)[0])
                  for i, t in enumerate(cfg.data.tasks) if get_task(t.name).steady == (kind == "steady"))
    return CachePlan(kind, split, cache_root(cfg) / f"{kind}_{split}", tasks, tuple(t.name for t in cfg.data.tasks),
                     encoder_weights(cfg), math_hash(cfg, ("data", "latent", "autoencoder")))


def expected_manifest(plan: CachePlan) -> dict:
    """What a valid copy of the planned cache must record: config, encoder and data identity."""
    if not plan.encoder.is_file():
        raise ConfigError(f"no trained encoder at {plan.encoder}: run the autoencoder stage first "
                          f"(python -m entry.autoencoder --config CFG)")
    return {
        "kind": plan.kind, "split": plan.split,
        "config_hash": plan.config_hash,
        "encoder_hash": weights_fingerprint(plan.encoder),
        "data_fingerprints": {t.key: file_fingerprint(require_task_file(t.path, t.index)) for t in plan.tasks},
    }


def open_cache(plan: CachePlan, *, verify: str = "sampled"):
    """The memory-mapped cache of `plan`, refused with the rebuild command if it does not match
    the current config, encoder and data, or its files' sampled hashes differ from the manifest
    (`verify="sha256"`: every byte)."""
    return load_cache(plan.folder, expected_manifest(plan), rebuild_hint(), verify=verify)
