"""`python -m entry.prepare_data --config CFG`: generate missing task files and validate all.

Prints one report line per file (task, shapes, value range, NaN/Inf counts); exits 2 on a
config or data error, writing nothing it was not asked to generate.
"""

from __future__ import annotations

import argparse
import sys

from entry.cli import exits_on_user_error, parse_config
from entry.data import ensure_data


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=1, help="processes for data generation")


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _extra)
    from pipelines.validate import validate_file

    for path in ensure_data(cfg, workers=args.workers):
        print(validate_file(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
