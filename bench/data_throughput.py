"""`python -m bench.data_throughput --config CFG [--set k=v] [--workers 0,1,2,4] [--batches N] [--out DIR]`

Batches per second delivered by two data pipelines over the config's time-dependent tasks
(train split), both through `pipelines.loader.build_loader`, at each `--workers`:

- `cached_latent`: LatentPairs over a memory-mapped latent cache, MultiTaskBatchSampler
  (what the operator stage trains on); batches moved to the GPU when there is one.
- `field_on_the_fly`: FieldTrajectoryPairs read from HDF5 on every batch, single-task
  batches, both fields encoded by a GridEncoder under `torch.no_grad` (the plain baseline).

The cache is built into a temporary folder by a freshly initialised GridEncoder of the
config's latent size: random weights cost the same as trained ones, and no trained
encoder is needed (the JSON says so). Batch size: `operator.batch_size`. The first
`--warmup` batches of each measurement are not timed (thread start-up, first page faults).
GB/s counts the bytes of the batches the loader yields (latents, or both fields).
Writes `<out>/<device>-<YYYY-MM-DD>-data_throughput.json` and prints a table.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import orjson
import torch

from bench.provenance import record_stamp, training_device
from core.models.grid_codec import GridEncoder
from entry.config.cli import exits_on_user_error, parse_config
from entry.config.load import ConfigError, config_hash
from entry.config.schema import Config
from entry.data.files import ensure_data, task_split
from entry.models.build import require_grid_codec
from pipelines.datasets import LatentPairs
from pipelines.fields import SAMPLE_ID_STRIDE, FieldTrajectoryPairs, build_field_loader
from pipelines.latent_cache import load_cache, write_cache
from pipelines.loader import build_loader
from pipelines.samplers import MultiTaskBatchSampler
from pipelines.task_data import read_task

ENCODE_BATCH = 256
NOTES = ("time-dependent tasks only (steady tasks have no time pairs); gb_per_s counts the bytes of the "
         "batches the loader yields (latents for cached_latent, both fields for field_on_the_fly); "
         "the cache lives in a temporary folder (page cache warm after it is written)")
ENCODER_NOTE = "GridEncoder freshly initialised (random weights; throughput only, no trained encoder)"


def _extra_args(p) -> None:
    p.add_argument("--workers", default="0,1,2,4", help="comma-separated num_workers to measure")
    p.add_argument("--batches", type=int, default=50, help="timed batches per measurement")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches before each measurement")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="result folder")


def _dynamic_tasks(cfg: Config, paths: list[Path]) -> list[tuple[int, Path, np.ndarray]]:
    """(task index, file, train rows) of every time-dependent task."""
    out = [(i, path, task_split(cfg, i, "train")[0])
           for i, (task, path) in enumerate(zip(cfg.data.tasks, paths)) if not task.spec.steady]
    if not out:
        raise ConfigError("data.tasks: the benchmark needs at least one time-dependent task")
    return out


def build_random_cache(cfg: Config, tasks, encoder, device, out_dir: Path) -> Path:
    """Encodes every train trajectory with `encoder` into a latent cache at `out_dir`."""
    chunks = []
    for i, path, rows in tasks:
        t = cfg.data.tasks[i]
        data = read_task(path, rows, task=t.spec, reduce_x=t.reduce_x, reduce_t=t.reduce_t)
        u = torch.from_numpy(data.u)  # [n, T, C, X]
        flat = u.reshape(-1, *u.shape[2:])
        with torch.no_grad():
            z = torch.cat([encoder(flat[j:j + ENCODE_BATCH].to(device)).float().cpu()
                           for j in range(0, flat.shape[0], ENCODE_BATCH)])
        n = u.shape[0]
        chunks.append({"z": z.reshape(n, u.shape[1], *z.shape[1:]).contiguous(),
                       "task_id": torch.full((n,), i, dtype=torch.int64),
                       "dt": torch.full((n,), float(data.t[1] - data.t[0]), dtype=torch.float32),
                       "sample_id": torch.as_tensor(rows, dtype=torch.int64) + i * SAMPLE_ID_STRIDE})
    steps = {c["z"].shape[1] for c in chunks}
    if len(steps) > 1:
        raise ConfigError(f"time-dependent tasks keep different numbers of steps ({sorted(steps)}); "
                          f"set data.tasks[i].nt / reduce_t so they agree")
    total = sum(c["z"].shape[0] for c in chunks)
    specs = {k: ((total, *v.shape[1:]), v.dtype) for k, v in chunks[0].items()}
    return write_cache(out_dir, chunks, {"encoder": ENCODER_NOTE}, specs=specs)


def _endless(loader) -> Iterator:
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def _nbytes(batch) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values(include_nested=True, leaves_only=True))


def measure(loader, consume: Callable, *, batches: int, warmup: int, device: torch.device) -> dict:
    """Times `batches` batches of `loader` (after `warmup` untimed ones), each passed to `consume`."""
    it, nbytes = _endless(loader), 0
    try:
        for _ in range(warmup):
            consume(next(it))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(batches):
            batch = next(it)
            nbytes += _nbytes(batch)
            consume(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies and kernels of the last batch are done
        seconds = time.perf_counter() - t0
    finally:
        loader.close()
    return {"batches": batches, "seconds": seconds, "batches_per_s": batches / seconds,
            "gb_per_s": nbytes / seconds / 1e9, "mb_per_batch": nbytes / batches / 1e6}


def measure_fields(cfg: Config, tasks, encoder, workers: list[int], device: torch.device, common: dict) -> list[dict]:
    """Batches per second of the field pipeline (HDF5 reads, the encoder on the fly) per worker count."""
    horizon, t = cfg.operator.horizon, cfg.training
    fields = [FieldTrajectoryPairs(path, rows, reduce_x=cfg.data.tasks[i].reduce_x,
                                   reduce_t=cfg.data.tasks[i].reduce_t, horizon=horizon, task_id=i,
                                   task=cfg.data.tasks[i].spec)
              for i, path, rows in tasks]

    @torch.no_grad()
    def encode(batch):
        batch = batch.to(device, non_blocking=True)
        encoder(batch["u_t"]), encoder(batch["u_next"])

    out = []
    for w in workers:
        loader = build_field_loader(fields, rank=0, world_size=1, batch_size_per_rank=cfg.operator.batch_size,
                                    seed=t.seed, num_workers=w, prefetch_factor=t.prefetch_factor,
                                    pin_memory=device.type == "cuda")
        out.append({"num_workers": w, **measure(loader, encode, **common)})
    return out


def run(cfg: Config, args, *, workers: list[int], device: torch.device) -> dict:
    tasks = _dynamic_tasks(cfg, ensure_data(cfg))
    torch.manual_seed(cfg.training.seed)  # the encoder's random initialisation
    lat = cfg.latent
    encoder = GridEncoder(1, lat.tokens, lat.dim, hidden=lat.hidden).to(device).eval()
    batch_size, horizon = cfg.operator.batch_size, cfg.operator.horizon
    pin, prefetch, seed = device.type == "cuda", cfg.training.prefetch_factor, cfg.training.seed
    common = dict(batches=args.batches, warmup=args.warmup, device=device)
    results = {"cached_latent": [], "field_on_the_fly": []}

    with tempfile.TemporaryDirectory(prefix="data_throughput-") as tmp:
        folder = build_random_cache(cfg, tasks, encoder, device, Path(tmp) / "cache")
        td = load_cache(folder, {"encoder": ENCODER_NOTE}, "python -m bench.data_throughput", verify="size")
        pairs = LatentPairs(td, horizon_k=horizon)
        cache_info = {"trajectories": int(td.batch_size[0]), "z_shape": list(td["z"].shape),
                      "bytes": sum(p.stat().st_size for p in folder.iterdir()), "pairs": len(pairs)}

        def to_device(batch):
            if device.type == "cuda":
                batch.to(device, non_blocking=True)

        for w in workers:
            sampler = MultiTaskBatchSampler(pairs.task_sizes, global_batch=batch_size, rank=0, world_size=1,
                                            strategy=cfg.data.task_sampling, seed=seed)
            loader = build_loader(pairs, sampler, num_workers=w, prefetch_factor=prefetch, pin_memory=pin)
            results["cached_latent"].append({"num_workers": w, **measure(loader, to_device, **common)})
        del pairs, td

    results["field_on_the_fly"] = measure_fields(cfg, tasks, encoder, workers, device, common)

    best = {k: max(r["batches_per_s"] for r in v) for k, v in results.items()}
    return {
        "tasks": [f"{i}:{cfg.data.tasks[i].name}:{cfg.data.tasks[i].param:g}" for i, _, _ in tasks],
        "train_trajectories": {f"{i}": int(rows.size) for i, _, rows in tasks},
        "batch_size": batch_size, "horizon": horizon, "prefetch_factor": prefetch, "pin_memory": pin,
        "encoder": ENCODER_NOTE, "notes": NOTES,
        "latent": {"tokens": lat.tokens, "dim": lat.dim, "hidden": lat.hidden},
        "cache": cache_info, **results,
        "best_batches_per_s": best,
        "speedup_cached_over_field": best["cached_latent"] / best["field_on_the_fly"],
    }


def print_table(report: dict) -> None:
    print(f"{'pipeline':<18}{'workers':>8}{'batches/s':>12}{'GB/s':>10}{'MB/batch':>10}")
    for name in ("cached_latent", "field_on_the_fly"):
        for r in report[name]:
            print(f"{name:<18}{r['num_workers']:>8}{r['batches_per_s']:>12.1f}{r['gb_per_s']:>10.4f}"
                  f"{r['mb_per_batch']:>10.3f}")
    print(f"best cached / best field batches/s: {report['speedup_cached_over_field']:.1f}x")


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _extra_args)
    require_grid_codec(cfg, "bench.data_throughput")  # its cache is encoded by a GridEncoder of latent.tokens
    try:
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        raise ConfigError(f"--workers must be comma-separated integers, got {args.workers!r}") from None
    if not workers or min(workers) < 0 or args.batches < 1 or args.warmup < 0:
        raise ConfigError("--workers needs integers >= 0, --batches >= 1 and --warmup >= 0")
    device = training_device()
    date = datetime.date.today().isoformat()
    report = {
        "benchmark": "data_throughput", **record_stamp(device), "date": date,
        "config": args.config, "overrides": list(args.overrides), "config_hash": config_hash(cfg),
        "cuda": torch.version.cuda, "cpu_cores": len(os.sched_getaffinity(0)), "timed_batches": args.batches,
        "warmup_batches": args.warmup,
        **run(cfg, args, workers=workers, device=device),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{report['device']}-{date}-data_throughput.json"
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    print_table(report)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
