"""`python -m bench.refinement --config CFG [--set k=v] [--seeds 0,1,2] [--out FILE.json]`

Does refinement pay (issue 28)? Trains the config's stages (operator, diffusion, consistency,
evaluate) once per training seed with `python -m entry.pipeline` (a subprocess each, run folder
``<run_name>-s<seed>``; a finished stage is reused, so a re-run trains only what is missing, and
an evaluation already written by this exact config, run control included, is read back unless
``--fresh``) and gathers every seed's ``eval.json``: per time-dependent task and variant, the lead-time windows'
nRMSE, ensemble-mean nRMSE, CRPS and spread-skill, the correlation time, the spectrum error and
the sampling time per rollout step, as mean ± std over the seeds with every seed's value. Writes
``--out`` (JSON: the config, its commit, each seed's scores and the statistics), a Markdown report
beside it, and a plot of nRMSE against lead time per variant (mean over seeds, one line each).
With ``--set evaluation.split=val`` it scores the val trajectories instead (each seed's
``eval_val.json``): how run control such as ``diffusion.sampler`` is chosen without the test set.

Legend: T predicted steps.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import orjson

from bench.accuracy_report import seed_stats
from bench.provenance import ROOT, checkout_env, record_stamp, training_device
from entry.config.cli import exits_on_user_error, load_resolved, parse_config
from entry.config.load import ConfigError, config_hash
from entry.storage.run_folder import evaluation_file, run_dir_for

WINDOW_SCORES = ("nrmse", "ensemble_mean_nrmse", "crps", "spread_skill")
RUN_SCORES = ("nrmse", "one_step_nrmse", "correlation_time", "spectrum_error", "rollout_step_ms")


def _mean_curve(curves: list[list[float]]) -> list[float]:
    return [statistics.mean(col) for col in zip(*curves, strict=True)]


def run_seed(config: str, overrides: list[str], name: str, seed: int, *, fresh: bool = False) -> dict:
    """eval.json of the config trained and evaluated with ``training.seed = seed`` in its own run
    folder ``<name>-s<seed>`` (entry.pipeline in a subprocess; finished stages are reused); eval_val.json
    with ``evaluation.split=val`` among the overrides. An evaluation file whose config hash is this
    config's (the hash covers run control: the samplers, the split, the ensemble) and that no
    stage's weights postdate is returned as it is, without a subprocess, unless ``fresh``."""
    more = [*overrides, f"training.seed={seed}", f"logging.run_name={name}-s{seed}"]
    cfg = load_resolved(config, more)  # as entry.pipeline hashes it: precision and compile resolved
    run_dir = run_dir_for(cfg)
    path = evaluation_file(run_dir, cfg)
    if not fresh and path.is_file():
        written = path.stat().st_mtime
        # Weights written after the evaluation (a stage re-run on its own) make it stale.
        if all(w.stat().st_mtime <= written for w in run_dir.glob("*.pt")):
            done = orjson.loads(path.read_bytes())
            if done.get("config_hash") == config_hash(cfg):
                print(f"refinement: seed {seed}: {path} was evaluated with this config; read back (--fresh: again)",
                      flush=True)
                return done
    cmd = [sys.executable, "-m", "entry.pipeline", "--config", config, *[a for o in more for a in ("--set", o)]]
    env = checkout_env()
    print(f"refinement: seed {seed}: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode == 2:
        raise ConfigError(f"entry.pipeline refused the config (seed {seed}); its message is above")
    if proc.returncode != 0:
        raise RuntimeError(f"entry.pipeline exited {proc.returncode} on seed {seed}")
    return orjson.loads(path.read_bytes())


def across_seeds(evals: list[dict]) -> dict:
    """Per task and variant: `RUN_SCORES` and, per window, `WINDOW_SCORES`, each mean ± std over the
    seeds with the per-seed values; the nRMSE per step averaged over seeds. Steady tasks are skipped."""
    out = {}
    for task, first in evals[0]["tasks"].items():
        variants = {}
        for name, s in first["variants"].items():
            if "windows" not in s:
                continue
            per_seed = [e["tasks"][task]["variants"][name] for e in evals]
            row = {k: seed_stats([v.get(k) for v in per_seed]) for k in RUN_SCORES}
            row["windows"] = {w: {k: seed_stats([v["windows"][w].get(k) for v in per_seed]) for k in WINDOW_SCORES}
                              for w in s["windows"]}
            for key in ("nrmse_per_step", "correlation_per_step"):
                row[f"{key}_mean"] = _mean_curve([v[key] for v in per_seed])
            row["spectrum_last_step_mean"] = {k: _mean_curve([v["spectrum_last_step"][k] for v in per_seed])
                                              for k in ("prediction", "truth")}
            row["ensemble_members"] = s["ensemble_members"]
            row["network_calls_per_step"] = s.get("network_calls_per_step")  # the same every seed
            row["ensemble_fan_first_seed"] = per_seed[0].get("ensemble_fan")
            variants[name] = row
        if variants:
            refs = {name: seed_stats([e["tasks"][task]["references"][name]["nrmse"] for e in evals])
                    for name in first["references"]}
            out[task] = {"variants": variants, "references": refs}
    return out


def _cell(st: dict, fmt: str = ".3g") -> str:
    if st["mean"] is None:
        return "—"
    return f"{st['mean']:{fmt}} ± {st['std']:.2g}" if len(st["per_seed"]) > 1 else f"{st['mean']:{fmt}}"


def report(stats: dict, head: str) -> str:
    """Markdown: per task, a row per variant (rollout scores) and a row per variant and window."""
    lines = [head]
    for task, t in stats.items():
        refs = ", ".join(f"{name} {_cell(st)}" for name, st in t["references"].items())
        lines += ["", f"## {task} (references' nRMSE: {refs})", "",
                  "| variant | K | nRMSE | 1-step nRMSE | correlation time (steps) | spectrum error | ms a step | "
                  "network calls a step |", "|---|---|---|---|---|---|---|---|"]
        for name, r in t["variants"].items():
            calls = " + ".join(f"{n} {k}" for k, n in (r.get("network_calls_per_step") or {}).items()) or "—"
            lines.append(f"| {name} | {r['ensemble_members']} | {_cell(r['nrmse'])} | {_cell(r['one_step_nrmse'])} | "
                         f"{_cell(r['correlation_time'])} | {_cell(r['spectrum_error'])} | "
                         f"{_cell(r['rollout_step_ms'])} | {calls} |")
        lines += ["", "| variant | window | nRMSE | K-member-mean nRMSE | CRPS | spread-skill |", "|---|---|---|---|---|---|"]
        for name, r in t["variants"].items():
            for w, sc in r["windows"].items():
                lines.append(f"| {name} | {w} | " + " | ".join(_cell(sc[k]) for k in WINDOW_SCORES) + " |")
    return "\n".join(lines) + "\n"


def write_plot(stats: dict, path: Path) -> Path:
    """Per task (a row), means over seeds: nRMSE and correlation against lead time, one line per
    variant (the correlation with PDE-Refiner's 0.8 threshold), and the radial energy spectrum at
    the last step of the truth and of each variant; then the first seed's ensemble fan (one test
    trajectory's first channel at the centre point, every member of every variant, and the truth)."""
    from entry.evaluation.plots import headless_pyplot

    plt = headless_pyplot()
    fig, axes = plt.subplots(len(stats), 4, figsize=(20.0, 4.0 * len(stats)), squeeze=False)
    for (ax_err, ax_corr, ax_spec, ax_fan), (task, t) in zip(axes, stats.items()):
        truth = fan_truth = None
        for name, r in t["variants"].items():
            lead = range(1, len(r["nrmse_per_step_mean"]) + 1)
            ax_err.plot(lead, r["nrmse_per_step_mean"], label=name)
            ax_corr.plot(lead, r["correlation_per_step_mean"], label=name)
            spectrum = r["spectrum_last_step_mean"]
            ax_spec.loglog(range(1, len(spectrum["prediction"]) + 1), spectrum["prediction"], label=name)
            truth = spectrum["truth"]
            fan = r.get("ensemble_fan_first_seed")
            if fan is not None:
                color = ax_err.lines[-1].get_color()
                for k, member in enumerate(fan["members"]):
                    ax_fan.plot(range(1, len(member) + 1), member, color=color, lw=0.8, alpha=0.6,
                                label=name if k == 0 else None)
                fan_truth = fan["truth"]
        ax_spec.loglog(range(1, len(truth) + 1), truth, "k--", label="truth")
        ax_corr.axhline(0.8, color="grey", lw=0.8, ls=":")
        if fan_truth is not None:
            ax_fan.plot(range(1, len(fan_truth) + 1), fan_truth, "k--", label="truth")
        ax_fan.set(xlabel="lead time (predicted steps)", ylabel="first channel at the centre",
                   title=f"{task}: one trajectory's ensembles")
        ax_err.set(xlabel="lead time (predicted steps)", ylabel="nRMSE", title=f"{task}: error")
        ax_corr.set(xlabel="lead time (predicted steps)", ylabel="correlation with the truth",
                    title=f"{task}: correlation")
        ax_spec.set(xlabel="wavenumber shell", ylabel="energy", title=f"{task}: spectrum at the last step")
        for ax in (ax_err, ax_corr, ax_spec, ax_fan):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/refinement-<run>.json)")
    p.add_argument("--fresh", action="store_true",
                   help="evaluate every seed again, even where its evaluation file has this config's hash")


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    """The command (module docstring): takes its arguments, returns the exit code (2: a user error)."""
    cfg, args = parse_config(argv, __doc__, _args)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {args.seeds!r}: give comma-separated integers") from None
    if not seeds or "evaluate" not in cfg.stages:
        raise ConfigError("give --seeds and a config whose stages include evaluate")
    name = cfg.logging.run_name or Path(args.config).stem
    out = args.out or ROOT / "bench" / "results" / f"refinement-{name}.json"
    stamp = record_stamp(training_device())
    evals = [run_seed(str(args.config), list(args.overrides), name, s, fresh=args.fresh) for s in seeds]
    stats = across_seeds(evals)
    tree = {"config": str(args.config), "overrides": list(args.overrides), **stamp,
            "seeds": seeds, "split": cfg.evaluation.split, "stats": stats, "per_seed": evals}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(tree, option=orjson.OPT_INDENT_2))
    head = (f"# Refinement on {name}, {cfg.evaluation.split} split: {len(seeds)} seeds ({','.join(map(str, seeds))}), "
            f"mean ± std\n\n"
            f"`python -m bench.refinement --config {args.config}"
            + "".join(f" --set {o}" for o in args.overrides)
            + f" --seeds {args.seeds}`, commit {stamp['git_commit'][:10]}"
            + (" (uncommitted changes)" if stamp["dirty"] else ""))
    md = out.with_suffix(".md")
    md.write_text(report(stats, head))
    plot = write_plot(stats, out.with_suffix(".png"))
    print(md.read_text())
    print(f"wrote {out}, {md} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
