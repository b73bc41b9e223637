"""How much of a generated flow's next stored frame its current stored frame leaves open.

A reaction-diffusion flow of ours (diffusion-reaction, Allen-Cahn: `pipelines.solvers.dr2d`) is solved on a grid
finer than the one stored, and the stored frame is the mean over blocks of cells. A surrogate sees only the stored
frame, so the cells' deviations from their block's mean (the sub-grid part) are unknown to it, and where they steer
the next stored frame no model can predict it. Diffusion-reaction starts from a standard normal per cell: at 16 x 16
stored from 32 x 32, three quarters of the start's variance is sub-grid.

For the evaluation window of each test trajectory (``data.split``'s test rows, the given frames plus
``evaluation.rollout_steps``; the task's own seed, so the file's trajectories), this solves the flow at its full
grid again and scores, per predicted frame, one step ahead from the true stored frame (`core.metrics.nrmse_per_step`,
the evaluation's one-step nRMSE, averaged over the fields):

- **persistence**: the stored frame itself;
- **coarse solver**: the same solver on the stored grid;
- **oracle**: the PDE solved exactly from the stored frame with the sub-grid part of another test trajectory at the
  same time (``--members`` of them, a new pairing each), the mean of their next stored frames; and one member alone.
  At the start the cells are independent normals, so a block's mean and its deviations are independent: there the
  borrowed sub-grid part is a draw from its true conditional law, and ``oracle_limit`` (the mean over infinitely
  many members, extrapolated from the mean of M and one member: e_M^2 = e^2 + s^2 / M) is the error of the best
  predictor that sees one stored frame (up to the mean over trajectories of ratios). Later the sub-grid part depends
  on the stored field, the borrowed one no longer follows it, and the oracle is only an upper bound.

The same scores of the rollout (``rollout``: every frame predicted from the start alone, the stored frame 0, as the
evaluation's rollout of one given frame predicts them): there every oracle member borrows the start's sub-grid part,
so ``oracle_limit`` is at every lead the error of the best predictor given the start, a floor of the rollout's nRMSE.

    python -m bench.subgrid_floor --config configs/reduced/transfer_dr2d_held_out.yaml [--members 16]
        [--out bench/results/subgrid-floor-<date>-<task>.json]
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

import numpy as np
import torch

from bench.provenance import record_stamp
from core.metrics import nrmse_per_step
from entry.config.base import ConfigError
from entry.config.cli import exits_on_user_error, parse_config
from entry.config.load import config_to_dict
from pipelines.flows import FLOWS, solve_chunk
from pipelines.split import split_indices

__all__ = ["fine_trajectories", "frame_scores", "main"]


def _block_mean(f_BXYC: torch.Tensor, r: int) -> torch.Tensor:
    b, x, y, c = f_BXYC.shape
    return f_BXYC.reshape(b, x // r, r, y // r, r, c).mean(dim=(2, 4))


def _spread(c_BXYC: torch.Tensor, r: int) -> torch.Tensor:
    return c_BXYC.repeat_interleave(r, dim=1).repeat_interleave(r, dim=2)


def _score(pred_BXYC: torch.Tensor, true_BXYC: torch.Tensor) -> float:
    """One frame's nRMSE as the evaluation's one-step score: mean over the batch, then the fields."""
    as_BCTXY = (lambda t: t.permute(0, 3, 1, 2).unsqueeze(2))
    return nrmse_per_step(as_BCTXY(pred_BXYC), as_BCTXY(true_BXYC)).mean().item()


def fine_trajectories(task, count: int, seed: int) -> torch.Tensor:
    """The first `count` trajectories of `task`'s generated file (`seed`: its root seed, `Config.data.task_seed`)
    on the solve's grid, float64 [B, T, X, Y, C]: their block means are the file's frames."""
    flow = FLOWS[task.name]
    fine_n = task.resolution or flow.resolution
    _, fine = solve_chunk(flow, 0, count, resolution=fine_n, stored=fine_n, steps=task.nt,
                          t_end=task.t_end or flow.task.t_end, seed=seed,
                          params={**flow.params, flow.task.param_name: task.param})
    return torch.from_numpy(fine).to(torch.float64)


def _score_leads(now: torch.Tensor, sub_grid: torch.Tensor, truths: list[torch.Tensor], advance, r: int,
                 rng: np.random.Generator, members: int) -> list[dict]:
    """The scores of predicting the stored frames `truths` (lead 1, 2, ...) from the stored frame `now`, whose
    fine grid's sub-grid part is `sub_grid` ([B, X, Y, C] each); `advance(state, leads)` -> the states after each
    lead, [B, leads, X, Y, C]."""
    leads = len(truths)
    coarse = advance(now, leads)
    # Each member borrows trajectory (i + k) mod B's sub-grid part: never its own, k a new offset each.
    ens = torch.stack([_block_mean(advance(_spread(now, r) + sub_grid.roll(int(k), dims=0), leads).flatten(0, 1),
                                   r).unflatten(0, (len(now), leads))
                       for k in rng.choice(np.arange(1, len(now)), size=members, replace=False)])
    rows = []
    for j, true in enumerate(truths):
        mean_err = _score(ens[:, :, j].mean(0), true)
        member_err = float(np.mean([_score(e[:, j], true) for e in ens]))
        limit_sq = (members * mean_err ** 2 - member_err ** 2) / (members - 1)
        rows.append({"persistence": _score(now, true), "coarse_solver": _score(coarse[:, j], true),
                     "oracle_member": member_err, "oracle_mean": mean_err,
                     "oracle_limit": float(np.sqrt(max(limit_sq, 0.0)))})
    return rows


def frame_scores(task, fine_BTXYC: torch.Tensor, *, frames: int, members: int, rollout: bool = False,
                 seed: int = 0) -> list[dict]:
    """Per predicted frame t = 1 .. frames - 1 of `task`'s trajectories `fine_BTXYC` (`fine_trajectories`):
    {"frame", "persistence", "coarse_solver", "oracle_member", "oracle_mean", "oracle_limit"} (the module's
    docstring) of predicting it one step ahead from frame t - 1, or with `rollout` from frame 0 (t steps ahead: the
    rollout's scores); `seed` draws the oracle's pairings."""
    flow = FLOWS[task.name]
    r = (task.resolution or flow.resolution) // task.nx
    params = {**flow.params, flow.task.param_name: task.param}
    dt_out = (task.t_end or flow.task.t_end) / (task.nt - 1)
    solve = flow.solve_function()

    def advance(state_BXYC: torch.Tensor, leads: int) -> torch.Tensor:
        return solve(state_BXYC, dt_out * np.arange(leads + 1), out_dtype=torch.float64, **params)[:, 1:]

    rng = np.random.default_rng(seed)
    stored = [_block_mean(fine_BTXYC[:, u], r) for u in range(frames)]  # each stored frame once, start and truth
    rows = []
    for t in [0] if rollout else range(frames - 1):
        upto = frames if rollout else t + 2
        rows += _score_leads(stored[t], fine_BTXYC[:, t] - _spread(stored[t], r), stored[t + 1:upto], advance, r,
                             rng, members)
    return [{"frame": i + 1, **row} for i, row in enumerate(rows)]


def _extra(parser) -> None:
    parser.add_argument("--task", type=int, default=0, help="index in data.tasks (default 0)")
    parser.add_argument("--members", type=int, default=16, help="sub-grid draws of the oracle (>= 2)")
    parser.add_argument("--out", type=Path, help="the JSON written (default bench/results/subgrid-floor-<date>-<task>)")


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _extra)
    if not 0 <= args.task < len(cfg.data.tasks):
        raise ConfigError(f"--task {args.task}: the config has {len(cfg.data.tasks)} tasks; give an index below it")
    task = cfg.data.tasks[args.task]
    flow = FLOWS.get(task.name)
    if task.layout or flow is None or flow.module != "pipelines.solvers.dr2d":
        raise ConfigError(f"--task {args.task} ({task.name}) is not a reaction-diffusion flow of ours "
                          "(pipelines.solvers.dr2d: dr2d, allen_cahn2d); give one of those")
    s = cfg.data.split
    test = len(split_indices(task.samples, test_fraction=s.test_fraction, val_fraction=s.val_fraction).test)
    if not 2 <= args.members < test:
        raise ConfigError(f"--members {args.members}: the oracle needs 2 to {test - 1} (the other test trajectories)")
    frames = min(task.nt, task.initial_step + cfg.evaluation.rollout_steps) if cfg.evaluation.rollout_steps else task.nt
    keys = ("persistence", "coarse_solver", "oracle_member", "oracle_mean", "oracle_limit")
    fine_BTXYC = fine_trajectories(task, test, cfg.data.task_seed(args.task))  # solved once, scored both ways
    scored = {}
    for name, rollout in (("one_step", False), ("rollout", True)):
        rows = frame_scores(task, fine_BTXYC, frames=frames, members=args.members, rollout=rollout)
        scored[name] = {"frames": rows, "mean_over_frames": {k: float(np.mean([row[k] for row in rows])) for k in keys}}
    date = dt.date.today().isoformat()
    out = args.out or Path(f"bench/results/subgrid-floor-{date}-{task.name}.json")
    record = {"command": "python -m bench.subgrid_floor " + " ".join(argv or sys.argv[1:]), "date": date,
              **record_stamp(torch.device("cpu")), "task": config_to_dict(task),
              "task_seed": cfg.data.task_seed(args.task),
              "solved": task.resolution or flow.resolution, "test_trajectories": test, "members": args.members,
              **scored}
    out.write_text(json.dumps(record, indent=1) + "\n")
    for name, got in scored.items():
        for row in got["frames"] + [{"frame": "mean", **got["mean_over_frames"]}]:
            print(f"{name}, frame {row['frame']}: " + ", ".join(f"{k} {row[k]:.4f}" for k in keys))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
