"""The report of `bench.accuracy`: statistics across seeds, Markdown tables, plots, and the
multi-task / single-task ratios (`python -m bench.accuracy --report A.json ...` prints them).
What trains and what is scored is bench/accuracy.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson

from entry.evaluation.plots import headless_pyplot

SPREAD_KEYS = ("nrmse", "nrmse_pdebench2022", "one_step_nrmse")


def seed_stats(values: list) -> dict:
    """mean, std (ddof 1; 0 with one value), min, max and n of the values that are not None, and
    every value as given (``per_seed``); None for each statistic when there is none."""
    v = [x for x in values if x is not None]
    if not v:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0, "per_seed": values}
    return {"mean": float(np.mean(v)), "std": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0,
            "min": float(min(v)), "max": float(max(v)), "n": len(v), "per_seed": values}


def across_seeds(runs: list[dict]) -> dict:
    """Per task and model, mean / std (ddof 1) / min / max / per-seed values over the seed runs
    of the test scores, training time and time to the FNO; ``ours/reported`` is each seed's
    reported variant (chosen on validation, so it may differ between seeds)."""
    out = {}
    for key, first in runs[0]["tasks"].items():
        per_seed = [r["tasks"][key] for r in runs]
        names = list(first["models"]) + ["ours/reported"]
        models = {}
        for name in names:
            ms = [t["models"][t["reported_variant"] if name == "ours/reported" else name] for t in per_seed]
            models[name] = {k: seed_stats([m["test"][k] for m in ms]) for k in SPREAD_KEYS}
            models[name]["train_wall_s"] = seed_stats([m["train_wall_s"] for m in ms])
        budget = {"codec_reconstruction_nrmse": seed_stats([t["error_budget"]["codec_reconstruction_nrmse"]
                                                        for t in per_seed])}
        for ref in first["error_budget"]["references"]:
            budget[ref] = seed_stats([t["error_budget"]["references"][ref]["nrmse"] for t in per_seed])
        ttf = [t["time_to_fno"] for t in per_seed if t["time_to_fno"]]
        out[key] = {"task": first["task"], "param": first["param"], "reference": first["reference"],
                    "reported_variants": [t["reported_variant"] for t in per_seed], "error_budget": budget,
                    "models": models, "skipped": first["skipped"],
                    "time_to_fno": {k: seed_stats([t[k] for t in ttf]) for k in ("ours_time_to_fno_final_s",
                                                                             "fno_budget_over_ours_time",
                                                                             "fno_final_val_nrmse")} if ttf else {}}
        if "fno" in models:
            fno = models["fno"]["nrmse"]["per_seed"]
            ours = models["ours/reported"]["nrmse"]["per_seed"]
            out[key]["ours_over_fno"] = seed_stats([a / b for a, b in zip(ours, fno)])
    return out


# ------------------------------------------------------------------------------------- reporting

COLUMNS = (("nrmse", "nRMSE"), ("nrmse_pdebench2022", "nRMSE (2022)"), ("one_step_nrmse", "1-step"),
           ("crmse", "cRMSE"), ("brmse", "bRMSE"), ("frmse_low", "fRMSE lo"), ("frmse_mid", "fRMSE mid"),
           ("frmse_high", "fRMSE hi"))


def markdown_table(result: dict) -> str:
    """One seed: per task its error budget (codec, trivial reference), then one row per model:
    test scores, training time, time to the published FNO value, inference time."""
    head = ["task", "model"] + [c for _, c in COLUMNS] + ["train s", "to published s", "ms / rollout"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    blank = ["-"] * (len(COLUMNS) - 1)
    for key, t in result["tasks"].items():
        pub = t["reference"].get("published", {}).get("nrmse")
        label = key + (f" (published FNO {pub:g})" if pub else "")
        if t.get("solver"):
            lines.append("| " + " | ".join([label, f"our solver at {t['solver']['resolution']}^2", *["-"] * len(COLUMNS),
                                            "-", "-", f"{1e3 * t['solver']['best_s']:.2f}"]) + " |")
        budget = t.get("error_budget")
        if budget:
            lines.append("| " + " | ".join([label, "codec reconstruction", f"{budget['codec_reconstruction_nrmse']:.3g}",
                                            *blank, "-", "-", "-"]) + " |")
            for ref, s in budget["references"].items():
                lines.append("| " + " | ".join([label, ref] + [f"{s[k]:.3g}" for k, _ in COLUMNS] + ["-"] * 3) + " |")
        for model, m in t["models"].items():
            s = m["test"]
            ttr = m["time_to_published_s"]
            cells = [label, model + (" (reported)" if model == t["reported_variant"] else "")]
            cells += [f"{s[k]:.3g}" for k, _ in COLUMNS]
            cells += [f"{m['train_wall_s']:.4g}" if m["train_wall_s"] is not None else "-",
                      "not reached" if ttr is None else f"{ttr:.0f}", f"{1e3 * m['inference_s_per_rollout']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pm(stat: dict, fmt: str = ".3g") -> str:
    if stat.get("mean") is None:
        return "-"
    return f"{stat['mean']:{fmt}} +- {stat['std']:{fmt}}" if stat["n"] > 1 else f"{stat['mean']:{fmt}}"


def seeds_table(summary: dict) -> str:
    """Across seeds: per task and model, test nRMSE (predicted steps; PDEBench 2022 convention),
    one-step nRMSE and training time as mean +- std over the seeds, the codec floor and trivial
    reference, ours over the FNO per seed, and when ours reached the FNO's final validation nRMSE."""
    head = ["task", "model", "nRMSE", "nRMSE (2022)", "1-step", "train s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for key, t in summary.items():
        b = t["error_budget"]
        lines.append(f"| {key} | codec reconstruction | {_pm(b['codec_reconstruction_nrmse'])} | - | - | - |")
        for ref, stat in b.items():
            if ref != "codec_reconstruction_nrmse":
                lines.append(f"| {key} | {ref} | {_pm(stat)} | - | - | - |")
        for name, m in t["models"].items():
            lines.append(f"| {key} | {name} | {_pm(m['nrmse'])} | {_pm(m['nrmse_pdebench2022'])} | "
                         f"{_pm(m['one_step_nrmse'])} | {_pm(m['train_wall_s'], '.0f')} |")
        if "ours_over_fno" in t:
            notes.append(f"{key}: ours (reported) / FNO test nRMSE {_pm(t['ours_over_fno'], '.2f')} "
                         f"(per seed {[round(v, 2) for v in t['ours_over_fno']['per_seed']]})")
        ttf = t.get("time_to_fno") or {}
        if ttf:
            reached = ttf["ours_time_to_fno_final_s"]
            notes.append(f"{key}: ours reached the FNO's final validation nRMSE after "
                         f"{[None if v is None else round(v) for v in reached['per_seed']]} s, "
                         f"FNO budget / that time {[None if v is None else round(v, 1) for v in ttf['fno_budget_over_ours_time']['per_seed']]}")
        for model, why in t.get("skipped", {}).items():
            notes.append(f"{key}: {model} skipped: {why}")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def multitask_ratios(results: list[dict]) -> list[dict]:
    """For each multi-task result and task: its reported model's test nRMSE (mean over its seeds)
    over the single-task result's (same task, parameter and device)."""
    def reported(t: dict) -> float:
        return t["models"]["ours/reported"]["nrmse"]["mean"]

    single = {(r["device"], t["task"], t["param"]): t for r in results if len(r["summary"]) == 1
              for t in r["summary"].values()}
    out = []
    for r in results:
        if len(r["summary"]) < 2:
            continue
        for key, t in r["summary"].items():
            one = single.get((r["device"], t["task"], t["param"]))
            if one is not None:
                out.append({"task": key, "multitask": reported(t), "single": reported(one),
                            "ratio": reported(t) / reported(one)})
    return out


def write_plots(stem: Path, result: dict, samples: dict) -> list[str]:
    """Validation nRMSE against training wall time (all tasks), and one rollout figure per task."""
    plt = headless_pyplot()
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, t in result["tasks"].items():
        for model, m in t["models"].items():
            if m["val_curve"]:
                x, y = zip(*m["val_curve"])
                ax.plot(x, y, marker=".", label=f"{key} {model}")
        pub = t["reference"].get("published", {}).get("nrmse")
        if pub:
            ax.axhline(pub, ls="--", lw=0.8, color="gray")
            ax.annotate(f"published FNO {key}", (0, pub), fontsize=7, color="gray")
    ax.set(xlabel="training wall time [s]", ylabel="validation nRMSE (predicted steps)", yscale="log",
           title=f"validation nRMSE vs time ({result['device']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = stem.with_name(stem.name + "-val_vs_time.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(str(p))
    for key, per_model in samples.items():
        first = next(iter(per_model.values()))
        true = first[1][:, 0].numpy()  # [T, *S] channel 0
        panels = [("truth", true)] + [(m, pred[:, 0].numpy()) for m, (pred, _) in per_model.items()]
        fig, axes = plt.subplots(1, len(panels), figsize=(3 * len(panels), 3), squeeze=False)
        for ax, (title, img) in zip(axes[0], panels):
            shown = img[-1] if img.ndim == 3 else img  # 2D steady: the solution; 1D: x-t image
            ax.imshow(shown, aspect="auto", origin="lower", cmap="viridis",
                      vmin=true.min(), vmax=true.max())
            ax.set_title(title, fontsize=8)
        fig.suptitle(f"{key}: test sample 0", fontsize=9)
        fig.tight_layout()
        p = stem.with_name(f"{stem.name}-rollout-{key}.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(str(p))
    return paths


def print_reports(paths: list[Path]) -> int:
    """Print the tables of saved results and the multi-task / single-task ratios; exit code 0."""
    results = [orjson.loads(p.read_bytes()) for p in paths]
    for p, r in zip(paths, results):
        print(f"\n{p} ({r['device']}, {r['date']}, commit {r['git_commit'][:10]}, {len(r['runs'])} seed(s))\n"
              f"{seeds_table(r['summary'])}")
    for row in multitask_ratios(results):
        print(f"multi-task {row['task']}: nRMSE {row['multitask']:.4g} vs single-task {row['single']:.4g} "
              f"= {row['ratio']:.2f}x")
    return 0
