"""`torchrun --nproc_per_node=N -m entry.evaluate --config CFG [--set k=v] [--small]`: final test scores.

Also runs as plain `python -m entry.evaluate`. Loads the exported weights of the run folder,
rolls every test trajectory out autoregressively in latent space from its last given frame,
decodes, and scores with PDEBench's metrics (core/metrics.py). Ranks take contiguous shards
of each task's test samples and add their per-sample metric sums with `all_reduce`; rank 0
writes `<run_dir>/eval.json` (`eval_small.json` with `--small`), the plots under
`<run_dir>/plots/`, a table on the terminal, and the numbers to wandb when it is enabled.

Legend: N samples, B batch, T time steps, C channels, S spatial axes, L tokens, D latent dim.
"""

from __future__ import annotations

import argparse
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from entry.config.cli import exits_on_user_error, parse_config
from entry.distributed.process_group import close_distributed, init_distributed
from entry.evaluation.task_frames import SMALL_EVAL_SAMPLES
from entry.storage.run_folder import run_dir_for, setup_logging
from entry.training.stage_command import add_no_deps, command_args


def _small_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--small", action="store_true",
                        help=f"at most {SMALL_EVAL_SAMPLES} test samples per task; writes eval_small.json")
    add_no_deps(parser)


def run(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _small_arg)
    # Imported once the config has parsed, as entry.pipeline's: the models and the stages' records load
    # TensorDicts (with torch._dynamo, 2 s), which a refused key should not wait for.
    from entry.evaluation.scoring import evaluate_config
    from entry.evaluation.variants import required_weights
    from entry.training.stage_sequence import ensure_inputs, require_inputs

    if args.no_deps:
        require_inputs(cfg, "evaluate", command_args(args))  # user errors before any file or rendezvous
        required_weights(cfg, run_dir_for(cfg))
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s, debug=cfg.training.debug)
    try:
        if not args.no_deps and (code := ensure_inputs(cfg, info, "evaluate")) != 0:
            return code
        logger = setup_logging(run_dir_for(cfg), info, "evaluate")
        evaluate_config(cfg, info, small=args.small, logger=logger)
        return 0
    finally:
        close_distributed()


@record
@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
