"""`python -m entry.plan --config CFG --world-size N [--nodes M] [--gpu-memory 80GiB]`: will it fit?

For every training stage the config selects, simulates one optimizer step on rank 0 of N ranks
(entry/distributed/memory_sim.py: models on the meta device, sharded as training shards them over a fake
process group, one forward and backward of the per-rank batch under FakeTensorMode; no GPU and
no other process) and prints, per rank: parameters, gradients, optimizer state, frozen networks,
the activation peak and the total against the GPU's memory (fits or not, and the largest batch
that fits), and the bytes all-gathered and reduce-scattered per step. Precision, parallel,
`accum_steps` and the operator's `unroll_steps` are those of the config (and of `--set`);
`training.precision` and `training.compile` left at `auto` resolve as on the GPUs planned for
(bf16 and compile), whatever machine plans. With `training.parallel: ddp` every rank holds one
replica, simulated as one process, plus DDP's gradient buckets (one more copy of the gradients,
all-reduced once a step). A stage with `ema_decay` > 0 holds one more copy of its weights (the
moving average); a stage with nothing to train (the exact codec's autoencoder) runs its forward
alone, with no optimizer.

The largest batch is extrapolated from two simulated micro-batch sizes (memory is linear in the
batch for these models). `training.compile: true` is reported but not simulated: the activation
figure is eager's, an upper bound for a compiled model. Fake tensors live on the CPU, so GPU-only
workspace (attention kernels', NCCL's buffers, the CUDA context) is left to the `--usable` margin.
"""

from __future__ import annotations

import argparse
import sys

import orjson

from entry.config.cli import exits_on_user_error, parse_config
from entry.config.load import ConfigError
from entry.config.recipe import resolve_config
from entry.config.schema import shown
from entry.storage.atomic import atomic_write_bytes


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--world-size {shown(text)}: expected positive integers, e.g. 8 or 8,64,1024")
    return sizes


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", required=True, help="ranks (GPUs) to plan for; several: 8,64,1024")
    parser.add_argument("--nodes", type=int, default=1, help="machines the ranks are spread over")
    parser.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU, e.g. 80GiB, 40GB, 24G")
    parser.add_argument("--usable", type=float, default=0.9,
                        help="fraction of it training may fill (the rest: CUDA context, allocator slack)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the plans as JSON")


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _args, resolve=False)
    if not 0 < args.usable <= 1:
        raise ConfigError(f"--usable {args.usable}: expected a fraction in (0, 1]")
    world_sizes = _world_sizes(args.world_size)
    # Imported once the arguments have passed, as entry.pipeline's: the stages' records load the training
    # steps and their TensorDicts (with torch._dynamo, 2 s), which a refused key should not wait for.
    from entry.training.memory_plan import parse_bytes, plan_lines, plan_stages

    # The plan is for GPUs: `auto` resolves as it will there, not as on the laptop that plans.
    cfg = resolve_config(cfg, cuda=True)
    gpu_memory = parse_bytes(args.gpu_memory)
    plans = []
    for world_size in world_sizes:
        plan = plan_stages(cfg, world_size=world_size, nodes=args.nodes, gpu_memory=gpu_memory, usable=args.usable)
        plans.append(plan)
        print("\n".join(plan_lines(cfg, plan)), flush=True)
    if args.json:
        atomic_write_bytes(args.json, orjson.dumps(plans, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
