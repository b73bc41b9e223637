"""The race's report (`bench.race`): Markdown tables and a plot of the results a race recorded.

Per rung and model: test nRMSE over predicted steps (mean ± std over seeds, n), its ratio to the
best peer's mean, training time, learning rate; the training time to each validation target
(`bench.budget.TARGETS`, "not reached" when no seed reached it); a log-log plot of test nRMSE
against the budget. Reads the result store only (`bench.result_store`): it trains nothing.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.budget import TARGETS
from bench.result_store import finished

OURS_NOTE = "cosine annealed to the budget (or to its step cap, a multiple of a probe's estimate, if that runs out first)"
"""Ours' schedule in a race (`bench.race`), recorded with each of its results and named under the report."""


def is_ours(model: str) -> bool:
    """Whether a race's model is ours or an ablation of ours (``ours-NAME``): not a peer."""
    return model == "ours" or model.startswith("ours-")


def _cell(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{statistics.mean(values):.3g} ± {statistics.stdev(values):.2g}"


def recorded(store: Path, grid: list[tuple[float, str, list[int]]]) -> dict[tuple[float, str], tuple[list, list]]:
    """``{(rung, model): (scored results, skipped results)}`` of ``grid`` in ``store``, in grid order;
    seeds not recorded yet are left out."""
    out = {}
    for rung, model, seeds in grid:
        found = [r for r in (finished(store, f"{model}@{rung:g}", s) for s in seeds) if r is not None]
        out[(rung, model)] = ([r for r in found if "skipped" not in r], [r for r in found if "skipped" in r])
    return out


def report(store: Path, grid: list[tuple[float, str, list[int]]], base_s: float, task: str) -> str:
    """Markdown tables of the recorded results for ``grid`` [(rung, model, seeds)]: test nRMSE
    (mean ± std, n, over the best peer's mean), training time, learning rate; time to each target
    (mean over the seeds that reached it, with their count; "not reached" when none did, "—" when no
    seed is recorded yet)."""
    rows, ttt, notes = [], [], []
    by_rung: dict[float, dict[str, list[dict]]] = {}
    results = recorded(store, grid)
    for (rung, model), (scored, skipped) in results.items():
        by_rung.setdefault(rung, {})[model] = scored
        notes += [f"{model}@{rung:g} seed {r['seed']}: {r['skipped']}" for r in skipped]
    for rung, models in by_rung.items():
        peers = [statistics.mean(r["test_nrmse"] for r in rs) for m, rs in models.items() if not is_ours(m) and rs]
        best = min(peers, default=None)
        for model, rs in models.items():
            scores = [r["test_nrmse"] for r in rs]
            ratio = f"{statistics.mean(scores) / best:.2f}x" if scores and best else "—"
            over = sum(not r.get("within_budget", True) for r in rs)
            lr = ", ".join(sorted({f"{r['lr']:.3g}" + (f" ({r['loss']})" if "loss" in r else "") for r in rs})) or "—"
            rows.append(f"| {rung:g} | {base_s * rung:g} | {model} | {_cell(scores)} | {len(rs)} | {ratio} | "
                        f"{_cell([r['train_s'] for r in rs])}{f' ({over} over)' if over else ''} | {lr} |")
            reached = []
            for t in TARGETS:
                times = [r["time_to_targets"][f"{t:g}"] for r in rs if r["time_to_targets"][f"{t:g}"] is not None]
                reached.append(f"{statistics.mean(times):.3g} s ({len(times)}/{len(rs)})" if times else
                               "not reached" if rs else "—")  # no seed recorded yet: nothing to say
            ttt.append(f"| {rung:g} | {model} | " + " | ".join(reached) + " |")
    head = (f"## Race on {task}: test nRMSE over predicted steps against the training budget (base {base_s:g} s)\n\n"
            "| rung | budget s | model | test nRMSE (mean ± std) | n | / best peer | train s | lr |\n"
            "|---|---|---|---|---|---|---|---|")
    targets = " | ".join(f"{t:g}" for t in TARGETS)
    text = "\n".join([head, *rows, "", "## Training seconds to a validation nRMSE target", "",
                      f"| rung | model | {targets} |", "|---|---|" + "---|" * len(TARGETS), *ttt])
    if any(model == "ours" for _, model, _ in grid):
        text += f"\n\nours: {OURS_NOTE} (a probe's seconds per step); its train s counts the codec and cache stages."
    ablated = {r["model"]: r["ablation"] for scored, _ in results.values() for r in scored if "ablation" in r}
    text += "".join(f"\n{m}: ours with {' '.join(o)}, at ours' rate." for m, o in ablated.items())
    return text + "".join(f"\n- {n}" for n in notes)


def write_plot(store: Path, grid: list[tuple[float, str, list[int]]], base_s: float, task: str, path: Path) -> Path:
    """Test nRMSE against the training budget per model (log-log): the mean over the rung's seeds
    with their std as bars, each seed as a dot. Returns ``path`` (a PNG)."""
    from entry.evaluation.plots import headless_pyplot  # matplotlib only for the report

    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4.0))
    results = recorded(store, grid)
    for i, model in enumerate(dict.fromkeys(m for _, m, _ in grid)):
        points = [(base_s * rung, [r["test_nrmse"] for r in scored])
                  for (rung, m), (scored, _) in results.items() if m == model and scored]
        if not points:
            continue
        x = [b for b, _ in points]
        mean = [statistics.mean(v) for _, v in points]
        std = [statistics.stdev(v) if len(v) > 1 else 0.0 for _, v in points]
        ax.errorbar(x, mean, yerr=std, fmt="-o", color=f"C{i}", capsize=3, label=model)
        for b, v in points:
            ax.plot([b] * len(v), v, ".", color=f"C{i}", alpha=0.4)
    ax.set(xscale="log", yscale="log", xlabel="training budget (s, validation off the clock)",
           ylabel="test nRMSE over predicted steps", title=f"race on {task}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
