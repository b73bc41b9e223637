"""`python -m entry.predict --run RUN --input FILE --steps N --out FILE [--variant V] [--members K]`:
roll a trained run out from the initial frames of a data file and write the trajectories.

Reads the first given frames of every trajectory (``--rows A:B``: some) of FILE in any layout the
stack reads (``--layout``, default ``auto``), rolls the run's models out ``--steps`` operator steps
exactly as `entry.evaluate` does (`entry.inference`), and writes the given frames followed by the
predictions as HDF5 in the input's layout (``--out-layout the_well``: The Well's), atomically. A
user's mistake (a run not trained, a file of other fields, grid or layout, an existing ``--out``
without ``--force``, an ``--out`` in a folder that takes no file) exits 2 with one line and writes nothing.

Legend: K members, N trajectories, T time steps, C channels, S spatial axes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from entry.config.cli import exits_on_user_error
from entry.config.errors import InputError
from entry.evaluation.scoring import EVAL_BATCH
from entry.inference import load_run
from entry.inference.files import read_initial, require_out, write_predictions
from entry.storage.run_folder import commit_label, show_progress
from pipelines.layouts import layout_names
from pipelines.layouts.write_rollout import OUT_LAYOUTS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a trained run folder (runs/<run>)")
    p.add_argument("--input", required=True, help="HDF5 file holding the initial frames")
    p.add_argument("--layout", default="auto", choices=layout_names(), help="how --input is read (default: auto)")
    p.add_argument("--task", default=None,
                   help="the run's task to roll out, by its eval.json name or its index (default: its only task)")
    p.add_argument("--rows", default=None, metavar="A:B", help="trajectories of --input to roll out (default: all)")
    p.add_argument("--steps", required=True, type=int, help="operator steps to predict")
    p.add_argument("--variant", default="operator", help="operator, operator+diffusion or operator+consistency")
    p.add_argument("--members", type=int, default=None, help="ensemble members of a refiner (K rollouts each)")
    p.add_argument("--seed", type=int, default=None, help="noise seed of the refiners (default: the run's)")
    p.add_argument("--batch-size", type=int, default=EVAL_BATCH, help="trajectories rolled out together")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device to roll out on: cpu, cuda or cuda:N (default: cuda where there is one, else cpu)")
    p.add_argument("--out", required=True, help="HDF5 file to write")
    p.add_argument("--out-layout", default=None, choices=OUT_LAYOUTS,
                   help="layout of --out (default: the input's; a user's hdf5 layout is written as pdebench)")
    p.add_argument("--force", action="store_true", help="replace --out when it exists")
    return p


def run(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    # An ensemble is written one file per member, each a dataset of the input's layout.
    outs = [out] if args.members is None else [out.with_name(f"{out.stem}.member{k}{out.suffix}")
                                              for k in range(max(args.members, 0))]
    require_out(out, outs, force=args.force)
    if args.steps < 0 or args.batch_size < 1:
        raise InputError(f"--steps must be >= 0 and --batch-size >= 1, got {args.steps} and {args.batch_size}")
    surrogate = load_run(args.run, device=args.device)
    info = surrogate.task(args.task)
    frames = read_initial(args.input, info, surrogate.config.data.tasks[info.index], layout=args.layout,
                          rows=args.rows)
    dt = info.time_step if frames.time_step is None else frames.time_step
    layout = args.out_layout or (frames.desc.layout if frames.desc.layout in OUT_LAYOUTS else "pdebench")
    n, parts = len(frames.rows), []
    with tqdm(total=n, desc="predict", unit="trajectory", disable=not show_progress(True)) as bar:
        for s in range(0, n, args.batch_size):
            parts.append(surrogate.rollout(frames.u_NTCS[s:s + args.batch_size], args.steps, task=info.index,
                                           variant=args.variant, members=args.members, seed=args.seed,
                                           time_step=dt, sample_ids=frames.rows[s:s + args.batch_size]))
            bar.update(len(parts[-1]) if args.members is None else parts[-1].shape[1])
    pred = np.concatenate(parts, axis=0 if args.members is None else 1)
    attrs = {"predicted_by": "entry.predict", "run": str(Path(args.run).resolve()), "variant": args.variant,
             "given_steps": frames.u_NTCS.shape[1], "rows": frames.rows, "git_commit": commit_label()}
    for k, path in enumerate(outs):
        write_predictions(path, layout, frames, pred if args.members is None else pred[k], dt,
                          attrs | ({} if args.members is None else {"member": k}))
    print(f"predict: {n} trajectories x {args.steps} steps ({args.variant}) -> {', '.join(map(str, outs))}",
          file=sys.stderr)
    return 0


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
