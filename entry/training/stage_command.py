"""The command line of every stage module (`python -m entry.operator --config CFG`, also under
torchrun): parse, start the process group, build what the stage needs that is missing (the data,
then its input stages, as entry.pipeline would; `--no-deps` instead stops with exit 2 naming the
command that makes the first missing input), run the stage, close."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.errors import record

from entry.config.cli import exits_on_user_error, parse_config
from entry.config.schema import STAGE_NAMES
from entry.distributed.process_group import close_distributed, init_distributed


def add_no_deps(parser: argparse.ArgumentParser) -> None:
    """The `--no-deps` flag of every command that has inputs to build."""
    parser.add_argument("--no-deps", action="store_true",
                        help="do not build missing inputs (data, earlier stages): stop and name the command")


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", choices=["auto", "never"], default="auto",
                        help="auto: continue from the newest complete checkpoint of this stage")
    add_no_deps(parser)


def command_args(args: argparse.Namespace) -> str:
    """The ``--config PATH --set k=v ...`` part of this command line, quoted for a shell."""
    parts = ["--config", args.config] + [x for o in args.overrides for x in ("--set", o)]
    return " ".join(shlex.quote(str(p)) for p in parts)


def run_stage(argv: list[str] | None, name: str, description: str) -> int:
    """Parse, initialise the process group, make the inputs of stage ``name``, execute the stage (its
    record: entry.stages.record), close."""
    cfg, args = parse_config(argv, description, _args)
    # Imported once the config has parsed, as entry.pipeline's: the stages' records load the training
    # steps and their TensorDicts (with torch._dynamo, 2 s), which a refused key should not wait for.
    from entry.stages.record import stage_spec
    from entry.training.estimate import check_trajectories
    from entry.training.runner import check_world_size, execute_stage
    from entry.training.stage_sequence import ensure_inputs, require_inputs

    stage = stage_spec(name)
    if args.no_deps:
        require_inputs(cfg, stage.name, command_args(args))  # before the process group: nothing to undo
        check_trajectories(cfg, [stage.name])  # the data are there (require_inputs)
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s,
                            debug=cfg.training.debug)
    try:
        check_world_size(stage, cfg, info.world_size)  # the stage's own mistake, before building its inputs
        if not args.no_deps:
            code = ensure_inputs(cfg, info, stage.name)
            if code != 0:
                return code
        return execute_stage(cfg, info, stage, resume=args.resume == "auto")
    finally:
        close_distributed()


def stage_command(name: str, description: str) -> Callable[..., int]:
    """The `main(argv)` of the module of the stage ``name`` (one of `STAGE_NAMES` but the evaluation):
    `run_stage` with torchrun's `@record` and exit code 2 for user errors."""
    if name not in STAGE_NAMES[:-1]:
        raise ValueError(f"stage_command: no training stage {name!r}; the stages are {list(STAGE_NAMES[:-1])}")

    @record
    @exits_on_user_error
    def main(argv: list[str] | None = None) -> int:
        return run_stage(argv, name, description)

    return main
