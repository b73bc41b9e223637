# long file: one benchmark: the solver on each grid, the surrogate's point beside it and the record, which change
# together
"""The numerical solver as a peer: its accuracy and cost per trajectory at several resolutions, on
the test trajectories a surrogate is scored on, by the same metric code, beside the surrogate's.

    python -m bench.solver_pareto --config configs/reduced/ns2d.yaml [--run runs/ns2d]
        [--resolutions 8,16,32,64,128] [--trajectories 16] [--rounds 2] [--out bench/results] [--allow-dirty]

For Burgers and each generated 2D flow of the config (tasks our own solvers made):

- the rows the evaluation scores (`entry.evaluation.task_frames.require_scored_rows`), at most
  ``--trajectories`` of them, the same frames (its time stride and window, `scored_steps`);
- each started from the frame the surrogate starts from (the last given one) on the stored grid:
  the information the surrogate has, no finer. It is prolonged to the solve grid (Fourier
  interpolation on the spectral solver's nodes, bilinear on the finite-volume cells, linear on
  Burgers' periodic points, which the evaluation reads every ``reduce_x``-th of), solved by
  our solver with its own CFL-limited step over the stored times, and brought back to the stored
  grid (the solver's own restriction above it, the same interpolation below);
- scored by `core.evaluation.MetricSums`, the sums every variant's evaluation uses, over the same
  predicted frames (the given frames copied, as for the surrogate);
- timed: wall seconds per trajectory of solving the batch together, the best of ``--rounds``, on
  this process's threads.

With ``--run`` (a finished run of the same config) the surrogate is set beside it: its eval.json
nRMSE of the variant and its rollout time per trajectory at the same batch
(`entry.inference.Surrogate.rollout`, decoding included, as a user runs it). The speedup is the
solver's time at the surrogate's error (log-log interpolation between the solver's points) over the
surrogate's time; none where the surrogate's error lies outside the solver's range.
Writes ``<out>/<device>-<date>-solver-pareto-<task>.{json,png}``, the command in the json. Like the
race and the transfer, it refuses a work tree with uncommitted changes outside bench/results/
(``--allow-dirty`` for development: its records say ``"dirty": true``).
"""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import torch
import torch.nn.functional as F

from bench.provenance import record_stamp, refuse_dirty
from core.evaluation import MetricSums
from entry.config.cli import exits_on_user_error
from entry.config.load import ConfigError, load_config
from entry.config.schema import Config
from entry.data.files import data_inputs, task_key, task_path
from entry.evaluation.task_frames import require_scored_rows, scored_steps, task_label
from entry.storage.atomic import atomic_write_bytes
from pipelines.flows import FLOWS, FlowSpec
from pipelines.task_data import open_task, read_trajectories

__all__ = ["SolverPoint", "solver_points", "solve_from", "speedup_at", "speedup_bound", "main"]

BATCH = 16
"""Trajectories solved (and rolled out) together, as `bench.solver_time` and `bench.accuracy` time them."""


@dataclass(frozen=True)
class SolverPoint:
    """The solver at one resolution: its score and its cost."""

    resolution: int
    nrmse: float
    """`MetricSums`' nRMSE over the predicted frames (channels averaged), as eval.json's."""
    seconds_per_trajectory: float
    rounds_s: tuple[float, ...]


def _spectral_resample(w_BXY: torch.Tensor, n: int) -> torch.Tensor:
    """A periodic field on an n x n node grid with the same Fourier modes up to the coarser grid's
    Nyquist (zero-padded or truncated; the Nyquist row and column dropped, as a real field needs)."""
    m = w_BXY.shape[-1]
    if n == m:
        return w_BXY
    keep = min(m, n) // 2
    c = torch.fft.fft2(w_BXY)
    out = torch.zeros((*w_BXY.shape[:-2], n, n), dtype=c.dtype, device=c.device)
    rows = [*range(keep), *range(-keep + 1, 0)]
    idx = torch.tensor(rows, device=c.device)
    out[..., idx[:, None] % n, idx[None, :] % n] = c[..., idx[:, None] % m, idx[None, :] % m]
    return torch.fft.ifft2(out).real * (n / m) ** 2


def _cells_resample(u_BCXY: torch.Tensor, n: int) -> torch.Tensor:
    """Cell values on n x n equal cells of the same square, bilinear at the cell centres."""
    if u_BCXY.shape[-1] == n:
        return u_BCXY
    return F.interpolate(u_BCXY, size=(n, n), mode="bilinear", align_corners=False)


