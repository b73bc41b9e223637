"""`python -m entry.cache --config CFG` (also under torchrun): encode every trajectory once.

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

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from entry.config.cli import exits_on_user_error, parse_config
from entry.data.cache_plan import CACHE_KINDS, CACHE_SPLITS, cache_root
from entry.data.latent_cache import build_cache, validate_data, verify_caches
from entry.distributed.process_group import close_distributed, init_distributed
from entry.storage.probe import probe_storage
from entry.storage.run_folder import open_rank_log, run_dir_for, setup_logging
from entry.training.stage_command import add_no_deps, command_args
from entry.training.stage_sequence import ensure_inputs, require_inputs


def _args(parser) -> None:
    parser.add_argument("--verify", action="store_true",
                        help="check the existing caches in full (every byte's sha256, finite values) "
                             "instead of building")
    add_no_deps(parser)


@record
@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _args)
    if args.no_deps and not args.verify:
        require_inputs(cfg, "cache", command_args(args))
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s)
    try:
        run_dir = run_dir_for(cfg)
        if args.verify:
            verify_caches(cfg, setup_logging(run_dir, info, "cache", deferred=True))
            return 0
        if not args.no_deps and (code := ensure_inputs(cfg, info, "cache")) != 0:
            return code
        # Held in memory until the data have passed: a user error leaves the run folder alone.
        logger = setup_logging(run_dir, info, "cache", deferred=True)
        validate_data(cfg, info, logger)
        open_rank_log(logger, run_dir, info)
        storage = probe_storage(cache_root(cfg), info)
        for kind in CACHE_KINDS:
            for split in CACHE_SPLITS:
                build_cache(cfg, info, logger, kind, split, storage)
        return 0
    finally:
        close_distributed()


if __name__ == "__main__":
    sys.exit(main())
