"""The race's report (`bench.race`): Markdown tables and a plot of the results a race recorded.

Per rung and model: test nRMSE over predicted steps (mean ± std over seeds, n), its ratio to the
best peer's mean with its spread (the two stds propagated), training time (in the store's
machine-seconds: `bench.machine_budget`), the recipe it trained with (`bench.race_recipes`: chosen
at that rung or the sweep rung below); a line naming each rung where ours is not below the best
peer; the machine's speed before each record's training (`bench.machine_speed`: whether they shared
one clock), a line on the records whose budgets were scaled to another machine and one on those
that got more than 1.2x less or more work a second than their model's records at the lowest rung
(`unequal_work`); a line when records came from a dirty tree (``--allow-dirty``); the training
time to each validation target (`bench.budget.TARGETS`, "not reached" when no seed reached it); a
log-log plot of test nRMSE against the budget. Reads the result store only (`bench.result_store`):
it trains nothing.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from bench.budget import TARGETS
from bench.machine_budget import store_seconds
from bench.machine_speed import DRIFT, RECORD_KEYS, speed_note
from bench.result_store import finished

PUBLISHED_SETTINGS = {
    "ns2d": "The FNO paper's 0.0128 (FNO-2D, nu 1e-3, T = 50) is vorticity alone at 64 x 64 with 1000 training "
            "trajectories; the race scores the mean of 3 fields (vorticity and both velocity components) stored at "
            "32 x 32 from a 64 x 64 solve, with the training trajectories its config gives (208 of 256 in "
            "configs/reduced/ns2d.yaml): its vorticity column is the comparable one, at a coarser grid and less data.",
}
"""Per task name: how the race's setting differs from the published number a reader compares it
with, printed under the task's per-field table."""

PUBLISHED_FIELD = {"ns2d": "vorticity"}
"""Per task name: the field its published number scores (`PUBLISHED_SETTINGS`), which the summary
across tasks (`bench.race_summary`) shows beside the mean over fields."""

OURS_NOTE = "cosine annealed to the budget (or to its step cap, a multiple of a probe's estimate, if that runs out first)"
"""Ours' schedule in a race (`bench.race`), recorded with each of its results and named under the report."""


def is_ours(model: str) -> bool:
    """Whether a race's model is ours or an ablation of ours (``ours-NAME``): not a peer."""
    return model == "ours" or model.startswith("ours-")


def spread_cell(values: list[float], *, digits: int = 3, count: bool = False) -> str:
    """A table cell of seeds' scores: "—" for none, the value for one, "mean ± std" for more (to
    ``digits`` significant digits; with ``count``, the number of seeds after it)."""
    n = f" ({len(values)})" if count and values else ""
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.{digits}g}{n}"
    return f"{statistics.mean(values):.{digits}g} ± {statistics.stdev(values):.2g}{n}"



def recorded(store: Path, grid: list[tuple[float, str, list[int]]]) -> dict[tuple[float, str], tuple[list, list]]:
    """``{(rung, model): (scored results, skipped results)}`` of ``grid`` in ``store``, in grid order;
    seeds not recorded yet are left out."""
    out = {}
    for rung, model, seeds in grid:
        found = [r for r in (finished(store, f"{model}@{rung:g}", s) for s in seeds) if r is not None]
        out[(rung, model)] = ([r for r in found if "skipped" not in r], [r for r in found if "skipped" in r])
    return out


def best_peer(scores: dict[str, list[float]]) -> str | None:
    """The peer (not `is_ours`) of lowest mean among ``{model: seeds' scores}`` with a score, or None."""
    return min((m for m, v in scores.items() if v and not is_ours(m)), key=lambda m: statistics.mean(scores[m]),
               default=None)


def ratio_of(scores: list[float], best: list[float]) -> tuple[float, float | None]:
    """``(mean(scores) / mean(best), its spread)``: each side's std over its mean, in quadrature, times
    the ratio; None where neither side has two seeds."""
    ratio = statistics.mean(scores) / statistics.mean(best)
    rel = [statistics.stdev(v) / statistics.mean(v) for v in (scores, best) if len(v) > 1]
    return ratio, (ratio * sum(x * x for x in rel) ** 0.5 if rel else None)


def ratio_cell(scores: list[float], best: list[float]) -> str:
    """`ratio_of` as a table cell: "1.63x ± 0.34", "1.63x" without a spread, "—" without scores."""
    if not scores or not best:
        return "—"
    ratio, spread = ratio_of(scores, best)
    return f"{ratio:.2f}x" if spread is None else f"{ratio:.2f}x ± {spread:.2f}"


