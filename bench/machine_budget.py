"""A race's budgets in seconds of the machine that started it, so that a race of days that outlives
one machine still gives every model the same work at a rung (issue 51).

A race's records are written over many sessions, and a session's machine is not always the last
one's: advection's 4B rung (bench/results/race-advection1d.jsonl) ran partly on a machine whose
reference workload (`bench.machine_speed`) took 0.82-1.47 ms and partly on one taking 0.31-0.36 ms.
Nor does one workload scale every model alike: the plain transformer's one-step trials at 240 s
took ~3,440 steps on the first and 5,850-6,740 on the second, 1.8x more where the reference ran
2.8x faster. So each model is its own yardstick: its training step is timed (`peer_step_seconds`,
`ours_step_seconds`: the median step over `CALIBRATION_S` seconds of training on a fixed batch
stream, off every clock) when the store starts (recorded as ``<model>@calibration``) and again
before each of its trials, which gets ``budget * now / then`` wall seconds (`machine_factor`); "now"
is the median of every timing of the model in the race's process (`machine_clock`). A store whose
calibration caught a spell is re-anchored once to the median of its trials' timings (`reanchor`). A
record keeps its wall seconds and its factor; the report divides by it (`store_seconds`). Every
process of a race runs under one allocator policy (`ALLOCATOR`): under glibc's default a model's step
time depended on what its process had run before, by up to 2x.

Until 2026-12-01 a step was the fastest of 7 and a factor within 1.2x of 1 counted as 1. On a
machine that switched between two speeds that gave the same run two budgets: the plain
transformer's 240 s Burgers trials all ran at 16-19 updates a second, but 6 of 15 timed a fast
spell (within 1.2x: 240 s) and 9 the slow one (1.47-1.55x: 344-372 s). A median over seconds
follows the speed a trial trains at, and a factor without a dead band has no cliff. Calibrations
recorded before then are fastest steps (their record has no ``step_statistic``); a median step is
longer than the fastest, so later trials on those stores get their share of the store's work and
up to the store's first machine's median over fastest more, not less (on the machine of 2026-12-01
that ratio was 1.03-1.53x: `bench/results/cpu-2core-2026-12-01-step-statistic.md`); the report's
`unequal_work` line names a record that got more than 1.2x off.

Each model's step on this machine, in the order given (one process: what ran before counts), under
the race's allocator policy or glibc's default:

    python -m bench.machine_budget --config configs/reduced/darcy.yaml --models fno,unet,fno [--policy race|default]

Legend: N trajectories, T time steps, C channels, S spatial axes.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import sys
import warnings
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import torch
from torch import nn

from bench.accuracy_scores import TaskFields
from bench.budget import train_budgeted
from bench.race_train import batch_stream, peer_loss
from bench.result_store import finished, record, records, reuse_or_run
from entry.config.cli import exits_on_user_error, parse_config
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.distributed.process_group import DistInfo, close_distributed, init_distributed
from entry.training.estimate import stage_step_seconds

ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": (-3, 32 * 2**20), "MALLOC_TRIM_THRESHOLD_": (-1, 2**30),
             "MALLOC_TOP_PAD_": (-2, 512 * 2**20)}
"""glibc malloc's policy for a race's processes: environment variable -> (its ``mallopt`` parameter,
value): blocks up to 32 MiB (glibc's largest threshold) from the heap rather than fresh mmaps, 1 GiB
of free heap kept before it is returned, the heap grown 512 MiB at a time. Setting any of them turns
off glibc's default, a threshold that rises as the process frees large blocks, under which a model's
step depended on what the process ran before it: the FNO's step on Darcy took 0.23 s first in a
process, 0.18 s after the U-Net and 0.12 s later on; 0.11-0.12 s wherever it ran under this policy
(`bench/results/cpu-2core-2026-11-28-race-allocator.md`)."""
CALIBRATION_S = 3.0
"""Seconds of training a step is timed over: long enough that a fast or slow spell of a second
does not set a trial's budget, short beside a trial (60 s and up), and paid off every clock."""
CALIBRATION_MAX_STEPS = 400
"""At most this many steps in a timing (a step of a few milliseconds fills `CALIBRATION_S` with more
than a median needs)."""
STEP_STATISTIC = "median"
"""What a timing records: the median of its steps (a record without ``step_statistic``: the fastest)."""
FIRST_TIMINGS = 3
"""Timings a model's step gets the first time a process (or a store) needs it; each later trial
adds one, and a trial's step is the median of all of them (`machine_clock`)."""
CALIBRATION_BATCH = 16
"""The batch a peer's calibration trains on: the races' batch."""
CALIBRATION_LR = 1e-4


ALLOCATOR_ENV = {name: str(value) for name, (_, value) in ALLOCATOR.items()}
"""The environment that starts a child process (ours' pipeline) under the `ALLOCATOR` policy
(glibc reads it at start; other C libraries ignore it)."""


def fix_allocator() -> dict[str, str]:
    """Put this process's malloc under the `ALLOCATOR` policy (glibc's ``mallopt``). Returns the
    policy as `ALLOCATOR_ENV` writes it, for the records; {} where the C library is not glibc (the
    platform's own policy then holds)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    for parameter, value in ALLOCATOR.values():
        if mallopt(ctypes.c_int(parameter), ctypes.c_int(value)) != 1:
            raise RuntimeError(f"glibc refused mallopt({parameter}, {value})")
    return dict(ALLOCATOR_ENV)


def machine_factor(now_s: float, store_s: float) -> float:
    """Wall seconds per second of the store's machine for a model whose step takes ``now_s`` here
    and took ``store_s`` when the store started: their ratio (no dead band: a factor near 1 is
    kept, so that two trials on one machine never fall on either side of a cliff). Both must be
    positive and finite."""
    if not (now_s > 0 and store_s > 0 and math.isfinite(now_s) and math.isfinite(store_s)):
        raise ValueError(f"step seconds must be positive and finite: now {now_s}, store {store_s}")
    return now_s / store_s


def step_intervals(ends: list[float]) -> list[float]:
    """The seconds of each step between consecutive step ends ``ends`` (seconds of training,
    ascending): each interval is one whole step, the first step (allocator, kernels) not among them.
    Needs at least two ends."""
    if len(ends) < 2:
        raise ValueError(f"a step time needs two step ends or more, got {len(ends)}")
    return [b - a for a, b in pairwise(ends)]


def median_step_seconds(ends: list[float]) -> float:
    """The median of `step_intervals` of ``ends``."""
    return statistics.median(step_intervals(ends))


def peer_step_ends(net: nn.Module, f: TaskFields, device: torch.device) -> list[float]:
    """The training seconds at which each of a peer's training steps on ``f``'s training split
    ended (batches of `CALIBRATION_BATCH` from a fixed seed, the one-step loss, or a steady task's
    single step), trained by the product's budgeted loop for `CALIBRATION_S` seconds (at least 3
    steps, at most `CALIBRATION_MAX_STEPS`). ``net`` is a throwaway instance (its weights change):
    build the trial's own afterwards."""
    batches = batch_stream(f.train, CALIBRATION_BATCH, device, generator=torch.Generator().manual_seed(0))
    loss = peer_loss("rollout" if f.steady else "one_step", f.given, seed=0)

    def step_ends(budget_s: float, max_steps: int) -> list[float]:
        ends: list[float] = []
        with warnings.catch_warnings():  # a timing's last step past its window costs nothing
            warnings.filterwarnings("ignore", message="training took", category=UserWarning)
            train_budgeted(net.to(device), batches, loss, budget_s, CALIBRATION_LR, max_steps=max_steps, seed=0,
                           on_step=lambda step, train_s, lr, value: ends.append(train_s))
        return ends

    ends = step_ends(CALIBRATION_S, CALIBRATION_MAX_STEPS)
    if len(ends) < 3:  # a step longer than the window: three steps, however long
        ends = step_ends(math.inf, 3)
    return ends


