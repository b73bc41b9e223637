"""`python -m entry.prepare_data --config CFG`: generate missing task files and validate all.

Prints one report line per file (task, shapes, value range, NaN/Inf counts); exits 2 on a
config or data error, writing nothing it was not asked to generate. A file's validation and
fingerprint are computed once per version of it and cached beside it (pipelines/file_facts.py);
`--rehash` reads every file in full again (validation and sha256) and refreshes the cache.
"""

from __future__ import annotations

import argparse
import sys

from entry.config.cli import exits_on_user_error, parse_config
from entry.data.files import ensure_data
from pipelines.latent_cache import file_fingerprint
from pipelines.validate import validated


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=1, help="processes for data generation")
    parser.add_argument("--rehash", action="store_true",
                        help="validate and hash every file from its bytes again (refreshes the cached facts)")


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _extra)

    for task, path in zip(cfg.data.tasks, ensure_data(cfg, workers=args.workers), strict=True):
        print(validated(path, task=task.spec, refresh=args.rehash))
        if args.rehash:
            print(f"  fingerprint {file_fingerprint(path, full=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
