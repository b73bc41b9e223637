"""The order in which `bench.transfer` trains its runs (its module docstring, steps 1-4), up to
``--jobs`` at once: the pretraining; each arm's learning-rate sweep on validation; every size's
first-seed run; the top size's other seeds; the sizes around N*; the guard rail's single-task runs,
beside the pretraining when a job is spare, else last; then the guard rail's other seeds. Every run
trains through `bench.transfer_runs.train` and is recorded as it finishes (`bench.result_store`: a
re-run trains only what is missing). Every wait is in the calling thread, so a run never waits on another."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

from bench.result_store import finished, reuse_or_run
from bench.transfer_gain import bracket
from bench.transfer_report import ARMS, gains
from bench.transfer_runs import run_tree, train


def seed_tag(seed: int, first: int) -> str:
    """What a guard-rail run's name adds for its seed: nothing at the first seed."""
    return "" if seed == first else f"-s{seed}"


def rate_tag(scale: float) -> str:
    """What a run's name and record key add for a fine-tuned run's new_lr_scale: nothing at 1."""
    return "" if scale == 1 else f"-x{scale:g}"


def say(line: str) -> None:
    """Print ``line`` as one write, its newline included: the pool's runs announce themselves from their
    threads, and `print`'s separate write of the newline let two announcements run into one line."""
    print(line + "\n", end="", flush=True)