def peer_step_seconds(net: nn.Module, f: TaskFields, device: torch.device) -> float:
    """A peer's step on this machine now: the median of `peer_step_ends`' steps."""
    return median_step_seconds(peer_step_ends(net, f, device))


def ours_step_seconds(cfg: Config, stage: str, info: DistInfo) -> float:
    """The median of our ``stage``'s training steps over `CALIBRATION_S` seconds on random batches of
    its training shapes, as the dry-run estimate times them (`entry.training.estimate.stage_step_seconds`)."""
    return statistics.median(stage_step_seconds(cfg, stage, info, probe_s=CALIBRATION_S,
                                                max_steps=CALIBRATION_MAX_STEPS))


REANCHOR_MIN_TIMINGS = 5
"""Trial timings a model needs in a store before its store step may be re-anchored to their median
(each taken before its own trial, minutes to hours apart: ours' six on the ns2d store spanned
0.066-0.079 s where single timings of the FNO's ranged 0.084-0.132 s)."""


def trial_timings(store: Path, model: str) -> list[float]:
    """The step timings (``step_calibration_s``, medians: `STEP_STATISTIC`) that ``model``'s trials
    recorded in ``store``, one per trial (a sweep rung's seed-0 record repeats its chosen trial)."""
    seen = {(p["step_calibration_s"], p.get("wall_budget_s")) for r in records(store)
            if r["model"].split("@")[0] == model and (p := r.get("payload") or {}).get("step_statistic") == STEP_STATISTIC
            and "step_calibration_s" in p}
    return sorted(t for t, _ in seen)


