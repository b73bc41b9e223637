"""`python -m bench.race_summary [STORE.jsonl ...] [--write PAGE | --check PAGE]`: the race across tasks in one table.

Reads the race's result stores (`bench.race`; default: every ``bench/results/race-*.jsonl``) and
prints one Markdown table: per task and rung, ours' test nRMSE over the predicted steps (mean ± std
over its seeds), the best peer, ours over the best peer's mean (with the spread of both), and every
peer's mean ± std; for a task whose published number scores one field (`PUBLISHED_FIELD`), a row of
that field alone beside the mean over fields. Under it: where ours is behind, every model whose mean
rose from one rung to the next by more than its seed spread (issue 51's first acceptance line), and
the cells with fewer seeds than the task's fullest. README's race section is this output, between
two marker lines (`BEGIN`, `END`): ``--write PAGE`` puts it there, ``--check PAGE`` exits 1 when
what is there differs (tests/test_race_summary.py runs the check on README.md, so README cannot
drift from the records). Trains nothing.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

from bench.race_report import PUBLISHED_FIELD, best_peer, is_ours, ratio_cell, ratio_of, spread_cell
from bench.result_store import records
from pipelines.tasks import get_task

RESULTS = Path(__file__).resolve().parent / "results"
SCORED = re.compile(r"(?P<model>[\w-]+)@(?P<rung>[0-9.]+)")
"""A scored record's name: ``model@rung`` (the race's recipe sweeps and calibrations carry more)."""

Scores = dict[tuple[float, str], list[dict]]
"""``{(rung, model): [payload per seed]}`` of one store, by rung, its models in the store's order."""


def default_stores() -> list[Path]:
    """Every race store under bench/results/, by file name."""
    return sorted(RESULTS.glob("race-*.jsonl"))