def solve_from(flow: FlowSpec, start_BCXY: torch.Tensor, times: np.ndarray, resolution: int,
               params: dict[str, float]) -> torch.Tensor:
    """Our solver of `flow` from the stored frame `start_BCXY` (float64, the stored grid S), on a
    `resolution` grid, over `times` (``times[0] = 0``: the start). -> [B, T, C, S, S] float64 on the
    stored grid, frame 0 the solver's own start (the prolonged and restricted frame)."""
    from pipelines.solvers import ns2d

    solve = flow.solve_function()  # the flow's solver, its forcing bound
    s = start_BCXY.shape[-1]
    stored = min(resolution, s)  # the solver restricts to the stored grid when it is finer
    if flow.navier_stokes:  # the state is the vorticity (channel 0); the velocities follow from it
        w0 = _spectral_resample(start_BCXY[:, 0], resolution)
        # nu alone of its parameters, no spin-up: the start is a stored frame
        out = solve(w0, times, nu=params["nu"], stored_resolution=stored, out_dtype=torch.float64)
        out = out.permute(0, 1, 4, 2, 3)
        if stored < s:
            b, t = out.shape[:2]
            w = _spectral_resample(out[:, :, 0].reshape(b * t, stored, stored), s)
            ux, uy = ns2d.velocity_from_vorticity(w, length=flow.domain[1] - flow.domain[0])
            out = torch.stack([w, ux, uy], 1).reshape(b, t, 3, s, s)
        return out
    start = _cells_resample(start_BCXY, resolution)
    if flow.name == "swe2d":  # state (h, hu, hv); stored (h, u, v)
        h = start[:, 0]
        out = solve(h, times, stored_resolution=stored, momentum0=start[:, 1:3] * h[:, None],
                    out_dtype=torch.float64, **params)
    else:  # the reaction-diffusion flows: the state is the stored fields
        out = solve(start.permute(0, 2, 3, 1), times, stored_resolution=stored, out_dtype=torch.float64, **params)
    out = out.permute(0, 1, 4, 2, 3)
    if stored < s:
        b, t = out.shape[:2]
        out = _cells_resample(out.flatten(0, 1), s).unflatten(0, (b, t))
    return out