def reanchor(store: Path, models: list[str], stamp: dict) -> dict[str, tuple[float, float]]:
    """Re-anchor each of ``models``' store step (its ``<model>@calibration``, appended anew: the
    latest is read) to the median of its `trial_timings` in ``store``. For a store whose calibration
    was one timing that caught a fast or slow spell: on the ns2d race the FNO's was 0.137 s, its
    trials' timings had a median near 0.10 s (0.104 s over 24, 0.103 s over the 14 at 120 s that
    the re-anchor read), and its trials had got a median 0.76 of their budgets. Use
    it only while the store's records ran on one machine (their `bench.machine_speed` workload
    alike); records keep the factor they trained at. Returns {model: (old step, new step)};
    raises ConfigError, before anything is written, for a model with fewer than
    `REANCHOR_MIN_TIMINGS` timings or no calibration."""
    found = {m: (finished(store, f"{m}@calibration", 0), trial_timings(store, m)) for m in models}
    short = [f"{m} ({len(t)})" for m, (c, t) in found.items() if c is None or len(t) < REANCHOR_MIN_TIMINGS]
    if short:
        raise ConfigError(f"--reanchor-clock needs a calibration and {REANCHOR_MIN_TIMINGS} trial timings of each "
                          f"model in {store}; too few for {', '.join(short)}: race without it")
    out = {}
    for m, (calibration, timings) in found.items():
        new = statistics.median(timings)
        record(store, f"{m}@calibration", 0, {"step_s": new, "step_statistic": STEP_STATISTIC,
                                               "reanchored_from_trials": len(timings),
                                               "replaces_step_s": calibration["step_s"]} | stamp)
        out[m] = (calibration["step_s"], new)
    return out


