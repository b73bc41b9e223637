"""`python -m entry.cache --config CFG [--verify]` (also under torchrun): encode every trajectory once.

Validates the data files, then builds the latent caches `<training.cache_dir>/<kind>_<split>-<key>/`
(kinds `dynamic` and `steady`, splits `train` and `val`; the test split is never cached), with a
manifest naming the config, encoder and data they were made from; a node-local cache folder is
built once per node. How the ranks share the work: entry/data/latent_cache.py. `--verify` checks
the existing caches in full (every byte's sha256, finite values) instead of building.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from entry.config.cli import exits_on_user_error, parse_config
from entry.config.errors import USER_ERRORS
from entry.distributed.process_group import close_distributed, init_distributed
from entry.storage.probe import probe_storage, require_writable
from entry.storage.run_folder import open_rank_log, run_dir_for, setup_logging
from entry.training.stage_command import add_no_deps, command_args


def _args(parser) -> None:
    parser.add_argument("--verify", action="store_true",
                        help="check the existing caches in full (every byte's sha256, finite values) "
                             "instead of building")
    add_no_deps(parser)


@record
@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _args)
    # Imported once the config has parsed, as entry.pipeline's: the cache is TensorDicts (with
    # torch._dynamo, 2 s), which a refused key should not wait for.
    from entry.data.cache_plan import CACHE_KINDS, CACHE_SPLITS, cache_root
    from entry.data.latent_cache import build_cache, validate_data, verify_caches
    from entry.training.stage_sequence import ensure_inputs, require_inputs

    if args.no_deps and not args.verify:
        require_inputs(cfg, "cache", command_args(args))
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s)
    try:
        run_dir = run_dir_for(cfg)
        if not args.verify:
            require_writable(cache_root(cfg), info, "training.cache_dir")
        if args.verify:
            verify_caches(cfg, setup_logging(run_dir, info, "cache", deferred=True))
            return 0
        if not args.no_deps and (code := ensure_inputs(cfg, info, "cache")) != 0:
            return code
        # Held in memory until the caches are built: a user error (bad data, a full disk, found before
        # a cache is written) leaves the run folder alone, its log included.
        logger = setup_logging(run_dir, info, "cache", deferred=True)
        validate_data(cfg, info, logger)
        storage = probe_storage(cache_root(cfg), info)
        try:
            for kind in CACHE_KINDS:
                for split in CACHE_SPLITS:
                    build_cache(cfg, info, logger, kind, split, storage)
        except USER_ERRORS:
            raise
        except BaseException:
            open_rank_log(logger, run_dir, info)  # a crash is loud in the rank's log (distributed rule 5)
            raise
        open_rank_log(logger, run_dir, info)
        return 0
    finally:
        close_distributed()


if __name__ == "__main__":
    sys.exit(main())