def scored(store: Path) -> tuple[str, dict[float, float], Scores]:
    """``(task, {rung: budget_s}, scores)`` of a race store: the latest scored record per model, rung
    and seed (ours and the peers; ablations of ours and skipped trials left out). ValueError for a
    store without one."""
    latest: dict[tuple[float, str, int], dict] = {}
    for r in records(store):
        m = SCORED.fullmatch(str(r.get("model")))
        p = r.get("payload", {})
        if m and "test_nrmse" in p and (m["model"] == "ours" or not is_ours(m["model"])):
            latest[(float(m["rung"]), m["model"], r["seed"])] = p
    if not latest:
        raise ValueError(f"{store} holds no scored race record: name a bench/results/race-*.jsonl file")
    scores: Scores = {}
    for (rung, model, _), p in sorted(latest.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        scores.setdefault((rung, model), []).append(p)
    task = next(iter(latest.values()))["task"]
    budgets = {rung: p["budget_s"] for (rung, _, _), p in latest.items()}
    return task, budgets, scores


def field_scores(payloads: list[dict], channel: int | None) -> list[float]:
    """Each seed's test nRMSE: the mean over fields (``channel`` None) or field ``channel`` alone."""
    if channel is None:
        return [p["test_nrmse"] for p in payloads]
    return [p["test"]["nrmse_per_channel"][channel] for p in payloads if "nrmse_per_channel" in p.get("test", {})]


def rises(scores: Scores) -> list[str]:
    """``model r1 → r2: mean a → b (spread s)`` for every model whose mean test nRMSE rises from one
    rung to the next it was scored at by more than its seed spread (the larger std of the two rungs;
    0 for one seed): a model that got worse with more budget, a sign the race was unfair to it."""
    by_model: dict[str, list[tuple[float, list[float]]]] = {}
    for (rung, model), payloads in sorted(scores.items()):
        by_model.setdefault(model, []).append((rung, field_scores(payloads, None)))
    out = []
    for model, rungs in by_model.items():
        for (r1, a), (r2, b) in zip(rungs, rungs[1:]):
            spread = max(statistics.stdev(v) if len(v) > 1 else 0.0 for v in (a, b))
            if statistics.mean(b) - statistics.mean(a) > spread:
                out.append(f"{model} {r1:g} → {r2:g}: {statistics.mean(a):.3g} → {statistics.mean(b):.3g} "
                           f"(spread {spread:.2g})")
    return out


class Row(NamedTuple):
    """One row of the summary: its table line, where it stands ("ns2d at 120 s"), ours over the best
    peer (`ratio_of`; None where either is unscored) and, on a row of the mean over fields, the models
    with fewer seeds than the task's fullest cell (``model n of full``)."""
    line: str
    where: str
    ratio: tuple[float, float | None] | None
    short: list[str]


def _rows(task: str, budgets: dict[float, float], scores: Scores, peers: list[str], channel: int | None,
          label: str) -> list[Row]:
    """A task's rows for one score (``channel``: `field_scores`), one per rung."""
    full = max(len(v) for v in scores.values())
    rows = []
    for rung in sorted(budgets):
        cell = {m: field_scores(scores.get((rung, m), []), channel) for m in ["ours", *peers]}
        best = best_peer(cell)
        shown = {m: spread_cell(v) + (f" ({len(v)})" if 0 < len(v) < full else "") for m, v in cell.items()}
        if best:
            shown[best] = f"**{shown[best]}**"
        where = f"{label} at {budgets[rung]:g} s"
        ratio = ratio_cell(cell["ours"], cell[best]) if best else "—"
        line = (f"| {label} | {budgets[rung]:g} s | {shown['ours']} | {best or '—'} | {ratio} | "
                + " | ".join(shown[m] for m in peers) + " |")
        rows.append(Row(line, where, ratio_of(cell["ours"], cell[best]) if best and cell["ours"] else None,
                        [f"{m} {len(v)} of {full}" for m, v in cell.items() if len(v) < full and channel is None]))
    return rows


def _verdict(rows: list[Row]) -> str:
    """Where ours stands against the best peer over the rows: behind everywhere, or the rows where it
    is not; the rows where the gap is within its spread (`ratio_of`) named."""
    judged = [r for r in rows if r.ratio is not None]
    ahead = [r.where for r in judged if r.ratio[0] < 1]
    level = [f"{r.where} ({r.ratio[0]:.2f}x ± {r.ratio[1]:.2f})" for r in judged
             if r.ratio[0] >= 1 and r.ratio[1] is not None and r.ratio[0] - r.ratio[1] <= 1]
    text = (f"Ours is behind the best peer on every row ({len(judged)})" if not ahead else
            f"Ours is below the best peer's mean at {', '.join(ahead)}, and behind on the other "
            f"{len(judged) - len(ahead)} rows")
    return text + (f"; within the spread of level at {', '.join(level)}." if level else ".")


def summary(stores: list[Path]) -> str:
    """The Markdown table of every store (`scored`) and its lines: where ours stands against the best
    peer (`_verdict`), the models whose mean rose with the budget beyond their spread (`rises`), the
    seeds still owed."""
    tasks = [scored(s) for s in stores]
    peers = list(dict.fromkeys(m for _, _, scores in tasks for _, m in scores if m != "ours"))
    rows, rose = [], []
    for task, budgets, scores in tasks:
        rows += _rows(task, budgets, scores, peers, None, task)
        if field := PUBLISHED_FIELD.get(task):
            channel = get_task(task).channels.index(field)
            rows += _rows(task, budgets, scores, peers, channel, f"{task}, {field} alone")
        rose += [f"{task}: {line}" for line in rises(scores)]
    owed = [f"{r.where}: {', '.join(r.short)}" for r in rows if r.short]
    head = ("| task | budget | ours | best peer | ours / best peer | " + " | ".join(peers) + " |\n"
            "|---|---|---|---|---|" + "---|" * len(peers))
    lines = [head, *(r.line for r in rows), "", _verdict(rows)]
    lines.append("A model whose mean rose from one rung to the next by more than its seed spread: "
                 + "; ".join(rose) + "." if rose else
                 "No model's mean rises from one rung to the next by more than its seed spread.")
    if owed:
        lines.append("Seeds still owed: " + "; ".join(owed) + ".")
    return "\n".join(lines) + "\n"


BEGIN = "<!-- bench.race_summary: begin (python -m bench.race_summary --write README.md) -->"
END = "<!-- bench.race_summary: end -->"
"""The markers around the summary in a page (README.md): `--write` replaces what lies between them,
`--check` compares it."""


def between_markers(text: str) -> tuple[str, str, str] | None:
    """``(before, summary, after)`` of a page around `BEGIN` and `END` (each on its own line), or None
    when it lacks either."""
    head, sep, rest = text.partition(BEGIN + "\n")
    inner, sep2, tail = rest.partition(END)
    return (head + sep, inner, sep2 + tail) if sep and sep2 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.race_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("stores", nargs="*", type=Path, help="race stores (default: bench/results/race-*.jsonl)")
    act = p.add_mutually_exclusive_group()
    act.add_argument("--write", type=Path, help="put the summary between the markers of this page (README.md)")
    act.add_argument("--check", type=Path, help="exit 1 unless this page's markers hold the summary of the stores")
    args = p.parse_args(argv)
    for store in args.stores:
        if not store.is_file():
            p.error(f"no race store at {store}: name a bench/results/race-*.jsonl file")
    page = args.write or args.check
    parts = between_markers(page.read_text()) if page else None
    if page and parts is None:
        p.error(f"{page} lacks the lines {BEGIN!r} and {END!r}: put them where the summary goes")
    try:
        text = summary(args.stores or default_stores())
    except ValueError as e:
        p.error(str(e))
    if args.check:
        if parts[1] != text:
            print(f"bench.race_summary: {page}'s race summary differs from the stores' "
                  f"(python -m bench.race_summary --write {page})", file=sys.stderr)
            return 1
    elif args.write:
        page.write_text(parts[0] + text + parts[2])
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
