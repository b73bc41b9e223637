"""`python -m entry.cache --config CFG` (also under torchrun): encode every trajectory once.

Builds `<training.cache_dir>/<kind>_<split>/` for kind `dynamic` (time-dependent tasks,
"z" [N, T, L, D]) and `steady` (steady tasks, "z" [N, 2, L, D]: coefficient then solution,
so the pair dataset serves the steady prior unchanged), split `train` and `val`. The test
split is never cached: evaluation reads it from the HDF5 files. The ranks that see the cache
folder split the trajectories; their leader allocates the memmap and writes the manifest last.
A shared folder is built once by every rank (led by rank 0); a node-local one (`/dev/shm`,
`$TMPDIR/...`: environment variables in `training.cache_dir` are expanded per process) once
per node by that node's ranks (entry/storage.py tells which holds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from entry.cli import exits_on_user_error, parse_config
from entry.config import ConfigError, config_hash
from entry.config_schema import Config
from entry.data import task_path, task_split
from entry.distributed import DistInfo, close_distributed, init_distributed, rank0_published
from entry.run_files import run_dir_for, setup_logging
from entry.storage import StorageView, probe_storage

CACHE_KINDS = ("dynamic", "steady")
CACHE_SPLITS = ("train", "val")
ENCODE_BATCH = 256


def rebuild_hint(cfg_path: str = "CFG") -> str:
    return f"python -m entry.cache --config {cfg_path}"


def cache_root(cfg: Config) -> Path:
    """`training.cache_dir`, environment variables expanded in this process."""
    from entry.storage import expand_path

    return expand_path(cfg.training.cache_dir)


def cache_folder(cfg: Config, kind: str, split: str) -> Path:
    return cache_root(cfg) / f"{kind}_{split}"


def task_key(cfg: Config, i: int) -> str:
    t = cfg.data.tasks[i]
    return f"{i}:{t.name}:{t.param:g}"


def encoder_weights(cfg: Config) -> Path:
    from entry.runner import weights_file

    return weights_file(run_dir_for(cfg), "autoencoder")


def expected_manifest(cfg: Config, kind: str, split: str) -> dict:
    """What a valid cache of `kind`/`split` must record: config, encoder and data identity."""
    from pipelines.latent_cache import file_fingerprint

    weights = encoder_weights(cfg)
    if not weights.is_file():
        raise ConfigError(f"no trained encoder at {weights}: run the autoencoder stage first "
                          f"(python -m entry.autoencoder --config CFG)")
    tasks = [i for i, t in enumerate(cfg.data.tasks) if _is_steady(t.name) == (kind == "steady")]
    return {
        "kind": kind, "split": split,
        "config_hash": config_hash(cfg, sections=("data", "latent", "autoencoder")),
        "encoder_hash": file_fingerprint(weights),
        "data_fingerprints": {task_key(cfg, i): file_fingerprint(task_path(cfg, cfg.data.tasks[i])) for i in tasks},
    }


def _is_steady(name: str) -> bool:
    from pipelines.tasks import get_task

    return get_task(name).steady


def load_latent_cache(cfg: Config, kind: str, split: str, *, verify: str = "size"):
    """The memory-mapped cache of `kind`/`split`, refused with the rebuild command if it does not
    match the current config, encoder and data."""
    from pipelines.latent_cache import load_cache

    return load_cache(cache_folder(cfg, kind, split), expected_manifest(cfg, kind, split),
                      rebuild_hint(), verify=verify)


def caches_ready(cfg: Config, info: DistInfo) -> bool:
    """Whether every rank finds every cache of this config in place and matching (a collective:
    a node-local cache may be gone on some node, e.g. a fresh allocation's empty /dev/shm)."""
    import torch.distributed as dist

    from pipelines.latent_cache import CacheError

    ready = True
    for kind in CACHE_KINDS:
        for split in CACHE_SPLITS:
            if any(len(rows) for _, rows in _task_rows(cfg, kind, split)):
                try:
                    load_latent_cache(cfg, kind, split)
                except (CacheError, ConfigError):
                    ready = False
    if not info.distributed:
        return ready
    flag = torch.tensor([float(ready)], device=info.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _task_rows(cfg: Config, kind: str, split: str) -> list[tuple[int, np.ndarray]]:
    """(task index, file rows) of every task of `kind` in `split`."""
    return [(i, task_split(cfg, i, split)[0]) for i, task in enumerate(cfg.data.tasks)
            if _is_steady(task.name) == (kind == "steady")]


def _encode_rows(cfg: Config, encoder, task_index: int, rows: np.ndarray, device) -> dict[str, torch.Tensor]:
    """Encode file rows of one task into CPU tensors {z [n, T, L, D], task_id, dt, sample_id}."""
    from pipelines.pdebench_io import read_pdebench

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


def build_cache(cfg: Config, info: DistInfo, logger, kind: str, split: str,
                storage: StorageView | None = None) -> Path | None:
    """Encode and write one cache collectively; returns its folder (None if no task of `kind`).

    `storage` says how the ranks share `training.cache_dir` (`probe_storage`, probed here when None).
    """
    from pipelines import latent_cache as lc

    from entry.models import build_autoencoder

    task_rows = _task_rows(cfg, kind, split)
    if not task_rows or sum(len(r) for _, r in task_rows) == 0:
        return None
    view = storage if storage is not None else probe_storage(cache_root(cfg), info)
    model = build_autoencoder(cfg)
    model.load_state_dict(torch.load(encoder_weights(cfg), weights_only=True))
    encoder = model.encoder.to(info.device).eval()
    # Shapes from the first row of every task; time-dependent tasks must agree on T.
    firsts = [_encode_rows(cfg, encoder, i, rows[:1], info.device) for i, rows in task_rows]
    steps = {f["z"].shape[1] for f in firsts}
    if len(steps) > 1:
        raise ConfigError(f"time-dependent tasks have different numbers of steps after reduce_t ({sorted(steps)}); "
                          f"set data.tasks[i].nt / reduce_t so they agree, or train them in separate runs")
    total = sum(len(r) for _, r in task_rows)
    specs = {k: ((total, *v.shape[1:]), v.dtype) for k, v in firsts[0].items()}
    out = cache_folder(cfg, kind, split)
    tmp = lc.temp_dir_for(out, tag=f"{config_hash(cfg)}-{info.restart_count}")
    if view.leader:
        td = lc.allocate_cache(tmp, specs)
    if info.distributed:
        dist.barrier()  # the memmap files exist before any other rank opens them
    if not view.leader:
        td = lc.open_allocated(tmp)
    from tqdm import tqdm

    bar = tqdm(total=total, desc=f"cache {kind}/{split}", unit="traj", disable=not (info.is_main and cfg.logging.progress))
    start = 0
    for task_index, rows in task_rows:
        # Contiguous blocks of this task's rows per rank of the folder: disjoint, together complete.
        for j in range(view.index * ENCODE_BATCH, len(rows), view.members * ENCODE_BATCH):
            block = rows[j:j + ENCODE_BATCH]
            lc.write_rows(td, start + j, _encode_rows(cfg, encoder, task_index, block, info.device))
            bar.update(len(block) * view.members)  # rank 0 reports for its group
        start += len(rows)
    bar.close()
    if info.distributed:
        dist.barrier()  # every rank's rows are written before rank 0 seals the cache
    if view.leader:
        lc.finalize_cache(tmp, out, expected_manifest(cfg, kind, split))
        if info.is_main:
            logger.info(f"cache {kind}/{split}: {total} trajectories, z {tuple(specs['z'][0])} -> {out} "
                        f"({view.describe()})")
    rank0_published(info, wrote=True)  # every leader's cache is renamed into place before any rank loads it
    return out


@record
@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, _ = parse_config(argv, __doc__)
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s)
    try:
        logger = setup_logging(run_dir_for(cfg), info, "cache")
        storage = probe_storage(cache_root(cfg), info)
        for kind in CACHE_KINDS:
            for split in CACHE_SPLITS:
                build_cache(cfg, info, logger, kind, split, storage)
        return 0
    finally:
        close_distributed()


if __name__ == "__main__":
    sys.exit(main())
