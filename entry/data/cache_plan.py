"""A latent cache's plan: where it lives, what it encodes and what a valid copy must record,
resolved once from the config (`cache_plan`), and opening a copy that matches it (`open_cache`).
Building one is entry/data/latent_cache.py; the on-disk format is pipelines/latent_cache.py.

A cache lives in `<training.cache_dir>/<kind>_<split>-<key>/`, the key a hash of what a valid copy
must record (`expected_manifest`: config sections, encoder and data fingerprints). Runs that share
`training.cache_dir` and encode the same content share a folder; runs with another encoder or data
each have their own, so they never rebuild each other's caches in turn.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from entry.config.identity import math_hash
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.files import require_task_file, task_key, task_path, task_split
from entry.storage.probe import expand_path
from entry.storage.run_folder import run_dir_for, weights_file
from entry.storage.weights_fingerprint import weights_fingerprint
from pipelines.file_facts import data_fingerprint
from pipelines.latent_cache import MANIFEST_NAME, CacheError, load_cache, manifest_difference
from pipelines.tasks import TaskSpec

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
    spec: TaskSpec
    """What the file holds and how it is read (`TaskConfig.spec`)."""


@dataclass(frozen=True, eq=False)
class CachePlan:
    """One latent cache of a run, resolved once from the config: where it lives, what it encodes,
    and what a valid copy must record. Everything below it (building, loading, the pair loaders)
    reads the plan, not the config."""

    kind: str
    """`dynamic` (time-dependent tasks) or `steady`."""
    split: str
    """`train` or `val` (the test split is never cached)."""
    root: Path
    """`training.cache_dir` (expanded): every cache of every run that names it lives under it."""
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

    @property
    def folder(self) -> Path:
        """`<root>/<kind>_<split>-<key of expected_manifest>`: this cache's folder, which only a copy
        of the same content shares. Needs the trained encoder and the data files (their
        fingerprints name it): a `ConfigError` naming the command that makes a missing one."""
        return cache_folder(self.root, self.kind, self.split, expected_manifest(self))


def cache_folder(root: Path, kind: str, split: str, identity: dict) -> Path:
    """The folder under `root` of the `kind`/`split` cache whose manifest records `identity`."""
    key = hashlib.sha256(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
    return root / f"{kind}_{split}-{key}"


def cache_plan(cfg: Config, kind: str, split: str) -> CachePlan:
    """The plan of the `kind`/`split` cache of this config (files and splits resolved here, once)."""
    tasks = tuple(TaskRows(i, task_key(cfg, i), t.name, task_path(cfg, t), t.reduce_x, t.reduce_t,
                           task_split(cfg, i, split)[0], t.spec)
                  for i, t in enumerate(cfg.data.tasks) if t.spec.steady == (kind == "steady"))
    return CachePlan(kind, split, cache_root(cfg), tasks, tuple(t.name for t in cfg.data.tasks),
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
        "data_fingerprints": {t.key: data_fingerprint(require_task_file(t.path, t.index)) for t in plan.tasks},
    }


def other_caches(plan: CachePlan) -> list[Path]:
    """The other `kind`/`split` cache folders under the plan's root (other encoders, data or
    config; a folder of the layout before folders were keyed included), by name."""
    own = plan.folder
    if not plan.root.is_dir():
        return []
    return sorted(p for p in plan.root.iterdir()
                  if p.is_dir() and p != own and p.name.split("-")[0] == f"{plan.kind}_{plan.split}"
                  and ".tmp-" not in p.name and ".old-" not in p.name)


def _why_missing(plan: CachePlan, expected: dict) -> str:
    """Why no cache of `plan` is in place: the first field in which the closest other cache of
    its kind and split differs (another encoder, other data, another config), else that none is."""
    best = None
    for other in other_caches(plan):
        try:
            manifest = orjson.loads((other / MANIFEST_NAME).read_bytes())
        except (OSError, orjson.JSONDecodeError):
            continue
        differ = [key for key in sorted(expected) if manifest_difference(manifest, {key: expected[key]})]
        if differ and (best is None or len(differ) < best[0]):
            best = (len(differ), other, manifest_difference(manifest, expected))
    if best is None:
        return "has not been built"
    return f"has not been built; the closest cache there, {best[1].name}, differs in manifest field {best[2]}"


def open_cache(plan: CachePlan, *, verify: str = "sampled"):
    """The memory-mapped cache of `plan`, refused (`CacheError`) with the rebuild command if none
    matches the current config, encoder and data (naming the field in which the closest other
    cache differs), or its files' sampled hashes differ from the manifest (`verify="sha256"`:
    every byte)."""
    expected = expected_manifest(plan)
    folder = cache_folder(plan.root, plan.kind, plan.split, expected)
    if not (folder / MANIFEST_NAME).is_file():
        raise CacheError(f"latent cache {folder} {_why_missing(plan, expected)}; build it with: {rebuild_hint()}")
    return load_cache(folder, expected, rebuild_hint(), verify=verify)


def cache_in_place(plan: CachePlan) -> bool:
    """Whether `plan`'s cache is in place and matches its encoder and data (`open_cache`)."""
    try:
        open_cache(plan)
    except (CacheError, ConfigError):
        return False
    return True
