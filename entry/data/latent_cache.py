"""Building a run's latent cache: every train and validation trajectory encoded once (the command
is `entry/cache.py`; what a cache must hold, and opening one, is `entry/data/cache_plan.py`; who
builds a folder, and waiting for another job building it, `entry/data/cache_lock.py`).

Builds `<training.cache_dir>/<kind>_<split>-<key>/` (the key: a hash of what it holds, see
entry/data/cache_plan.py) for kind `dynamic` (time-dependent tasks,
"z" [N, T, L, D]) and `steady` (steady tasks, "z" [N, 2, L, D]: coefficient then solution,
so the pair dataset serves the steady prior unchanged), split `train` and `val`. The test
split is never cached: evaluation reads it from the HDF5 files. The ranks that see the cache
folder split the trajectories; their leader allocates the memmap and writes the manifest last.
A shared folder is built once by every rank (led by rank 0); a node-local one (`/dev/shm`,
`$TMPDIR/...`: environment variables in `training.cache_dir` are expanded per process) once
per node by that node's ranks (entry/storage/probe.py tells which holds).
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import socket
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from entry.config.schema import Config
from entry.data.cache_lock import agree_on_failure, built_meanwhile, cache_lock_file
from entry.data.cache_plan import (CACHE_KINDS, CACHE_SPLITS, CachePlan, TaskRows, cache_plan, cache_root,
                                   cache_in_place, expected_manifest, open_cache, other_caches)
from entry.data.files import resolve_task_paths
from entry.distributed import hooks
from entry.distributed.process_group import DistInfo, rank0_published
from entry.models.build import build_autoencoder
from entry.models.weights import load_weights
from entry.storage.folder_lock import release
from entry.storage.probe import StorageView, probe_storage
from entry.storage.run_folder import show_progress
from pipelines import latent_cache as lc
from pipelines.datasets import STEPS_KEY
from pipelines.fields import SAMPLE_ID_STRIDE
from pipelines.latent_cache import CacheError, check_cache
from pipelines.memory import read_budget
from pipelines.task_data import read_task, task_description
from pipelines.validate import validate_file

ENCODE_BATCH = 256
"""A block of rows read and encoded at once holds at most `ENCODE_BATCH` trajectories and (unless one
trajectory is larger) `pipelines.memory.read_budget()` bytes of fields: a 2D flow's trajectory can
be tens of MB."""


def caches_ready(cfg: Config, info: DistInfo) -> bool:
    """Whether every rank finds every cache of this config in place and matching (a collective:
    a node-local cache may be gone on some node, e.g. a fresh allocation's empty /dev/shm)."""
    ready = True
    for kind in CACHE_KINDS:
        for split in CACHE_SPLITS:
            plan = cache_plan(cfg, kind, split)
            if plan.needed and not cache_in_place(plan):
                ready = False
    if not info.distributed:
        return ready
    flag = torch.tensor([float(ready)], device=info.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _encode_rows(task: TaskRows, codec, rows: np.ndarray, device) -> dict[str, torch.Tensor]:
    """Encode file rows of one task into CPU tensors {z [n, T, L, D], task_id, dt, sample_id}
    (``codec``: the autoencoder, its encoder on ``device``)."""
    encoder = codec.for_task(task.index).encoder  # the codec reads this task's fields
    data = read_task(task.path, rows, task=task.spec, reduce_x=task.reduce_x, reduce_t=task.reduce_t)
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
        "task_id": torch.full((n,), task.index, dtype=torch.int64),
        "dt": torch.full((n,), dt, dtype=torch.float32),
        "sample_id": torch.as_tensor(rows, dtype=torch.int64) + task.index * SAMPLE_ID_STRIDE,
    }


def _padded(chunk: dict[str, torch.Tensor], padded_steps: int | None) -> dict[str, torch.Tensor]:
    """``chunk`` (`_encode_rows`) as a cache of tasks of other lengths stores it: z zero-padded to
    ``padded_steps`` frames and ``steps`` [n] holding its own; unchanged when ``padded_steps`` is None."""
    if padded_steps is None:
        return chunk
    z = chunk["z"]
    n, steps = z.shape[:2]
    return {**chunk, "z": torch.cat([z, z.new_zeros(n, padded_steps - steps, *z.shape[2:])], dim=1),
            STEPS_KEY: torch.full((n,), steps, dtype=torch.int64)}


def _temp_folder(out: Path, info: DistInfo, view: StorageView, specs: dict, logger) -> tuple[Path, object]:
    """The folder's leader, holding the folder's lock (`built_meanwhile` took it), allocates the cache
    under a unique temporary name beside `out` and reserves its disk space; every rank gets (its
    leader's folder, its writable TensorDict). A collective."""
    name, error = None, None
    if view.leader:
        try:
            # Holding the lock, no other builder is alive: what a killed one left is garbage.
            for leftover in lc.remove_leftovers(out):
                logger.info(f"removed {leftover}, left by a cache build that did not finish")
            tmp = lc.temp_dir_for(out, tag=f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
            lc.allocate_cache(tmp, specs)
            name = str(tmp)
            lc.reserve_space(tmp)
        except CacheError as e:
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


def _check_finite(z: torch.Tensor, plan: CachePlan, task: TaskRows) -> None:
    """Refuse latents that are not finite (bad encoder weights, or data that slipped past validation)."""
    if not torch.isfinite(z).all():
        raise CacheError(f"the encoder {plan.encoder} produced non-finite latents for "
                         f"{task.path} ({task.name}); retrain the autoencoder "
                         f"(python -m entry.autoencoder --config CFG) or check that data file")


def _cache_specs(plan: CachePlan, codec, device) -> tuple[dict, int | None]:
    """(field -> (shape, dtype) of the planned cache, the frames every trajectory is padded to), from
    the first row of every task. Tasks of one length are stored as they are (padded to None); tasks
    of other lengths are padded to the longest, each trajectory's own length kept under `STEPS_KEY`."""
    firsts = [_encode_rows(t, codec, t.rows[:1], device) for t in plan.tasks if len(t.rows)]
    steps = {f["z"].shape[1] for f in firsts}
    padded = max(steps) if len(steps) > 1 else None
    return {k: ((plan.trajectories, *v.shape[1:]), v.dtype) for k, v in _padded(firsts[0], padded).items()}, padded


def _rows_per_block(task: TaskRows) -> int:
    """Trajectories of `task` encoded at once: `ENCODE_BATCH`, fewer when they would exceed the
    read budget (`pipelines.memory.read_budget`: 256 MiB, less where memory is short)."""
    desc = task_description(task.path, task.spec)
    frames = 2 if desc.steady else math.ceil(desc.steps / task.reduce_t)
    points = math.prod(math.ceil(n / task.reduce_x) for n in desc.grid.shape)
    per_trajectory = frames * len(desc.channels) * points * 4
    return max(1, min(ENCODE_BATCH, read_budget() // per_trajectory))


def _encode_into(td, plan: CachePlan, codec, view: StorageView, info: DistInfo, bar,
                 padded_steps: int | None) -> None:
    """Encode this rank's share of every task's rows into the cache ``td`` (trajectories padded to
    ``padded_steps`` frames where tasks' lengths differ): contiguous blocks of a task's rows per rank
    of the folder, disjoint and together complete. Raises CacheError on non-finite latents."""
    start, block_index = 0, 0
    for task in plan.tasks:
        rows, per_block = task.rows, _rows_per_block(task)
        for j in range(view.index * per_block, len(rows), view.members * per_block):
            hooks.before_step("cache", info.rank, block_index, info.restart_count)
            block = rows[j:j + per_block]
            chunk = _padded(_encode_rows(task, codec, block, info.device), padded_steps)
            _check_finite(chunk["z"], plan, task)
            lc.write_rows(td, start + j, chunk)
            bar.update(len(block) * view.members)  # rank 0 reports for its group
            block_index += 1
        start += len(rows)


def build_cache(cfg: Config, info: DistInfo, logger, kind: str, split: str,
                storage: StorageView | None = None) -> Path | None:
    """Encode and write one cache collectively; returns its folder (None if no task of `kind`).

    The data files must have passed `pipelines.validate` (entry.cache and entry.pipeline check
    them first). The cache in place is replaced only by a whole, finite one: any failure leaves
    it as it was, and removes this build's temporary folder. `storage` says how the ranks share
    `training.cache_dir` (`probe_storage`, probed here when None).
    """
    plan = cache_plan(cfg, kind, split)
    if not plan.needed:
        return None
    view = storage if storage is not None else probe_storage(cache_root(cfg), info)
    model = load_weights(build_autoencoder(cfg), plan.encoder, made_by="python -m entry.autoencoder --config CFG")
    model.encoder.to(info.device).eval()  # the decoder is not used here
    total, (specs, padded_steps) = plan.trajectories, _cache_specs(plan, model, info.device)
    out = plan.folder
    error: Exception | None = None
    tmp = None
    try:
        if built_meanwhile(plan, info, view, wait_s=cfg.training.timeout_s / 2):
            if info.is_main:
                logger.info(f"cache {kind}/{split}: {out} was built meanwhile by another job of the same encoder "
                            f"and data; reused")
            return out
        tmp, td = _temp_folder(out, info, view, specs, logger)

        bar = tqdm(total=total, desc=f"cache {kind}/{split}", unit="traj",
                   disable=not (info.is_main and show_progress(cfg.logging.progress)))
        try:
            _encode_into(td, plan, model, view, info, bar, padded_steps)
        except CacheError as e:
            error = e  # agreed below, so no rank waits for one that stopped
        bar.close()
        del td
        # Every rank's rows are written (or some rank failed) before the leaders seal the cache.
        agree_on_failure(error, info, f"encoding {kind}/{split}")
        if view.leader:
            lc.finalize_cache(tmp, out, expected_manifest(plan))
        if info.is_main:
            logger.info(f"cache {kind}/{split}: {total} trajectories, z {tuple(specs['z'][0])} -> {out} "
                        f"({view.describe()})")
            _mention_others(plan, logger)
    except BaseException:
        if view.leader and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if view.leader:
            release(cache_lock_file(out))
    rank0_published(info, wrote=True)  # every leader's cache is renamed into place before any rank loads it
    return out


def _mention_others(plan: CachePlan, logger) -> None:
    """Log the other caches of this kind and split beside the new one: runs with other encoders or
    data keep theirs (folders are keyed by content), so only a person knows which are unused."""
    others = other_caches(plan)
    if others:
        size = sum(f.stat().st_size for p in others for f in p.rglob("*") if f.is_file())
        logger.info(f"cache {plan.kind}/{plan.split}: {len(others)} other cache folder(s) in {plan.root} "
                    f"({size / 2**30:.2f} GiB: {', '.join(p.name for p in others[:5])}); delete those no run uses")


def validate_data(cfg: Config, info: DistInfo, logger) -> None:
    """Every rank checks every task file (`pipelines.validate`); a bad one is a `DataError` naming it."""
    for task, path in zip(cfg.data.tasks, resolve_task_paths(cfg, require_existing=True), strict=True):
        report = validate_file(path, task=task.spec)
        if info.is_main:
            logger.info(f"data ok: {report}")


def verify_caches(cfg: Config, logger) -> None:
    """Full check of every cache the config uses: identity, every byte's sha256, finite values."""
    for kind in CACHE_KINDS:
        for split in CACHE_SPLITS:
            plan = cache_plan(cfg, kind, split)
            if plan.tasks:
                open_cache(plan, verify="sha256")
                logger.info(check_cache(plan.folder, deep=True))
