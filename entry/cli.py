"""What every command shares: parse `--config`/`--set`, and turn user errors into exit code 2."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from entry.config import ConfigError, add_config_args, load_config
from entry.config_schema import Config

EXIT_USER_ERROR = 2


def parse_config(argv: list[str] | None, description: str,
                 extra: Callable[[argparse.ArgumentParser], None] | None = None) -> tuple[Config, argparse.Namespace]:
    """Parse the command line into a validated `Config` and the remaining arguments."""
    parser = add_config_args(argparse.ArgumentParser(description=description))
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    return load_config(args.config, args.overrides), args


def exits_on_user_error(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap an entry's `main` so a `ValueError` from the user's input exits 2 with one clear line.

    Only `ConfigError` and the data layer's `DataError` (both `ValueError`s raised before
    anything is written) are turned into exit code 2; any other exception propagates, so a
    crash stays loud and its traceback reaches torchrun's error file.
    """

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR
        except ValueError as e:
            if type(e).__name__ != "DataError":
                raise
            print(f"data error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR

    return wrapper
