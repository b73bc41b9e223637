"""The transfer measurement's report (`bench.transfer`): per training-set size N, the held-out task's
test nRMSE (one step, and over the scored rollout) of the fine-tuned and the scratch model (mean
over the seeds recorded, their count), each arm's learning-rate choice on validation, EG of each
score (`bench.transfer_gain.efficiency_gain`), whether the scratch model at the top N was flat over
its last fifth of steps, and the guard rail (each source task: the mixture model's test nRMSE over
its single-task model's, seed means where more than one seed is recorded). A plot of test nRMSE
against N (log x), fine-tuned against scratch. Reads the result store only (`bench.result_store`): it trains nothing.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.race_report import spread_cell
from bench.result_store import finished
from bench.transfer_gain import CODEC_SHARE, codec_share, efficiency_gain, flat_at_end

ARMS = ("finetuned", "scratch")
METRICS = {"one_step": "one-step nRMSE", "rollout": "rollout nRMSE"}
"""The held-out task's scores EG is computed on (eval.json's ``one_step_nrmse`` and ``nrmse``)."""


def arm_scores(store: Path, arm: str, ns: list[int], seeds: list[int], metric: str) -> dict[int, list[float]]:
    """``{N: [score of each recorded seed]}`` of ``arm`` on the held-out task (sizes without a record left out)."""
    out = {}
    for n in ns:
        found = [r for r in (finished(store, f"{arm}@{n}", s) for s in seeds) if r is not None]
        if found:
            out[n] = [r["score"][metric] for r in found]
    return out


def gains(store: Path, ns: list[int], seeds: list[int]) -> dict[str, dict]:
    """Per metric: ``{"target", "eg", "n_star", "bound"}``, EG of the fine-tuned seed means against the
    scratch model's seed mean at the top N; ``{}`` for a metric whose scores are not all recorded yet."""
    out = {}
    for metric in METRICS:
        ft = arm_scores(store, "finetuned", ns, seeds, metric)
        top = arm_scores(store, "scratch", [ns[-1]], seeds, metric)
        if len(ft) != len(ns) or not top:
            out[metric] = {}
            continue
        target = statistics.mean(top[ns[-1]])
        gain = efficiency_gain(ns, [statistics.mean(ft[n]) for n in ns], target, ns[-1])
        out[metric] = {"target": target, **gain._asdict()}
    return out


def _cell(values: list[float]) -> str:
    return spread_cell(values, digits=4, count=True)


def _eg_line(metric: str, g: dict, top: int) -> str:
    if not g:
        return f"- EG ({METRICS[metric]}): not every size recorded yet"
    if g["bound"] == "not_reached":
        return (f"- EG ({METRICS[metric]}): not reached: no fine-tuned size matched the scratch model at N = {top} "
                f"({g['target']:.4g})")
    at = "at least " if g["bound"] == "at_least" else ""
    return (f"- EG ({METRICS[metric]}): {at}{g['eg']:.3g} (N* = {g['n_star']:.3g}; target: scratch at N = {top}, "
            f"{g['target']:.4g})")


def report(store: Path, ns: list[int], seeds: list[int], head: list[str],
           guard_seeds: list[int] | None = None) -> str:
    """The Markdown report of ``store`` (module docstring); ``head``: the lines that open it (command,
    date, commit, what differs from the issue's protocol); ``guard_seeds``: the guard rail's seeds (default
    the first of ``seeds``)."""
    lines = [*head, "", "| N | " + " | ".join(f"{arm} {METRICS[m]}" for m in METRICS for arm in ARMS) + " |",
             "|---:|" + "---:|" * (2 * len(METRICS))]
    scores = {(arm, m): arm_scores(store, arm, ns, seeds, m) for arm in ARMS for m in METRICS}
    for n in ns:
        lines.append(f"| {n} | " + " | ".join(_cell(scores[(arm, m)].get(n, [])) for m in METRICS for arm in ARMS)
                     + " |")
    lines += ["", "Test nRMSE of the held-out task: mean ± std over seeds (their count).", ""]
    lines += [_eg_line(m, g, ns[-1]) for m, g in gains(store, ns, seeds).items()]
    top = finished(store, f"scratch@{ns[-1]}", seeds[0])
    if top is not None:
        lines.append(convergence_line(top, ns[-1], seeds[0]))
    lines += ["", "Learning rate of each arm, chosen on the held-out task's validation split (the rollout nRMSE "
              "of the weights each run keeps, evaluation.select):", ""]
    for arm in ARMS:
        choice = finished(store, f"{arm}@lr", seeds[0])
        if choice is not None:
            tried = ", ".join(f"{_rate(c['lr'], c.get('new_lr_scale', 1.0))}: {c['val']:.4g}"
                              for c in choice["candidates"])
            chosen = _rate(choice["chosen_lr"], choice.get("chosen_new_lr_scale", 1.0))
            lines.append(f"- {arm} at N = {choice['n']}: {chosen} (tried {tried})")
    lines += ["", *guard_rail(store, guard_seeds or seeds[:1])]
    return "\n".join(lines)