def _recipes(rs: list[dict]) -> str:
    """The recipes a rung's records trained with (older records: their rate and loss)."""
    names = {r["recipe_key"] if "recipe_key" in r else f"lr={r['lr']:.3g}" + (f" ({r['loss']})" if "loss" in r else "")
             for r in rs if "recipe_key" in r or "lr" in r}
    return ", ".join(sorted(names)) or "—"


def per_field(results: dict[tuple[float, str], tuple[list, list]], channels: tuple[str, ...], task: str) -> str:
    """The table of each field's test nRMSE over the predicted steps (mean ± std over the seeds) per
    rung and model, from each record's ``test.nrmse_per_channel`` (in ``channels``' order), and the
    task's `PUBLISHED_SETTINGS` note; "" for a task of one field."""
    if len(channels) < 2:
        return ""
    rows = []
    for (rung, model), (scored, _) in results.items():
        per = [r["test"]["nrmse_per_channel"] for r in scored if "nrmse_per_channel" in r.get("test", {})]
        rows.append(f"| {rung:g} | {model} | " + " | ".join(spread_cell([p[c] for p in per]) for c in range(len(channels)))
                    + " |")
    note = PUBLISHED_SETTINGS.get(task, "")
    return ("\n\n## Test nRMSE per field\n\n| rung | model | " + " | ".join(channels) + " |\n|---|---|"
            + "---|" * len(channels) + "\n" + "\n".join(rows) + (f"\n\n{note}" if note else ""))


def _steps_per_store_second(record: dict) -> float | None:
    """The updates a race record made per second of the store's machine (`store_seconds`), or None
    without steps or seconds. Ours' record says the steps its stage ran (``steps_run``; ``steps`` is
    its schedule's cap) and each stage's seconds (``stage_seconds``, the trained stage last): its
    rate is over that stage's seconds alone, since its ``train_s`` also holds the probe and the codec,
    a share of the budget that shrinks as the budget grows. A peer's ``steps`` ran in its ``train_s``."""
    if "steps_run" in record and record.get("stage_seconds"):
        steps, seconds = record["steps_run"], list(record["stage_seconds"].values())[-1]
    else:
        steps, seconds = record.get("steps"), record.get("train_s")
    return steps / store_seconds(record, seconds) if steps and seconds else None


def _work_shape(record: dict) -> str:
    """What sets a record's cost per step: its recipe's key without its learning rate (the model and
    loss, batch and options), or "" for a record without one."""
    return re.sub(r":lr=[^:]*", "", record.get("recipe_key", ""))


def unequal_work(results: dict[tuple[float, str], tuple[list, list]]) -> list[str]:
    """``model@rung seed s: ratio`` for each record (`recorded`'s ``results``) whose steps per second
    of the store's machine (`store_seconds`) are more than `DRIFT` times below or above the median of
    its model's records of the same work shape (`_work_shape`) at the lowest rung that has them: its
    budget was set for another speed than the one it trained at, so it got less (or more) work than
    the records it is compared with. Records without steps or a recipe key are not judged; ours' rate
    is its trained stage's (`_steps_per_store_second`)."""
    rates: dict[tuple[str, str], dict[float, list[float]]] = {}
    judged = []
    for (rung, model), (scored, _) in results.items():
        for r in scored:
            if (rate := _steps_per_store_second(r)) and (shape := _work_shape(r)):
                rates.setdefault((model, shape), {}).setdefault(rung, []).append(rate)
                judged.append((rung, model, r["seed"], shape, rate))
    off = []
    for rung, model, seed, shape, rate in judged:
        lowest = min(rates[(model, shape)])
        ratio = rate / statistics.median(rates[(model, shape)][lowest])
        if rung > lowest and not 1 / DRIFT <= ratio <= DRIFT:
            off.append(f"{model}@{rung:g} seed {seed}: {ratio:.2f}")
    return off


def _record_notes(results: dict[tuple[float, str], tuple[list, list]]) -> str:
    """The report's lines on the records themselves (`recorded`'s ``results``): each ablation's
    overrides, the machine's speed per reference workload, the records whose budgets were scaled to
    another machine, those written from a dirty tree."""
    ablated = {r["model"]: r["ablation"] for scored, _ in results.values() for r in scored if "ablation" in r}
    text = "".join(f"\n{m}: ours with {' '.join(o)}, at ours' rate." for m, o in ablated.items())
    for key, workload in RECORD_KEYS.items():  # one note per reference workload the records timed
        speeds: dict[str, list[float]] = {}
        for (_, model), (scored, _) in results.items():
            speeds.setdefault(model, []).extend(r[key] for r in scored if key in r)
        text += f"\n\n{note}" if (note := speed_note(speeds, workload)) else ""
    scaled = [r["machine_factor"] for scored, _ in results.values() for r in scored if r.get("machine_factor", 1) != 1]
    if scaled:
        text += (f"\n\n{len(scaled)} record(s) trained on a machine that ran their model {min(scaled):.2f}x to "
                 f"{max(scaled):.2f}x as long a step as the store's first machine: their wall-clock budgets were scaled "
                 "by it, and their train s and times to targets are in the store's machine-seconds "
                 "(`bench.machine_budget`).")
    if off := unequal_work(results):
        text += (f"\n\n{len(off)} record(s) trained more than {DRIFT:g}x fewer or more steps per second of the store's "
                 "machine than their model's records of the same loss and batch at the lowest rung (their share of "
                 "that rate): " + "; ".join(off) + ". Their budgets were set for another speed than they trained at.")
    dirty = sum(bool(r.get("dirty")) for scored, skipped in results.values() for r in scored + skipped)
    if dirty:
        text += (f"\n\n**{dirty} record(s) were written from a work tree with uncommitted changes (--allow-dirty): "
                 "development numbers, not results.**")
    return text


