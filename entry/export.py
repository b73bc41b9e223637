"""`python -m entry.export --run RUN --out DIR [--task NAME] [--force]`: a trained run's networks as
`torch.export` programs.

Writes the folder DIR with ``encode.pt2`` (fields [B, C, *S] in physical units -> latent [B, L, D]),
``decode.pt2`` (latent -> fields on the task's grid), ``step.pt2`` (one operator step: latent, time
step [B] float32, task id [B] int64 -> next latent), ``refine.pt2`` when the run has a consistency
model (one sampler step with its standard-normal draws an input), and ``meta.json`` (channels, grid,
time step, task id, latent shape). Each loads with `torch.export.load` alone (docs/using.md rolls
them out). A user's mistake exits 2 with one line and writes nothing; DIR appears whole or not at all.
"""

from __future__ import annotations

import argparse
import sys

from entry.config.cli import exits_on_user_error
from entry.inference import load_run
from entry.inference.export import export_run


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a trained run folder (runs/<run>)")
    p.add_argument("--out", required=True, help="folder to write the programs to")
    p.add_argument("--task", default=None,
                   help="the run's task, by its eval.json name or its index (default: its only task)")
    p.add_argument("--device", default="cpu", help="device the programs are exported for (default: cpu)")
    p.add_argument("--force", action="store_true", help="replace --out when it exists")
    args = p.parse_args(argv)
    surrogate = load_run(args.run, device=args.device)
    out = export_run(surrogate, surrogate.task(args.task), args.out, force=args.force)
    print(f"export: {', '.join(sorted(q.name for q in out.iterdir()))} -> {out}", file=sys.stderr)
    return 0


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