def _rate(lr: float, scale: float) -> str:
    """A candidate as the report names it: the rate, and the new parameters' scale where not 1."""
    return f"{lr:g}" if scale == 1 else f"{lr:g} (new x{scale:g})"


def convergence_line(top: dict, n: int, seed: int) -> str:
    """Whether the scratch model at the top N converged (the issue's condition: validation flat over its
    last 20% of steps): its operator's validation curve and its codec's (``codec_val_curve``; a record
    made before it was kept has none), each flat within `bench.transfer_gain.FLAT_TOLERANCE`. A codec
    still improving passes when its test reconstruction is at most `CODEC_SHARE` of the model's one-step
    error (`codec_share`): one that heads toward exact keeps falling long after it stops mattering."""
    said, meets = [], True
    # each part's curve, and the share of the error that excuses it when not flat (None: nothing does)
    parts = (("its operator", top["val_curve"], None),
             ("its codec", top.get("codec_val_curve"), codec_share(top.get("score", {}))))
    for part, curve, share in parts:
        flat = flat_at_end(curve) if curve is not None else None
        passes = flat is not None and bool(flat["flat"])
        if flat is None:
            said.append(f"{part} not recorded")
        elif flat["flat"] is None:
            said.append(f"{part} has no validation that early")
        else:
            said.append(f"{part} {'flat' if flat['flat'] else 'NOT flat'} (validation moved {flat['change']:+.1%} "
                        "over its last 20% of steps)")
        if flat is not None and not passes and share is not None:
            passes = share <= CODEC_SHARE
            said[-1] += (f", its test reconstruction {share:.1%} of the one-step error "
                         f"({'within' if passes else 'over'} the {CODEC_SHARE:.0%} that lets it pass)")
        meets = meets and passes
    return (f"- The scratch model at N = {n}, seed {seed}: {', '.join(said)}: the step budget "
            f"{'meets' if meets else 'does not meet'} the issue's convergence condition.")


def guard_rail(store: Path, seeds: list[int]) -> list[str]:
    """The guard-rail table: each source task's test nRMSE of the mixture model and of its single-task
    model (the same optimizer steps on that task) over the recorded of ``seeds`` (one seed: its value; more:
    mean ± std (count)), and the ratio of their means (below 1: the mixture is better). Empty before the
    mixture at ``seeds[0]`` (the pretraining) is recorded."""
    found = [finished(store, "pretrain", s) for s in seeds]
    if found[0] is None:
        return []
    mixes = [r for r in found if r is not None]
    lines = ["Guard rail (source tasks; the mixture trained for the sum of the single-task runs' steps; over "
             "seeds, mean ± std (count)):", "",
             "| task | metric | mixture | single-task | mixture / single |", "|---|---|---:|---:|---:|"]
    for task in mixes[0]["test"]:
        # a single-task run's one task, whatever its label there (a parameter the mixture needed to tell apart)
        alone = [next(iter(r["test"].values())) for r in (finished(store, f"single@{task}", s) for s in seeds)
                 if r is not None]
        for m, label in METRICS.items():  # a single-task run not trained yet (they come last) is said to be owed
            mixed = [r["test"][task][m] for r in mixes]
            single = [a[m] for a in alone]
            cells = "owed | owed" if not single else \
                f"{_spread(single)} | {statistics.mean(mixed) / statistics.mean(single):.3g}x"
            lines.append(f"| {task} | {label} | {_spread(mixed)} | {cells} |")
    return lines


def _spread(values: list[float]) -> str:
    """A guard-rail cell: the value of one seed, else mean ± std (count)."""
    return spread_cell(values, digits=4, count=len(values) > 1)


def write_plot(store: Path, ns: list[int], seeds: list[int], task: str, path: Path) -> Path:
    """Test nRMSE against N (log x), one panel per metric: each arm's seed mean, each seed a dot.
    Returns ``path`` (a PNG)."""
    from entry.evaluation.plots import headless_pyplot, save_figure  # matplotlib only for the report

    plt = headless_pyplot()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(10, 4.0))
    for ax, (metric, label) in zip(axes, METRICS.items()):
        for i, arm in enumerate(ARMS):
            points = arm_scores(store, arm, ns, seeds, metric)
            if not points:
                continue
            ax.plot(list(points), [statistics.mean(v) for v in points.values()], "-o", color=f"C{i}", label=arm)
            for n, v in points.items():
                ax.plot([n] * len(v), v, ".", color=f"C{i}", alpha=0.4)
        ax.set(xscale="log", xlabel="training trajectories N", ylabel=f"test {label}", title=f"{task}: {label}")
        ax.set_xticks(ns, [str(n) for n in ns])  # the measured sizes, not powers of ten
        ax.minorticks_off()
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)