def report(store: Path, grid: list[tuple[float, str, list[int]]], base_s: float, task: str,
           channels: tuple[str, ...] = ()) -> str:
    """Markdown tables of the recorded results for ``grid`` [(rung, model, seeds)]: test nRMSE
    (mean ± std, n, over the best peer's mean with its spread), training time, recipe; where ours is
    not the best; time to each target (mean over the seeds that reached it, with their count; "not
    reached" when none did, "—" when no seed is recorded yet); with the task's ``channels`` (two or
    more), each field's test nRMSE (`per_field`)."""
    rows, ttt, notes, behind = [], [], [], []
    by_rung: dict[float, dict[str, list[dict]]] = {}
    results = recorded(store, grid)
    for (rung, model), (scored, skipped) in results.items():
        by_rung.setdefault(rung, {})[model] = scored
        notes += [f"{model}@{rung:g} seed {r['seed']}: {r['skipped']}" for r in skipped]
    for rung, models in by_rung.items():
        by_model = {m: [r["test_nrmse"] for r in rs] for m, rs in models.items()}
        best_name = best_peer(by_model)
        best = by_model[best_name] if best_name else []
        for model, rs in models.items():
            scores = [r["test_nrmse"] for r in rs]
            over = sum(not r.get("within_budget", True) for r in rs)
            rows.append(f"| {rung:g} | {base_s * rung:g} | {model} | {spread_cell(scores)} | {len(rs)} | "
                        f"{ratio_cell(scores, best)} | {spread_cell([store_seconds(r, r['train_s']) for r in rs])}"
                        f"{f' ({over} over)' if over else ''} | {_recipes(rs)} |")
            if model == "ours" and scores and best and statistics.mean(scores) >= statistics.mean(best):
                behind.append(f"{rung:g} ({base_s * rung:g} s): ours {spread_cell(scores)} against {best_name} "
                              f"{spread_cell(best)}")
            reached = []
            for t in TARGETS:
                times = [store_seconds(r, r["time_to_targets"][f"{t:g}"]) for r in rs
                         if r["time_to_targets"][f"{t:g}"] is not None]
                reached.append(f"{statistics.mean(times):.3g} s ({len(times)}/{len(rs)})" if times else
                               "not reached" if rs else "—")  # no seed recorded yet: nothing to say
            ttt.append(f"| {rung:g} | {model} | " + " | ".join(reached) + " |")
    head = (f"## Race on {task}: test nRMSE over predicted steps against the training budget (base {base_s:g} s)\n\n"
            "| rung | budget s | model | test nRMSE (mean ± std) | n | / best peer | train s | recipe |\n"
            "|---|---|---|---|---|---|---|---|")
    targets = " | ".join(f"{t:g}" for t in TARGETS)
    text = "\n".join([head, *rows]) + per_field(results, channels, task)
    text += "\n".join(["", "", "## Training seconds to a validation nRMSE target", "",
                       f"| rung | model | {targets} |", "|---|---|" + "---|" * len(TARGETS), *ttt])
    if any(model == "ours" for _, model, _ in grid):
        text += f"\n\nours: {OURS_NOTE} (a probe's seconds per step); its train s counts the codec and cache stages."
        text += ("\nWhere ours is not the best: " + "; ".join(behind) + "." if behind else
                 "\nOurs is below the best peer's mean at every rung recorded.")
    text += _record_notes(results)
    return text + "".join(f"\n- {n}" for n in notes)


def write_plot(store: Path, grid: list[tuple[float, str, list[int]]], base_s: float, task: str, path: Path) -> Path:
    """Test nRMSE against the training budget per model (log-log): the mean over the rung's seeds
    with their std as bars, each seed as a dot. Returns ``path`` (a PNG)."""
    from entry.evaluation.plots import headless_pyplot, save_figure  # matplotlib only for the report

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
    return save_figure(fig, path, dpi=110)