class Measurement:
    """One measurement's runs: ``plan`` (`bench.transfer.Plan`), the command's ``args``, the ``store``
    its records go to and the ``stamp`` each carries; ``pool`` trains up to ``args.jobs`` of them at once."""

    def __init__(self, plan, args: argparse.Namespace, store: Path, stamp: dict, pool: ThreadPoolExecutor):
        self.plan, self.args, self.store, self.stamp, self.pool = plan, args, store, stamp, pool
        self.seed0 = plan.seeds[0]
        self.pretrain: dict = {}
        self.rate_of: dict[str, tuple[float, float]] = {}

    def side_by_side(self, calls: list[Callable[[], dict]]) -> list[dict]:
        """Each of ``calls`` run in the pool; their results, in order."""
        return [f.result() for f in [self.pool.submit(call) for call in calls]]

    def run(self, key: str, seed: int, tree: dict, **more) -> dict:
        """The record of ``(key, seed)``: reused, or ``tree`` trained and recorded with ``more``."""
        say(f"transfer: {key} seed {seed}")
        return reuse_or_run(self.store, key, seed, lambda: train(tree, self.plan.folder,
                                                                 timeout_s=self.args.run_timeout_s) | more | self.stamp)

    def mixture(self, seed: int) -> Callable[[], dict]:
        """The training on the mixture at ``seed``: the pretraining at the first seed, the guard rail's at others."""
        plan = self.plan
        return partial(self.run, "pretrain", seed, run_tree(
            plan.tree, role=f"pretrain{seed_tag(seed, self.seed0)}", tasks=plan.sources(),
            weights=plan.source_weights(), budget=plan.pretrain_budget, seed=seed))

    def start_pretraining(self) -> Future:
        """The pretraining on the mixture, submitted to the pool (first: the first job takes it)."""
        return self.pool.submit(self.mixture(self.seed0))

    def guard_rail(self, seeds: list[int]) -> list[Callable[[], dict]]:
        """Each source task alone, for its share of the mixture's steps, at each of ``seeds`` (a task's
        seeds one after another); then the mixture at each of them but the first (the pretraining's)."""
        plan = self.plan
        singles = [partial(self.run, f"single@{label}", seed, run_tree(
                       plan.tree, role=f"single-{label}{seed_tag(seed, self.seed0)}", tasks=[task],
                       budget=budget, seed=seed), source_task=label)
                   for label, task, budget in zip(plan.source_labels(), plan.sources(), plan.single_budgets)
                   for seed in seeds]
        return singles + [self.mixture(seed) for seed in seeds if seed != self.seed0]

    def arm_run(self, arm: str, n: int, seed: int, lr: float, scale: float) -> dict:
        """Train ``arm`` (fine-tuned from the pretraining, or from scratch) on the held-out task's first ``n``
        trajectories; returns its record."""
        plan = self.plan
        say(f"transfer: {arm} at N = {n}, seed {seed}, lr {lr:g}{rate_tag(scale)}")
        source = self.pretrain["run_dir"] if arm == "finetuned" else ""
        tree = run_tree(plan.tree, role=f"{arm}-n{n}-s{seed}-lr{lr:g}{rate_tag(scale)}",
                        tasks=[plan.held_task(n)], budget=plan.budget, seed=seed, lr=lr, source=source,
                        freeze=plan.freeze if source else (), new_lr_scale=scale, select=plan.select,
                        new_fields=plan.new_fields)
        out = train(tree, plan.folder, timeout_s=self.args.run_timeout_s)
        (score,) = out["test"].values()  # the held-out task's, its one task
        return out | {"arm": arm, "n": n, "score": score, "new_lr_scale": scale} | self.stamp

    def choose_rates(self) -> None:
        """Both arms' sweeps at the sweep size, side by side; each arm's rate the lowest validation's."""
        plan = self.plan

        def trial(arm: str, lr: float, scale: float) -> dict:
            return reuse_or_run(self.store, f"{arm}@{plan.sweep_n}@lr{lr:g}{rate_tag(scale)}", self.seed0,
                                lambda: self.arm_run(arm, plan.sweep_n, self.seed0, lr, scale))

        tried = {arm: plan.candidates(arm) for arm in ARMS}
        done = iter(self.side_by_side([partial(trial, arm, *c) for arm in ARMS for c in tried[arm]]))
        for arm in ARMS:
            trials = [(c, next(done)) for c in tried[arm]]
            (lr, scale), _ = min(trials, key=lambda p: p[1]["val_nrmse_kept"])
            choice = reuse_or_run(self.store, f"{arm}@lr", self.seed0, lambda: {
                "arm": arm, "n": plan.sweep_n, "chosen_lr": lr, "chosen_new_lr_scale": scale,
                "candidates": [{"lr": c[0], "new_lr_scale": c[1], "val": t["val_nrmse_kept"]} for c, t in trials]}
                | self.stamp)
            self.rate_of[arm] = (choice["chosen_lr"], choice.get("chosen_new_lr_scale", 1.0))

    def one(self, arm: str, n: int, seed: int) -> dict:
        """The record of ``arm`` at size ``n`` and ``seed``, at the arm's chosen rate."""
        lr, scale = self.rate_of[arm]
        if n == self.plan.sweep_n and seed == self.seed0:  # the chosen trial is this run
            found = finished(self.store, f"{arm}@{n}@lr{lr:g}{rate_tag(scale)}", self.seed0)
            return reuse_or_run(self.store, f"{arm}@{n}", seed, lambda: found)
        return reuse_or_run(self.store, f"{arm}@{n}", seed, lambda: self.arm_run(arm, n, seed, lr, scale))

    def sizes(self) -> None:
        """Every size at the first seed, the top size at the others, then the sizes around N* at the others."""
        plan, one = self.plan, self.one
        self.side_by_side([partial(one, arm, n, self.seed0) for n in plan.ns for arm in ARMS])
        self.side_by_side([partial(one, arm, plan.ns[-1], seed) for seed in plan.seeds[1:] for arm in ARMS])
        around = sorted({n for g in gains(self.store, plan.ns, plan.seeds).values()
                         for n in bracket(plan.ns, g.get("n_star"))})
        self.side_by_side([partial(one, "finetuned", n, seed) for n in around for seed in plan.seeds[1:]])


def measure(plan, args: argparse.Namespace, store: Path, stamp: dict) -> None:
    """Train and record whatever of the measurement ``store`` lacks, up to ``args.jobs`` runs at once
    (module docstring). ``plan``: `bench.transfer.Plan`; ``stamp``: what every record carries."""
    pool = ThreadPoolExecutor(max_workers=args.jobs)
    m = Measurement(plan, args, store, stamp, pool)
    try:
        pretraining = m.start_pretraining()
        # The guard rail needs nothing else and costs as much as the pretraining: beside it when a job is
        # spare, else last, so that an interrupted measurement has its gains first.
        guarding = [pool.submit(g) for g in m.guard_rail([m.seed0])] if args.jobs > 1 else []
        m.pretrain = pretraining.result()
        m.choose_rates()
        m.sizes()
        for f in guarding:
            f.result()
        # The guard rail's other seeds last, the single-task runs before the mixtures (what a seed costs).
        m.side_by_side(m.guard_rail(plan.guard_seeds))
    finally:  # an error stops what has not started; what runs finishes and is recorded
        pool.shutdown(wait=True, cancel_futures=True)
