"""What every command shares: parse `--config`/`--set`, and turn user errors into exit code 2."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

import torch

from entry.config import ConfigError, add_config_args, load_config
from entry.config_schema import Config
from entry.precision import resolve_config
from pipelines.latent_cache import CacheError
from pipelines.pdebench_io import DataError

EXIT_USER_ERROR = 2


def parse_config(argv: list[str] | None, description: str,
                 extra: Callable[[argparse.ArgumentParser], None] | None = None, *,
                 resolve: bool = True) -> tuple[Config, argparse.Namespace]:
    """Parse the command line into a validated `Config` and the remaining arguments.

    With `resolve` (every command but check_config), `training.precision` and `training.compile`
    set to `auto` are resolved for this machine (entry.precision): bf16 + compile with CUDA, fp32
    eager without; the config hash and the run folder then record what actually runs.
    """
    parser = add_config_args(argparse.ArgumentParser(description=description))
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    return (resolve_config(cfg, cuda=torch.cuda.is_available()) if resolve else cfg), args


def exits_on_user_error(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap an entry's `main` so a `ValueError` from the user's input exits 2 with one clear line.

    Only `ConfigError`, the data layer's `DataError` and a refused latent cache's
    `CacheError` (all raised before anything is written) are turned into exit code 2; any
    other exception propagates, so a crash stays loud and reaches torchrun's error file.
    """

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR
        except DataError as e:
            print(f"data error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR
        except CacheError as e:
            print(f"cache error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR

    return wrapper
