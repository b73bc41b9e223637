"""The evaluation table printed on the terminal: one row per task and model, the error budget first."""

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
    return "\n".join(lines)
