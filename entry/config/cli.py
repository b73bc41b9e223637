"""What every command shares: parse `--config`/`--set`, and turn user errors into exit code 2.

The user errors themselves (`USER_ERRORS`, re-exported here) are listed in entry/config/errors.py, so this
module imports no layer above entry.config to name them."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable

import torch

from entry.config.errors import USER_ERRORS, error_label
from entry.config.load import add_config_args, load_config
from entry.config.recipe import resolve_config
from entry.config.schema import Config, cut

__all__ = ["EXIT_USER_ERROR", "USER_ERRORS", "MAX_ERROR_CHARS", "load_resolved", "parse_config", "user_error_line",
           "exits_on_user_error"]

EXIT_USER_ERROR = 2


def parse_config(argv: list[str] | None, description: str,
                 extra: Callable[[argparse.ArgumentParser], None] | None = None, *,
                 resolve: bool = True) -> tuple[Config, argparse.Namespace]:
    """Parse the command line into a validated `Config` and the remaining arguments.

    With `resolve` (every command but check_config), `training.precision` and `training.compile`
    set to `auto` are resolved for this machine (entry.distributed.precision): bf16 + compile with CUDA, fp32
    eager without; the config hash and the run folder then record what actually runs.
    """
    parser = add_config_args(argparse.ArgumentParser(description=description))
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    return (load_resolved(args.config, args.overrides) if resolve else load_config(args.config, args.overrides)), args


def load_resolved(path, overrides: list[str]) -> Config:
    """The config at `path` with `overrides` (``key=value``), validated and resolved for this
    machine (`resolve_config`) as every stage command runs it: what its hash and run folder record."""
    return resolve_config(load_config(path, overrides), cuda=torch.cuda.is_available())


MAX_ERROR_CHARS = 4000
"""The longest user error line printed: messages show values cut short (entry.config.schema.shown);
this bounds what any other message quotes (a path, a file's text), yet keeps whole the commands
that messages name for a user to copy (with the user's own `--set` overrides)."""


def user_error_line(error: BaseException) -> str:
    """The one line a user error prints: its kind and its message, line breaks folded, at most
    about `MAX_ERROR_CHARS` characters."""
    return cut(f"{error_label(error)}: {' '.join(str(error).split())}", MAX_ERROR_CHARS)


def exits_on_user_error(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap an entry's `main` so a user error (`USER_ERRORS`) exits 2 with one clear line.

    Those errors are raised before anything is written; any other exception propagates, so a
    crash stays loud and reaches torchrun's error file.
    """

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except USER_ERRORS as e:
            print(user_error_line(e), file=sys.stderr)
            return EXIT_USER_ERROR
        except BaseException:
            # torchrun's `@record` now writes this rank's error file, while the agent SIGTERMs every
            # rank of the failed job: killed by that signal halfway, the file is left empty and the
            # agent itself crashes reading it (json.JSONDecodeError) instead of restarting the job.
            if "TORCHELASTIC_RUN_ID" in os.environ and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise

    return wrapper