def machine_clock(store: Path, models: list[str], step_seconds: Callable[[str], float], stamp: dict
                  ) -> Callable[[str, float], dict]:
    """``(model, budget_s) -> the trial's budget on this machine`` for a race whose ``store`` starts
    (or started) on the machine its ``<model>@calibration`` records were made on: each of
    ``models`` timed by ``step_seconds`` and recorded with ``stamp`` the first time, read back after.
    The budget is ``{budget_s, wall_budget_s, machine_factor, step_calibration_s, step_statistic,
    step_timings, store_step_calibration_s}``.

    A model's step here is the median of every timing of it in this process (`FIRST_TIMINGS` the
    first time, one more before each trial), and a new store's is the median of `FIRST_TIMINGS`: one
    process runs on one machine, and one 3 s timing is not its speed. On the 2-core machine of the
    ns2d race single timings of the FNO's step before its trials ran 0.075-0.148 s while the trials
    themselves trained at 7.5-8.6 steps a wall-second (`docs/benchmarks.md`), so a budget set from one
    timing gave same-model trials 0.55-1.08x of their rung's seconds."""
    def timed(m: str, n: int) -> list[float]:
        return [step_seconds(m) for _ in range(n)]

    calibrations = {m: reuse_or_run(store, f"{m}@calibration", 0, lambda m=m: {
        "step_s": statistics.median(timed(m, FIRST_TIMINGS)), "step_statistic": STEP_STATISTIC,
        "timings": FIRST_TIMINGS} | stamp)["step_s"] for m in models}
    timings: dict[str, list[float]] = {}

    def clock(model: str, budget_s: float) -> dict:
        timings[model] = timings.get(model, []) + timed(model, 1 if model in timings else FIRST_TIMINGS)
        now = statistics.median(timings[model])
        factor = machine_factor(now, calibrations[model])
        return {"budget_s": budget_s, "wall_budget_s": budget_s * factor, "machine_factor": factor,
                "step_calibration_s": now, "step_statistic": STEP_STATISTIC, "step_timings": len(timings[model]),
                "store_step_calibration_s": calibrations[model]}

    return clock


def store_seconds(record: dict, wall_s: float) -> float:
    """``wall_s`` of a race record in seconds of the store's machine: divided by the record's
    ``machine_factor`` (1 for records that predate it)."""
    return wall_s / record.get("machine_factor", 1.0)


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", required=True, help="peers of bench.race and ours, comma-separated, in the order to time")
    p.add_argument("--policy", choices=("race", "default"), default="race",
                   help="the race's allocator policy (ALLOCATOR) or the C library's default")
    p.add_argument("--repeats", type=int, default=3, help="calibrations of each model in a row")
    p.add_argument("--task-index", type=int, default=0)


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    """Print each of ``--models``' step seconds (``--repeats`` timings in a row, each its median and
    fastest step) in the order given, in this one process, under ``--policy``; returns the exit code
    (2: a user error)."""
    cfg, args = parse_config(argv, __doc__, _args)
    from bench.accuracy_scores import load_task_fields  # the data only once the arguments hold
    from bench.race import PEERS, ours_stage, stage_params

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m != "ours" and m not in PEERS]
    if unknown or args.repeats < 1:
        raise ConfigError(f"--models: unknown {unknown} (choose from ours, {', '.join(PEERS)}); --repeats >= 1")
    policy = fix_allocator() if args.policy == "race" else {}
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s)
    try:
        f = load_task_fields(cfg, args.task_index)
        stage = ours_stage(f.steady)
        target = stage_params(cfg, stage)  # the plain transformer's size, as the race sizes it
        print(f"allocator: {policy or 'the C library default'}")
        for m in models:
            timings = [stage_step_seconds(cfg, stage, info, probe_s=CALIBRATION_S, max_steps=CALIBRATION_MAX_STEPS)
                       if m == "ours" else
                       step_intervals(peer_step_ends(PEERS[m](f, 0, target), f, info.device))
                       for _ in range(args.repeats)]
            print(f"{m}: " + "; ".join(f"{statistics.median(t) * 1e3:.1f} (fastest {min(t) * 1e3:.1f} of {len(t)} steps)"
                                       for t in timings) + f" ms a step ({STEP_STATISTIC}, fastest)", flush=True)
        return 0
    finally:
        close_distributed()


if __name__ == "__main__":
    sys.exit(main())
