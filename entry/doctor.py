"""`python -m entry.doctor` (also under torchrun): check the distributed environment, one line each.

Checks rank/world/env variables, the backend, an all_reduce and a barrier round trip with
timing, GPU visibility and NCCL version, whether the GPU suits the training recipe (bf16 natively
from compute capability 8.0, torch.compile from 7.0), /dev/shm size and a free port. With `--config CFG`
also which of the config's folders every rank can write and sees (global rank 0 writes a token, every
rank looks for it: entry/storage/probe.py) and what follows: the run folder must be shared; a
node-local latent cache is built on every node; a node-local data folder needs its files on every
node. It creates none of them: a folder not yet made is judged where it would be made. Exits 1 if
any check fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from entry.config.load import ConfigError, load_config
from entry.config.recipe import describe, recipe_problems, resolve_training
from entry.config.schema import TrainingConfig
from entry.data.cache_plan import cache_root
from entry.data.files import task_path
from entry.distributed.process_group import close_distributed, init_distributed
from entry.storage.probe import check_storage, expand_path


def _line(ok: bool, name: str, detail: str) -> bool:
    rank = os.environ.get("RANK")
    where = f"rank{rank} " if rank is not None else ""
    # One write per line, so lines of several ranks sharing a terminal do not interleave.
    sys.stdout.write(f"[{'pass' if ok else 'FAIL'}] {where}{name}: {detail}\n")
    sys.stdout.flush()
    return ok


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _folder_checks(cfg, info) -> list[bool]:
    """One line per folder of `cfg` that ranks share: shared, node-local, and what follows."""
    folders = [("logging.run_dir", expand_path(cfg.logging.run_dir), "shared: every rank reads the checkpoints, done files and "
                "weights rank 0 writes", "NOT shared: checkpoints, done files and weights would be missing on other "
                "nodes; put logging.run_dir on a filesystem every node mounts"),
               ("training.cache_dir", cache_root(cfg), "shared: the latent cache is built once, by every rank",
                "node-local: the latent cache is built once per node (each node needs room for all of it)")]
    folders += [(f"data.tasks[{i}]", task_path(cfg, t).parent, "shared: missing files are generated once, by every "
                 "rank", "node-local: every node needs the data files; missing ones are generated on each node")
                for i, t in enumerate(cfg.data.tasks)]
    results, seen = [], set()
    for key, folder, if_shared, if_local in folders:
        if folder in seen:
            continue
        seen.add(folder)
        try:
            view = check_storage(folder, info, key)  # creates nothing: the doctor only checks
        except ConfigError as e:
            results.append(_line(False, f"folder {key}", str(e)))
            continue
        ok = view.shared or key != "logging.run_dir"
        results.append(_line(ok, f"folder {key}", f"{folder}: {if_shared if view.shared else if_local}"))
    return results


def _recipe_line(cfg, capability: tuple[int, int]) -> bool:
    """Whether this GPU suits the training recipe of `cfg` (without one: the default, `auto`) as it
    resolves on CUDA; one line, naming the key to change where it does not."""
    training = resolve_training(cfg.training if cfg is not None else TrainingConfig(), cuda=True)
    problems = recipe_problems(training, capability)
    detail = f"{describe(training)} here (compute capability {capability[0]}.{capability[1]})"
    return _line(not problems, "recipe", "; ".join([detail, *problems]))


def run_checks(backend: str, timeout_s: float, cfg=None) -> bool:
    """Run every check (the folders of `cfg` too, when given), print one line per check, return
    whether all passed."""
    results = []
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                           "TORCHELASTIC_RESTART_COUNT")}
    under_torchrun = env["WORLD_SIZE"] is not None
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if under_torchrun and env[k] is None]
    results.append(_line(not missing, "environment",
                         ", ".join(f"{k}={v}" for k, v in env.items() if v is not None) or "plain process (world size 1)"
                         + (f"; missing {missing}" if missing else "")))
    t0 = time.perf_counter()
    try:
        info = init_distributed(backend=backend, timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001 - reported as a failed check, then the command fails
        results.append(_line(False, "process group", f"{type(e).__name__}: {e}"))
        return False
    results.append(_line(True, "process group", f"rank {info.rank}/{info.world_size}, backend {info.backend or 'none'}, "
                                               f"device {info.device}, {time.perf_counter() - t0:.2f} s"))
    if info.distributed:
        x = torch.ones(1, device=info.device) * (info.rank + 1)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        expected = info.world_size * (info.world_size + 1) / 2
        results.append(_line(x.item() == expected, "all_reduce",
                             f"sum {x.item():g} (expected {expected:g}), {1e3 * (time.perf_counter() - t0):.1f} ms"))
        t0 = time.perf_counter()
        dist.barrier()
        results.append(_line(True, "barrier", f"{1e3 * (time.perf_counter() - t0):.1f} ms"))
    cuda = torch.cuda.is_available()
    if cuda:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "n/a"
        results.append(_line(True, "gpu", f"{torch.cuda.device_count()} visible ({torch.cuda.get_device_name(0)}), "
                                          f"NCCL {nccl}, CUDA {torch.version.cuda}"))
        if info.device.type == "cuda":
            results.append(_recipe_line(cfg, torch.cuda.get_device_capability(info.device)))
    else:
        results.append(_line(True, "gpu", "none visible: CPU training with gloo"))
    if os.path.isdir("/dev/shm"):
        total, _, free = shutil.disk_usage("/dev/shm")
        results.append(_line(free > 2**28, "/dev/shm", f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"))
    else:
        results.append(_line(True, "/dev/shm", "absent: put latent caches on a local disk"))
    results.append(_line(True, "free port", str(_free_port())))
    results.append(_line(True, "torch", torch.__version__))
    if cfg is not None:
        results += _folder_checks(cfg, info)
    close_distributed()
    return all(results)


@record
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--config", default=None, help="also check which of this config's folders ranks share")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable)")
    args = parser.parse_args(argv)
    cfg = None
    if args.config is not None:
        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
    return 0 if run_checks(args.backend, args.timeout_s, cfg) else 1


if __name__ == "__main__":
    sys.exit(main())
