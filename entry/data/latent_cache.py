"""The latent cache of a run: where it lives, what it must hold, building it (every trajectory
encoded once) and loading it. The command is `entry/cache.py`.

Builds `<training.cache_dir>/<kind>_<split>/` for kind `dynamic` (time-dependent tasks,
"z" [N, T, L, D]) and `steady` (steady tasks, "z" [N, 2, L, D]: coefficient then solution,
so the pair dataset serves the steady prior unchanged), split `train` and `val`. The test
split is never cached: evaluation reads it from the HDF5 files. The ranks that see the cache
folder split the trajectories; their leader allocates the memmap and writes the manifest last.
A shared folder is built once by every rank (led by rank 0); a node-local one (`/dev/shm`,
`$TMPDIR/...`: environment variables in `training.cache_dir` are expanded per process) once
per node by that node's ranks (entry/storage/probe.py tells which holds).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from entry.config.load import ConfigError, config_hash
from entry.config.schema import Config
from entry.data.files import existing_task_file, resolve_task_paths, task_key, task_path, task_split
from entry.distributed import faults
from entry.distributed.process_group import DistInfo, all_reduce_max, rank0_published
from entry.storage.folder_lock import FolderInUse, acquire, release
from entry.storage.probe import StorageView, expand_path, probe_storage
from entry.storage.run_folder import run_dir_for, show_progress
from entry.training.checkpoint import load_weights
from entry.training.models import build_autoencoder
from entry.training.stage_record import weights_file
from pipelines import latent_cache as lc
from pipelines.latent_cache import CacheError, check_cache, file_fingerprint, load_cache
from pipelines.pdebench_io import read_pdebench
from pipelines.tasks import get_task
from pipelines.validate import validate_file

CACHE_KINDS = ("dynamic", "steady")
CACHE_SPLITS = ("train", "val")
ENCODE_BATCH = 256


def rebuild_hint(cfg_path: str = "CFG") -> str:
    return f"python -m entry.cache --config {cfg_path}"


def cache_root(cfg: Config) -> Path:
    """`training.cache_dir`, environment variables expanded in this process."""
    return expand_path(cfg.training.cache_dir)


def cache_folder(cfg: Config, kind: str, split: str) -> Path:
    return cache_root(cfg) / f"{kind}_{split}"


def encoder_weights(cfg: Config) -> Path:
    return weights_file(run_dir_for(cfg), "autoencoder")


def expected_manifest(cfg: Config, kind: str, split: str) -> dict:
    """What a valid cache of `kind`/`split` must record: config, encoder and data identity."""
    weights = encoder_weights(cfg)
    if not weights.is_file():
        raise ConfigError(f"no trained encoder at {weights}: run the autoencoder stage first "
                          f"(python -m entry.autoencoder --config CFG)")
    tasks = [i for i, t in enumerate(cfg.data.tasks) if _is_steady(t.name) == (kind == "steady")]
    return {
        "kind": kind, "split": split,
        "config_hash": config_hash(cfg, sections=("data", "latent", "autoencoder")),
        "encoder_hash": file_fingerprint(weights),
        "data_fingerprints": {task_key(cfg, i): file_fingerprint(existing_task_file(cfg, i)) for i in tasks},
    }


def _is_steady(name: str) -> bool:
    return get_task(name).steady


def load_latent_cache(cfg: Config, kind: str, split: str, *, verify: str = "sampled"):
    """The memory-mapped cache of `kind`/`split`, refused with the rebuild command if it does not
    match the current config, encoder and data, or its files' sampled hashes differ from the
    manifest (`verify="sha256"`: every byte)."""
    return load_cache(cache_folder(cfg, kind, split), expected_manifest(cfg, kind, split),
                      rebuild_hint(), verify=verify)


def caches_ready(cfg: Config, info: DistInfo) -> bool:
    """Whether every rank finds every cache of this config in place and matching (a collective:
    a node-local cache may be gone on some node, e.g. a fresh allocation's empty /dev/shm)."""
    ready = True
    for kind in CACHE_KINDS:
        for split in CACHE_SPLITS:
            if cache_needed(cfg, kind, split):
                try:
                    load_latent_cache(cfg, kind, split)
                except (CacheError, ConfigError):
                    ready = False
    if not info.distributed:
        return ready
    flag = torch.tensor([float(ready)], device=info.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def cache_needed(cfg: Config, kind: str, split: str) -> bool:
    """Whether the config has rows to cache for `kind`/`split` (a kind without tasks has no cache)."""
    return any(len(rows) for _, rows in task_rows(cfg, kind, split))


def task_rows(cfg: Config, kind: str, split: str) -> list[tuple[int, np.ndarray]]:
    """(task index, file rows) of every task of `kind` in `split`."""
    return [(i, task_split(cfg, i, split)[0]) for i, task in enumerate(cfg.data.tasks)
            if _is_steady(task.name) == (kind == "steady")]


def _encode_rows(cfg: Config, encoder, task_index: int, rows: np.ndarray, device) -> dict[str, torch.Tensor]:
    """Encode file rows of one task into CPU tensors {z [n, T, L, D], task_id, dt, sample_id}."""
    task = cfg.data.tasks[task_index]
    data = read_pdebench(task_path(cfg, task), rows, reduce_x=task.reduce_x, reduce_t=task.reduce_t, task=task.name)
    u = torch.from_numpy(data.u)  # [n, T, C, *S]
    if data.coefficient is not None:  # steady: coefficient first, then the solution
        u = torch.cat([torch.from_numpy(data.coefficient)[:, None], u], dim=1)
    n, steps = u.shape[:2]
    flat = u.reshape(n * steps, *u.shape[2:])
    with torch.no_grad():
        z = torch.cat([encoder(flat[j:j + ENCODE_BATCH].to(device)).float().cpu()
                       for j in range(0, flat.shape[0], ENCODE_BATCH)])
    dt = float(data.t[1] - data.t[0]) if data.t is not None and len(data.t) > 1 else 1.0
    return {
        "z": z.reshape(n, steps, *z.shape[1:]).contiguous(),
        "task_id": torch.full((n,), task_index, dtype=torch.int64),
        "dt": torch.full((n,), dt, dtype=torch.float32),
        "sample_id": torch.as_tensor(rows, dtype=torch.int64) + task_index * 10**9,
    }


def cache_lock_file(out: Path) -> Path:
    """The lock every builder of the cache folder `out` holds (`<out>.lock` beside it)."""
    return out.with_name(out.name + ".lock")


def _agree_on_failure(error: Exception | None, info: DistInfo, what: str) -> None:
    """Every rank raises when any rank failed (`error` here, or elsewhere); a collective."""
    if info.distributed:
        failed = all_reduce_max(torch.tensor([float(error is not None)], device=info.device), info).item() > 0
        if failed and error is None:
            error = CacheError(f"{what} failed on another rank (its log names the cause)")
    if error is not None:
        raise error


def _temp_folder(out: Path, info: DistInfo, view: StorageView, specs: dict, logger) -> tuple[Path, object]:
    """The folder's leader allocates the cache under a unique temporary name beside `out` and
    reserves its disk space; every rank gets (its leader's folder, its writable TensorDict). A
    collective."""
    name, error = None, None
    if view.leader:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            acquire(cache_lock_file(out), create=True, what=f"latent cache {out}")
            # Holding the lock, no other builder is alive: what a killed one left is garbage.
            for leftover in lc.remove_leftovers(out):
                logger.info(f"removed {leftover}, left by a cache build that did not finish")
            tmp = lc.temp_dir_for(out, tag=f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
            lc.allocate_cache(tmp, specs)
            name = str(tmp)
            lc.reserve_space(tmp)
        except (CacheError, FolderInUse) as e:
            error = e
            if name is not None:
                shutil.rmtree(name, ignore_errors=True)
                name = None
    if info.distributed:
        # Also orders: the files exist before the other ranks open them. A node-local folder's
        # leader is its node's first rank (torchrun numbers a node's ranks contiguously).
        names: list[str | None] = [None] * info.world_size
        dist.all_gather_object(names, name if error is None else None)
        leaders = [r for r in range(info.world_size) if names[r] is not None]
        name = names[0 if view.shared else info.rank - view.index]
        if error is None and len(leaders) != (1 if view.shared else info.world_size // view.members):
            error = CacheError(f"a leader could not allocate the latent cache {out} (its log names the cause)")
            if view.leader and name is not None:
                shutil.rmtree(name, ignore_errors=True)
            name = None
    if name is None or error is not None:
        raise error or CacheError(f"the leader could not allocate the latent cache {out} (its log names the cause)")
    tmp = Path(name)
    return tmp, lc.open_allocated(tmp)


def _check_finite(z: torch.Tensor, cfg: Config, task_index: int) -> None:
    """Refuse latents that are not finite (bad encoder weights, or data that slipped past validation)."""
    if not torch.isfinite(z).all():
        task = cfg.data.tasks[task_index]
        raise CacheError(f"the encoder {encoder_weights(cfg)} produced non-finite latents for "
                         f"{task_path(cfg, task)} ({task.name}); retrain the autoencoder "
                         f"(python -m entry.autoencoder --config CFG) or check that data file")


def _cache_specs(cfg: Config, encoder, rows_per_task, device) -> tuple[int, dict]:
    """(trajectories, field -> (shape, dtype)) of a cache, from the first row of every task;
    time-dependent tasks must agree on their number of steps."""
    firsts = [_encode_rows(cfg, encoder, i, rows[:1], device) for i, rows in rows_per_task]
    steps = {f["z"].shape[1] for f in firsts}
    if len(steps) > 1:
        raise ConfigError(f"time-dependent tasks have different numbers of steps after reduce_t ({sorted(steps)}); "
                          f"set data.tasks[i].nt / reduce_t so they agree, or train them in separate runs")
    total = sum(len(r) for _, r in rows_per_task)
    return total, {k: ((total, *v.shape[1:]), v.dtype) for k, v in firsts[0].items()}


def _encode_into(td, cfg: Config, encoder, rows_per_task, view: StorageView, info: DistInfo, fault, bar) -> None:
    """Encode this rank's share of every task's rows into the cache ``td``: contiguous blocks of a
    task's rows per rank of the folder, disjoint and together complete. Raises CacheError on
    non-finite latents."""
    start, block_index = 0, 0
    for task_index, rows in rows_per_task:
        for j in range(view.index * ENCODE_BATCH, len(rows), view.members * ENCODE_BATCH):
            faults.before_step(fault, info.rank, block_index, info.restart_count)
            block = rows[j:j + ENCODE_BATCH]
            chunk = _encode_rows(cfg, encoder, task_index, block, info.device)
            _check_finite(chunk["z"], cfg, task_index)
            lc.write_rows(td, start + j, chunk)
            bar.update(len(block) * view.members)  # rank 0 reports for its group
            block_index += 1
        start += len(rows)


def build_cache(cfg: Config, info: DistInfo, logger, kind: str, split: str,
                storage: StorageView | None = None) -> Path | None:
    """Encode and write one cache collectively; returns its folder (None if no task of `kind`).

    The data files must have passed `pipelines.validate` (entry.data.latent_cache and entry.pipeline check
    them first). The cache in place is replaced only by a whole, finite one: any failure leaves
    it as it was, and removes this build's temporary folder. `storage` says how the ranks share
    `training.cache_dir` (`probe_storage`, probed here when None).
    """
    rows_per_task = task_rows(cfg, kind, split)
    if not rows_per_task or sum(len(r) for _, r in rows_per_task) == 0:
        return None
    view = storage if storage is not None else probe_storage(cache_root(cfg), info)
    model = load_weights(build_autoencoder(cfg), encoder_weights(cfg),
                         made_by="python -m entry.autoencoder --config CFG")
    encoder = model.encoder.to(info.device).eval()
    total, specs = _cache_specs(cfg, encoder, rows_per_task, info.device)
    out = cache_folder(cfg, kind, split)
    fault = faults.fault_from_env("cache")
    error: Exception | None = None
    tmp = None
    try:
        tmp, td = _temp_folder(out, info, view, specs, logger)

        bar = tqdm(total=total, desc=f"cache {kind}/{split}", unit="traj",
                   disable=not (info.is_main and show_progress(cfg.logging.progress)))
        try:
            _encode_into(td, cfg, encoder, rows_per_task, view, info, fault, bar)
        except CacheError as e:
            error = e  # agreed below, so no rank waits for one that stopped
        bar.close()
        del td
        # Every rank's rows are written (or some rank failed) before the leaders seal the cache.
        _agree_on_failure(error, info, f"encoding {kind}/{split}")
        if view.leader:
            lc.finalize_cache(tmp, out, expected_manifest(cfg, kind, split))
        if info.is_main:
            logger.info(f"cache {kind}/{split}: {total} trajectories, z {tuple(specs['z'][0])} -> {out} "
                        f"({view.describe()})")
    except BaseException:
        if view.leader and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if view.leader:
            release(cache_lock_file(out))
    rank0_published(info, wrote=True)  # every leader's cache is renamed into place before any rank loads it
    return out


def validate_data(cfg: Config, info: DistInfo, logger) -> None:
    """Every rank checks every task file (`pipelines.validate`); a bad one is a `DataError` naming it."""
    for path in resolve_task_paths(cfg, require_existing=True):
        report = validate_file(path)
        if info.is_main:
            logger.info(f"data ok: {report}")


def verify_caches(cfg: Config, logger) -> None:
    """Full check of every cache the config uses: identity, every byte's sha256, finite values."""
    for kind in CACHE_KINDS:
        for split in CACHE_SPLITS:
            if task_rows(cfg, kind, split):
                load_latent_cache(cfg, kind, split, verify="sha256")
                logger.info(check_cache(cache_folder(cfg, kind, split), deep=True))