def _periodic_points(u_BTX: torch.Tensor, n: int) -> torch.Tensor:
    """Point values on a periodic uniform grid of n points, node-aligned with the X given (point 0
    stays at point 0): every (X / n)-th point when coarser, linear interpolation when finer."""
    x = u_BTX.shape[-1]
    if n == x:
        return u_BTX
    if n < x:
        return u_BTX[..., :: x // n]
    pos = torch.arange(n, dtype=torch.float64) * (x / n)
    left = pos.floor().long()
    w = (pos - left).to(u_BTX.dtype)
    return u_BTX[..., left % x] * (1 - w) + u_BTX[..., (left + 1) % x] * w


def solve_burgers_from(start_BX: torch.Tensor, times: np.ndarray, resolution: int, nu: float) -> torch.Tensor:
    """Our Burgers solver from the scored frame `start_BX` (point values on the periodic grid the
    evaluation reads, X points), on `resolution` points, over `times`. -> [B, T, 1, X] float64."""
    from pipelines.solvers.burgers import solve_burgers

    x = start_BX.shape[-1]
    out = solve_burgers(_periodic_points(start_BX, resolution), nu, times, length=1.0, out_dtype=np.float64)
    return _periodic_points(out, x)[:, :, None]


def _scored_frames(cfg: Config, i: int, trajectories: int):
    """Task i's first `trajectories` scored trajectories [N, T, C, *S] (float64), their times [T] and
    the given steps, exactly as the evaluation reads them (`scored_steps`)."""
    task = cfg.data.tasks[i]
    rows, stored = require_scored_rows(cfg, i)
    g, stride, steps = scored_steps(cfg, i, stored)
    with open_task(task_path(cfg, task), task.spec) as reader:  # as the evaluation reads it
        data = read_trajectories(reader, rows[:trajectories], reduce_x=task.reduce_x, reduce_t=task.reduce_t)
    u = torch.from_numpy(np.ascontiguousarray(data.u[:, ::stride][:, :steps])).to(torch.float64)
    return u, data.t[::stride][:steps], g


def solver_points(cfg: Config, i: int, resolutions: list[int], *, trajectories: int = BATCH,
                  rounds: int = 2) -> list[SolverPoint]:
    """The solver's score and cost at each of `resolutions` on task i's scored trajectories (see
    the module's docstring). A `ConfigError` when no solver of ours generated the task."""
    task = cfg.data.tasks[i]
    if task.layout or not (task.name == "burgers1d" or (task.name in FLOWS and task.reduce_x == 1)):
        raise ConfigError(f"data.tasks[{i}] ({task.name}): not a task our solver generated (burgers1d, or a 2D "
                          f"flow on its stored grid: {', '.join(FLOWS)}, reduce_x 1)")
    u, times, g = _scored_frames(cfg, i, trajectories)
    start, span = u[:, g - 1], times[g - 1:] - times[g - 1]
    if task.name == "burgers1d":
        solve = lambda r: solve_burgers_from(start[:, 0], span, r, task.param)  # noqa: E731
    else:
        flow = FLOWS[task.name]
        params = {**flow.params, flow.task.param_name: task.param}
        solve = lambda r: solve_from(flow, start, span, r, params)  # noqa: E731
    points = []
    for r in resolutions:
        seconds, pred = [], None
        for _ in range(rounds):
            t0 = time.perf_counter()
            pred = solve(r)
            seconds.append((time.perf_counter() - t0) / u.shape[0])
        full = torch.cat([u[:, :g], pred[:, 1:]], 1)  # the given frames copied, as for every model
        sums = MetricSums.zeros(u.shape[2], u.shape[1], g, False, torch.device("cpu"))
        sums.add(full.transpose(1, 2), u.transpose(1, 2), None)
        points.append(SolverPoint(r, float(sums.summary()["nrmse"]), min(seconds), tuple(seconds)))
    return points


def speedup_at(points: list[SolverPoint], nrmse: float, seconds: float) -> float | None:
    """The solver's seconds per trajectory at error `nrmse` (log-log interpolation between its two
    points that bracket it) over `seconds`; None when no two points bracket it."""
    pts = sorted((p.nrmse, p.seconds_per_trajectory) for p in points if p.nrmse > 0)
    for (e0, s0), (e1, s1) in zip(pts, pts[1:]):
        if e0 <= nrmse <= e1:
            w = 0.0 if e1 == e0 else (math.log(nrmse) - math.log(e0)) / (math.log(e1) - math.log(e0))
            return math.exp((1 - w) * math.log(s0) + w * math.log(s1)) / seconds
    return None


def speedup_bound(points: list[SolverPoint], nrmse: float, seconds: float) -> tuple[str, float] | None:
    """Where no two solver points bracket error `nrmse` (`speedup_at` is None): ``("at most", r)``
    when the surrogate is less accurate than every point, r the cheapest point's seconds per
    trajectory over `seconds` (a coarser solve, cheaper still, might match it); ``("at least", r)``
    when it is more accurate than every point, r the costliest point's (the solver would need a finer
    grid, costlier still). None where a bracket exists or there are no points."""
    pts = [p for p in points if p.nrmse > 0]
    if not pts or speedup_at(pts, nrmse, seconds) is not None:
        return None
    if nrmse > max(p.nrmse for p in pts):
        return "at most", min(p.seconds_per_trajectory for p in pts) / seconds
    return "at least", max(p.seconds_per_trajectory for p in pts) / seconds


def surrogate_point(run_dir: Path, cfg: Config, i: int, variant: str, trajectories: int, rounds: int) -> dict:
    """The surrogate's eval.json nRMSE of `variant` on task i and its rollout seconds per trajectory
    over the same frames at a batch of `trajectories` (decoding included)."""
    from bench.inference import best_seconds
    from entry.inference import load_run

    label = task_label(cfg, i)  # the task's key in eval.json
    scores = orjson.loads((run_dir / "eval.json").read_bytes())["tasks"].get(label, {}).get("variants", {})
    if variant not in scores:
        raise ConfigError(f"{run_dir}/eval.json has no variant {variant!r} for {label}; "
                          f"evaluate the run first (python -m entry.evaluate --config CFG)")
    surrogate = load_run(run_dir)
    u, _, g = _scored_frames(cfg, i, trajectories)
    given, steps = u[:, :g].to(torch.float32), u.shape[1] - g
    with torch.no_grad():
        best = best_seconds(lambda: surrogate.rollout(given, steps, task=i, variant=variant), surrogate.device,
                            rounds)
    return {"variant": variant, "nrmse": float(scores[variant]["nrmse"]),
            "seconds_per_trajectory": best / u.shape[0], "run": str(run_dir)}


def grid_label(resolution: int, dims: int) -> str:
    """A solve grid as the text says it: ``64`` points in 1D, ``64^2`` in 2D."""
    return f"{resolution}^{dims}" if dims > 1 else str(resolution)


def _plot(path: Path, task: str, points: list[SolverPoint], surrogate: dict | None, dims: int) -> None:
    from entry.evaluation.plots import headless_pyplot, save_figure

    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    ax.plot([p.seconds_per_trajectory for p in points], [p.nrmse for p in points], "o-", label="our solver")
    for p in points:
        ax.annotate(grid_label(p.resolution, dims), (p.seconds_per_trajectory, p.nrmse), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
    if surrogate is not None:
        ax.plot([surrogate["seconds_per_trajectory"]], [surrogate["nrmse"]], "s",
                label=f"surrogate ({surrogate['variant']})")
    ax.set(xscale="log", yscale="log", xlabel="seconds per trajectory", ylabel="test nRMSE",
           title=f"{task}: error against cost")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    save_figure(fig, path, dpi=100)


def run(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--run", default=None, help="a finished, evaluated run of the config: the surrogate's point")
    p.add_argument("--variant", default="operator")
    p.add_argument("--resolutions", default="", help="solve grids, comma-separated (default: stored/4 .. generated)")
    p.add_argument("--trajectories", type=int, default=BATCH)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--note", default="", help="what the machine was doing (written with the numbers)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--allow-dirty", action="store_true", help="measure from a work tree with uncommitted changes "
                   "(a development run: its records say dirty)")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    refuse_dirty(args.allow_dirty, "bench.solver_pareto")
    today = datetime.date.today().isoformat()
    stamp = record_stamp(torch.device("cpu"))
    where = stamp["device"]
    command = f"python -m bench.solver_pareto {shlex.join(argv if argv is not None else sys.argv[1:])}"
    prints = data_inputs(cfg)  # every task file's fingerprint, read once
    for i, task in enumerate(cfg.data.tasks):
        if task.layout or task.name not in (*FLOWS, "burgers1d"):
            print(f"{task.name}: not generated by a solver of ours; skipped")
            continue
        scored = task.nx // task.reduce_x  # the grid the evaluation scores
        dims = task.spec.spatial_dims
        generated = task.nx if task.name == "burgers1d" else task.resolution or FLOWS[task.name].resolution
        resolutions = ([int(x) for x in args.resolutions.split(",")] if args.resolutions else
                       [r for r in (scored * 2**k // 4 for k in range(8)) if 4 <= r <= generated])
        points = solver_points(cfg, i, resolutions, trajectories=args.trajectories, rounds=args.rounds)
        for pt in points:
            print(f"{task.name}: solver at {grid_label(pt.resolution, dims)}: nRMSE {pt.nrmse:.4g}, "
                  f"{1e3 * pt.seconds_per_trajectory:.1f} ms per trajectory")
        surrogate = None
        if args.run:
            surrogate = surrogate_point(Path(args.run), cfg, i, args.variant, args.trajectories, args.rounds)
            surrogate["speedup_at_solver_accuracy"] = speedup_at(points, surrogate["nrmse"],
                                                                 surrogate["seconds_per_trajectory"])
            bound = speedup_bound(points, surrogate["nrmse"], surrogate["seconds_per_trajectory"])
            surrogate["speedup_bound"] = None if bound is None else {"kind": bound[0], "value": bound[1]}
            exact = surrogate["speedup_at_solver_accuracy"]
            said = (f"{bound[0]} {bound[1]:.3g} (outside the solver's range)" if bound is not None else
                    "none (no solver point scored)" if exact is None else f"{exact:.3g}")
            print(f"{task.name}: surrogate {surrogate['variant']}: nRMSE {surrogate['nrmse']:.4g}, "
                  f"{1e3 * surrogate['seconds_per_trajectory']:.1f} ms per trajectory; speedup at the solver's "
                  f"accuracy: {said}")
        record = {"command": command, "date": today, **stamp, "note": args.note, "task": task.name,
                  "data_fingerprint": prints[task_key(cfg, i)],
                  "scored_grid": scored, "generated_at": generated, "trajectories": args.trajectories,
                  "solver": [vars(pt) | {"rounds_s": list(pt.rounds_s)} for pt in points], "surrogate": surrogate}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"{where}-{today}-solver-pareto-{task.name}"
        atomic_write_bytes(stem.with_suffix(".json"), orjson.dumps(record, option=orjson.OPT_INDENT_2))
        _plot(stem.with_suffix(".png"), task.name, points, surrogate, dims)
        print(f"wrote {stem}.json and .png")
    return 0


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
