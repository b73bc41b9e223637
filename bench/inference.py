"""`python -m bench.inference --run RUN [--task NAME] [--batch-sizes 1,4,16,64] [--out bench/results]`:
trajectories per second of a trained run's full rollout against the batch size, eager and exported.

One rollout is what `entry.predict` does per batch: encode the last given frame, ``--steps`` operator
steps (default: the task's evaluated rollout), decode every predicted frame. Eager runs
`entry.inference.Surrogate.rollout`; exported runs the `torch.export` programs of `entry.export`
(`entry.inference.export.programs`) in the same loop, compiled with `torch.compile` on CUDA and run
as they are on CPU. The fields are random normals of the task's shape: the work does not depend on
their values. Each cell is the best of ``--rounds`` timed rollouts after one warm-up; on CUDA every
round is synchronised. Writes ``<out>/<device>-<date>-inference-<run>.{json,md}`` with the command.

Legend: B batch, T time steps, C channels, S spatial axes, L tokens, D latent dim.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import sys
import time
from pathlib import Path

import orjson
import torch

from bench.provenance import record_stamp
from entry.config.cli import exits_on_user_error
from entry.inference import load_run
from entry.inference.export import programs
from entry.storage.atomic import atomic_write_bytes


def best_seconds(run, device: torch.device, rounds: int) -> float:
    """Best wall time of `rounds` calls of `run()` after one warm-up call (synchronised on CUDA)."""
    best = math.inf
    for r in range(rounds + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if r > 0:
            best = min(best, time.perf_counter() - t0)
    return best


def exported_rollout(found: dict, u0_BCS, steps: int, dt: float, task_id: int):
    """The operator rollout of `Surrogate.rollout` through exported programs (`found`: name -> callable).
    -> the predicted frames [B, steps, C, *S]."""
    b = u0_BCS.shape[0]
    dt_B = torch.full((b,), dt, dtype=torch.float32, device=u0_BCS.device)
    id_B = torch.full((b,), task_id, dtype=torch.int64, device=u0_BCS.device)
    z, frames = found["encode"](u0_BCS), []
    for _ in range(steps):
        z = found["step"](z, dt_B, id_B)
        frames.append(z)
    u = found["decode"](torch.stack(frames, 1).flatten(0, 1))  # one decode of every frame, as decode_trajectory
    return u.unflatten(0, (b, steps))


def _table(rows: list[dict]) -> str:
    lines = ["| batch | eager traj/s | exported traj/s | exported / eager |", "| ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['eager_traj_per_s']:.1f} | {r['exported_traj_per_s']:.1f} | "
                     f"{r['exported_traj_per_s'] / r['eager_traj_per_s']:.2f} |")
    return "\n".join(lines)


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a trained run folder")
    p.add_argument("--task", default=None, help="the run's task (default: its first time-dependent one)")
    p.add_argument("--steps", type=int, default=0, help="operator steps (0: the task's evaluated rollout)")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--note", default="", help="what the machine was doing (written with the numbers)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    s = load_run(args.run, device=device)
    info = s.task(args.task) if args.task else next(t for t in s.tasks if not t.steady)
    task = s.config.data.tasks[info.index]
    steps = args.steps or len(range(0, task.nt, info.frame_stride)) - info.given_steps
    found = {k: v.module() for k, v in programs(s, info).items()}
    if device.type == "cuda":
        found = {k: torch.compile(v) for k, v in found.items()}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        u0 = torch.randn(b, 1, len(info.channels), *info.grid, generator=gen).to(device)
        with torch.no_grad():
            eager = best_seconds(lambda: s.rollout(u0, steps, task=info.index), device, args.rounds)
            exported = best_seconds(lambda: exported_rollout(found, u0[:, 0], steps, info.time_step, info.index),
                                     device, args.rounds)
        rows.append({"batch": b, "eager_s": eager, "exported_s": exported, "eager_traj_per_s": b / eager,
                     "exported_traj_per_s": b / exported})
        print(f"batch {b}: eager {b / eager:.1f} traj/s, exported {b / exported:.1f} traj/s", flush=True)
    today = datetime.date.today().isoformat()
    stamp = record_stamp(device)
    where = stamp["device"]
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    command = f"{threads}python -m bench.inference {shlex.join(argv if argv is not None else sys.argv[1:])}"
    record = {"command": command, "date": today, **stamp, "note": args.note, "run": str(args.run),
              "task": info.name, "steps": steps, "grid": list(info.grid), "channels": list(info.channels),
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{where}-{today}-inference-{Path(args.run).name}"
    atomic_write_bytes(stem.with_suffix(".json"), orjson.dumps(record, option=orjson.OPT_INDENT_2))
    md = (f"# Inference throughput: {Path(args.run).name}, task {info.name}\n\n"
          f"{args.note}\n\n```\n{command}\n```\n\n({today}, {where}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads.) A full rollout of {steps} operator steps from one frame on a {list(info.grid)} grid "
          f"of {len(info.channels)} channel(s), decoding included; best of {args.rounds} after a warm-up.\n\n"
          f"{_table(rows)}\n")
    atomic_write_bytes(stem.with_suffix(".md"), md.encode())
    print(f"wrote {stem}.json and .md")
    return 0


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
