"""The evaluation table printed on the terminal: one row per task and model, the error budget first,
then one lead-time line per variant of a time-dependent task, a line where the codec is the
largest error term, and a line where a model does not beat the trivial reference or a stage
published its untrained start (with what to try)."""

from __future__ import annotations

TABLE_COLUMNS = ("nrmse", "nrmse_pdebench2022", "one_step_nrmse", "rmse", "max_error", "frmse_high")


def format_table(tree: dict) -> str:
    """The terminal table, per task its error budget top to bottom: the codec's reconstruction (the
    floor under every latent model), the trivial reference, then our models (one-step and rollout)."""
    head = f"{'task':<16} {'model':<26} {'n':>5} " + " ".join(f"{c:>18}" for c in TABLE_COLUMNS)
    lines = [head]

    def row(task: str, label: str, n: int, scores: dict, columns=TABLE_COLUMNS) -> str:
        cells = [f"{scores[c]:>18.5g}" if c in columns else f"{'-':>18}" for c in TABLE_COLUMNS]
        return f"{task:<16} {label:<26} {n:>5} " + " ".join(cells)

    for task, t in tree["tasks"].items():
        n = t["n_test_samples"]
        lines.append(row(task, "codec: decode(encode(u))", n, t["codec"], ("nrmse", "rmse", "max_error")))
        for name, scores in t["references"].items():
            lines.append(row(task, f"{name} (reference)", n, scores))
        for name, scores in t["variants"].items():
            lines.append(row(task, name, n, scores))
    for task, t in tree["tasks"].items():
        lines += lead_time_lines(task, t["variants"])
        lines += codec_line(task, t["codec"], t["variants"])
        lines += reference_lines(task, t["references"], t["variants"])
    for stage, published in tree.get("published", {}).items():
        if published.get("best_step") == 0:
            lines.append(untrained_start_line(stage, published["best_val_nrmse"]))
    return "\n".join(lines)


def what_to_try(stage: str) -> str:
    """What to try when a stage's model does not beat its untrained start or the trivial reference."""
    noise = ", operator.input_noise=0.01" if stage == "operator" else ""
    return (f"try more training trajectories, regularisation ({stage}.weight_decay=0.01{noise}), a smaller model "
            f"({stage}.pdet.hidden_dim=32) or a lower {stage}.lr")


def untrained_start_line(stage: str, val_nrmse: float) -> str:
    """The one line a stage's log and the evaluation summary print when the stage published its
    untrained start: its best validation was the one before the first step (best_step 0)."""
    start = " (an untrained operator steps as persistence)" if stage == "operator" else ""
    return (f"{stage}: the published weights are its untrained start{start}: no step beat step 0's validation "
            f"nRMSE {val_nrmse:.4g} (best_step 0 in {stage}.done.json); {what_to_try(stage)}")


def reference_lines(task: str, references: dict, variants: dict) -> list[str]:
    """One line per model that does not beat the task's best trivial reference (persistence, the
    training mean) on test nRMSE: the model is no better than not modelling. Empty otherwise."""
    scored = {name: s["nrmse"] for name, s in references.items() if "nrmse" in s}
    if not scored:
        return []
    ref = min(scored, key=scored.get)
    return [f"{name} does not beat {ref} on {task}: test nRMSE {s['nrmse']:.4g} against {scored[ref]:.4g}; "
            f"{what_to_try(name.split('+')[0])}"
            for name, s in variants.items() if "nrmse" in s and not s["nrmse"] < scored[ref]]


def codec_line(task: str, codec: dict, variants: dict) -> list[str]:
    """One line when the codec is the largest term of the task's error budget: its reconstruction
    nRMSE is more than half the best model's test nRMSE, so more of that error is the latent's
    than the model's (reading the budget as codec + the rest). Empty otherwise, or with no model."""
    scored = {name: s["nrmse"] for name, s in variants.items() if "nrmse" in s}
    if not scored:
        return []
    best = min(scored, key=scored.get)
    if not codec["nrmse"] > 0.5 * scored[best]:
        return []
    return [f"the codec is the largest error term on {task}: its reconstruction nRMSE {codec['nrmse']:.4g} is "
            f"{codec['nrmse'] / scored[best]:.0%} of the best model's {scored[best]:.4g} ({best}); a larger latent "
            f"(latent.dim, latent.patch) would lower the floor every model stands on"]


def lead_time_lines(task: str, variants: dict) -> list[str]:
    """One line per variant of a time-dependent task: its correlation time and last-window nRMSE.

    A refiner (``operator+...``) is said to improve on the operator only where its last-window
    nRMSE is below the operator's by more than the std of that nRMSE over its ensemble members (its
    own spread; 0 with one member, then the numbers alone decide); else its line says refinement
    does not pay. Takes the task's eval.json ``variants``; steady tasks give no lines.
    """
    timed = {name: s for name, s in variants.items() if "windows" in s}
    if not timed:
        return []
    last = list(next(iter(timed.values()))["windows"])[-1]
    op = timed.get("operator")
    lines = []
    for name, s in timed.items():
        w = s["windows"][last]
        text = (f"{name}: correlation time {s['correlation_time']:.3g} steps, last window ({last}) "
                f"nRMSE {w['nrmse']:.4g}")
        if "rollout_step_ms" in s:
            calls = " + ".join(f"{n} {k}" for k, n in s["network_calls_per_step"].items())
            text += f", {s['rollout_step_ms']:.3g} ms a rollout step per trajectory ({calls} network calls)"
        if s["ensemble_members"] > 1:
            text += (f" (member std {w['nrmse_member_std']:.2g}; {s['ensemble_members']}-member mean "
                     f"{w['ensemble_mean_nrmse']:.4g}, CRPS {w['crps']:.4g}, "
                     f"spread-skill {w['spread_skill']:.3g})")
        if op is None or name == "operator" or not name.startswith("operator+"):
            lines.append(f"{task}: {text}")
            continue
        base = op["windows"][last]["nrmse"]
        if w["nrmse"] < base - (w["nrmse_member_std"] or 0.0):
            lines.append(f"{task}: {text}, below the operator's {base:.4g}")
        else:
            lines.append(f"refinement does not pay on {task}: {text}, operator {base:.4g}")
    return lines
