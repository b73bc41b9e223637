"""`python -m bench.startup_time --config CFG [--set k=v] [--synthetic]`: the file work of a stage start.

Times, twice each on one process, what every rank does before training: the pipeline's data
preparation (`entry.training.stage_sequence.prepare_data`: generation of what is missing, validation) and one
stage's latent-cache manifest check (`entry.data.cache_plan.expected_manifest`: the data and encoder
fingerprints), with the bytes this process read (`/proc/self/io`, Linux). The second round
shows what a resumed or next stage pays. Both functions exist in older checkouts too, so the
same command measures before and after a change (`PYTHONPATH=<checkout>`).

`--synthetic` writes any missing data file with random values of the config's shapes (what
generation would write, in seconds instead of hours: the cost measured does not depend on the
values), and a freshly initialised encoder when the run has none. Timings are I/O- and
CPU-bound: measure on a quiet machine, and say whether the file was in the page cache.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from entry.config.cli import exits_on_user_error, parse_config
from entry.config.schema import Config
from entry.data.cache_plan import cache_plan, expected_manifest
from entry.data.files import task_path
from entry.distributed.process_group import DistInfo
from entry.models.build import build_autoencoder
from entry.storage.run_folder import run_dir_for
from entry.training.stage_record import weights_file
from entry.training.stage_sequence import prepare_data
from pipelines.pdebench_io import PDEBenchWriter


def bytes_read() -> int:
    """Bytes this process has read through read(2) and friends (0 where /proc/self/io is absent)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except OSError:
        return 0


def write_synthetic(cfg: Config) -> None:
    """Random-valued files of the config's shapes for every missing task file, and a fresh encoder."""
    rng = np.random.default_rng(0)
    for task in cfg.data.tasks:
        path, spec = task_path(cfg, task), task.spec
        if path.is_file():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        shape = (1, task.nx, task.nx) if spec.steady else (task.nt, task.nx)
        x = np.linspace(0.0, 1.0, task.nx)  # increasing, as validation requires; the values do not matter here
        coords = {"y_coordinate": x} if spec.steady else {"t_coordinate": np.linspace(0.0, spec.t_end, task.nt + 1)}
        block = max(1, (256 << 20) // (4 * int(np.prod(shape))))
        with PDEBenchWriter(path, task.name, n_samples=task.samples, x_coordinate=x,
                            attrs={"task": task.name, "param": task.param, "synthetic": 1}, **coords) as w:
            for s in range(0, task.samples, block):
                k = min(block, task.samples - s)
                w.write(s, rng.random((k, *shape), dtype=np.float32),
                        rng.random((k, *shape[1:]), dtype=np.float32) + 0.1 if spec.steady else None)
    weights = weights_file(run_dir_for(cfg), "autoencoder")
    if not weights.is_file():
        weights.parent.mkdir(parents=True, exist_ok=True)
        torch.save(build_autoencoder(cfg).state_dict(), weights)


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--synthetic", action="store_true", help="write missing data (random values) and encoder")


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _args)

    if args.synthetic:
        write_synthetic(cfg)
    info = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)
    logger = logging.getLogger("bench.startup_time")

    kind = "dynamic" if any(not t.spec.steady for t in cfg.data.tasks) else "steady"
    steps = (("pipeline data preparation", lambda: prepare_data(cfg, info, logger, 1)),
             ("stage cache-manifest check", lambda: expected_manifest(cache_plan(cfg, kind, "train"))))
    data_bytes = sum(Path(p).stat().st_size for p in _paths(cfg))
    print(f"data: {data_bytes / 2**30:.2f} GiB in {len(cfg.data.tasks)} file(s)")
    for round_ in (1, 2):
        for name, run in steps:
            before, t0 = bytes_read(), time.perf_counter()
            run()
            print(f"round {round_}: {name}: {time.perf_counter() - t0:.2f} s, "
                  f"{(bytes_read() - before) / 2**30:.2f} GiB read", flush=True)
    return 0


def _paths(cfg: Config) -> list[Path]:
    return [task_path(cfg, t) for t in cfg.data.tasks if task_path(cfg, t).is_file()]


if __name__ == "__main__":
    sys.exit(main())
