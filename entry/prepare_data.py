"""`python -m entry.prepare_data --config CFG` (also under torchrun): generate missing task files and validate all.

Prints one report line per file (task, shapes, value range, NaN/Inf counts); exits 2 on a
config or data error, writing nothing it was not asked to generate. A file's validation and
fingerprint are computed once per version of it and cached beside it (pipelines/file_facts.py);
`--rehash` reads every file in full again (validation and sha256) and refreshes the cache.
Under torchrun the ranks generate a missing file together, as `entry.cache` and the stages do
(entry/data/files.py: each rank a part, one merges, the others wait), and rank 0 reports.
"""

from __future__ import annotations

import argparse
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from entry.config.cli import exits_on_user_error, parse_config
from entry.data.files import ensure_data, prepare_data_files
from entry.distributed.process_group import close_distributed, init_distributed
from entry.storage.run_folder import run_dir_for, setup_logging
from pipelines.file_facts import file_fingerprint
from pipelines.validate import validated


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=1, help="processes for data generation")
    parser.add_argument("--rehash", action="store_true",
                        help="validate and hash every file from its bytes again (refreshes the cached facts)")


@record
@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _extra)
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s)
    try:
        if info.distributed:
            # Each rank running ensure_data would write the same file at once (the second finds the
            # first's writer lock and fails); this is the ranks' shared protocol. Its log is held
            # in memory only: this command writes nothing in the run folder.
            logger = setup_logging(run_dir_for(cfg), info, "prepare_data", deferred=True)
            paths = prepare_data_files(cfg, info, logger, workers=args.workers, progress=cfg.logging.progress)
        else:
            paths = ensure_data(cfg, workers=args.workers, log=lambda line: print(line, file=sys.stderr))
        if not info.is_main:
            return 0
        for task, path in zip(cfg.data.tasks, paths, strict=True):
            print(validated(path, task=task.spec, refresh=args.rehash))
            if args.rehash:
                print(f"  fingerprint {file_fingerprint(path, full=True)}")
        return 0
    finally:
        close_distributed()


if __name__ == "__main__":
    sys.exit(main())
