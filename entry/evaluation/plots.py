"""PNG plots of an evaluation (rank 0 only): truth | prediction | error per sample, nRMSE per step.

Legend: T time steps, C channels, S spatial axes. matplotlib runs on the Agg backend (no display).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson

from entry.storage.atomic import atomic_write


def headless_pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed: headless nodes, CI)."""
    import matplotlib

    matplotlib.use("Agg")  # headless nodes; must precede the pyplot import
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, *, dpi: int) -> Path:
    """Write `fig` as a PNG to `path` atomically (a full disk leaves the previous plot, not half of
    one) and close it; returns `path`."""
    plt = headless_pyplot()
    try:
        # The temporary file's name ends in .part: the format must be named.
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    finally:
        plt.close(fig)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)


def plot_sample(path: Path, pred_TCS: np.ndarray, true_TCS: np.ndarray, title: str,
                extent: tuple[float, ...] | None = None, channels: tuple[str, ...] = ()) -> Path:
    """One row per channel: truth | prediction (one shared colour scale) | |error|; 1D as x-t images
    (time upwards), 2D as images of the last step, 3D as its x-y plane through the middle of z.
    ``extent``: (x0, x1, t0, t1) for 1D, (y0, y1, x0, x1) for 2D and 3D, so the axes are physical; grid indices without it. ``channels``: the rows' names."""
    plt = headless_pyplot()
    pred_TCS, true_TCS = np.asarray(pred_TCS), np.asarray(true_TCS)
    n = true_TCS.shape[1]
    names = tuple(channels) if len(channels) == n else tuple(f"u{c}" if n > 1 else "u" for c in range(n))
    if pred_TCS.ndim == 3:  # [T, C, X]: space-time image, time upwards
        rows = [(true_TCS[:, c], pred_TCS[:, c]) for c in range(n)]
        labels = dict(xlabel="x", ylabel="t") if extent else dict(xlabel="x index", ylabel="time step")
    else:  # [T, C, X, Y] or [T, C, X, Y, Z]: the last step (3D: its x-y plane through the middle of z)
        plane = (Ellipsis, true_TCS.shape[-1] // 2) if true_TCS.ndim == 5 else (Ellipsis,)
        rows = [(true_TCS[-1, c][plane], pred_TCS[-1, c][plane]) for c in range(n)]
        labels = dict(xlabel="y", ylabel="x") if extent else dict(xlabel="y index", ylabel="x index")
    # A fixed grid (panel, panel, colour bar, gap, panel, colour bar) instead of a layout engine:
    # constrained layout measured every label's extent and took half of an evaluation's plotting time.
    height = 3.6 * n
    fig = plt.figure(figsize=(12, height))
    grid = fig.add_gridspec(n, 6, width_ratios=[1, 1, 0.05, 0.2, 1, 0.05], wspace=0.3, hspace=0.45,
                            left=0.06, right=0.93, bottom=0.55 / height, top=1 - 0.75 / height)
    for r, ((truth, pred), name) in enumerate(zip(rows, names, strict=True)):
        panels = [truth, pred, np.abs(truth - pred)]
        lo, hi = float(min(truth.min(), pred.min())), float(max(truth.max(), pred.max()))
        images = []
        for col, img, what in zip((0, 1, 4), panels, ("truth", "prediction", "|error|")):
            ax = fig.add_subplot(grid[r, col])
            kw = dict(vmin=lo, vmax=hi) if what != "|error|" else {}
            im = ax.imshow(img, origin="lower", aspect="auto", cmap="viridis" if what != "|error|" else "magma",
                           extent=extent, **kw)
            ax.set(title=f"{name}: {what}" if n > 1 else what, **labels)
            if what == "prediction":  # the truth's axes beside it say the same
                ax.set_ylabel("")
            images.append(im)
        fig.colorbar(images[1], cax=fig.add_subplot(grid[r, 2]), label=f"{name} (truth and prediction)")
        fig.colorbar(images[2], cax=fig.add_subplot(grid[r, 5]), label="|prediction - truth|")
    fig.suptitle(title)
    return save_figure(fig, path, dpi=100)


_MARGINS = dict(left=0.12, right=0.97, bottom=0.13, top=0.91)
"""Fixed margins of the line plots (figures 4 inches high): a layout engine measures every label's
extent, which took more than half of each plot's time."""


def plot_curves(path: Path, curves: dict[str, list[float]], title: str) -> Path:
    """nRMSE against rollout step, one line per variant."""
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    fig.subplots_adjust(**_MARGINS)
    for name, values in curves.items():
        ax.plot(np.arange(1, len(values) + 1), values, label=name, marker="." if len(values) < 30 else None)
    ax.set(xlabel="rollout step", ylabel="nRMSE", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path, dpi=100)


def plot_training_curves(metrics_file: Path, stage: str, path: Path) -> Path:
    """A stage's training curves from `metrics.jsonl`: the loss against the optimizer step (log
    scale) and, when the stage validated, its validation nRMSE (with the codec's floor) beside it."""
    plt = headless_pyplot()
    lines = [orjson.loads(x) for x in metrics_file.read_bytes().splitlines() if x.strip()]
    lines = [r for r in lines if r.get("stage") == stage]
    train = [(r["step"], r["loss"]) for r in lines if "loss" in r]
    val = [(r["step"], r["val_nrmse"]) for r in lines if "val_nrmse" in r]
    floor = [(r["step"], v) for r in lines for k, v in r.items() if k.startswith("val_recon_nrmse/")]
    fig, axes = plt.subplots(1, 2 if val else 1, figsize=(11 if val else 6, 4), squeeze=False)
    fig.subplots_adjust(**(_MARGINS | dict(left=0.07, wspace=0.2) if val else _MARGINS))
    ax = axes[0, 0]
    if train:
        ax.plot(*zip(*train), label="training loss")
    ax.set(xlabel="optimizer step", ylabel="loss", yscale="log", title=f"{stage}: training loss")
    ax.grid(alpha=0.3)
    if val:
        ax = axes[0, 1]
        ax.plot(*zip(*val), marker=".", label="validation nRMSE (rollout)")
        if floor:
            ax.plot(*zip(*floor), ls=":", color="grey", label="codec reconstruction (floor)")
        ax.set(xlabel="optimizer step", ylabel="nRMSE", yscale="log", title=f"{stage}: validation")
        ax.grid(alpha=0.3)
        ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path, dpi=90)


def write_plots(plot_dir: Path, results: dict, tree: dict, *, extents: dict | None = None,
                suffix: str = "") -> list[Path]:
    """All plots of one evaluation. ``results``: task -> variant -> MetricSums (with kept samples);
    ``tree``: the eval.json tree; ``extents``: task -> physical extent (see ``plot_sample``).
    Returns the written files."""
    extents = extents or {}
    plot_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for task, variants in results.items():
        for variant, sums in variants.items():
            for k, (pred, true) in enumerate(sums.samples):
                name = f"{_safe(task)}_{_safe(variant)}_sample{k}{suffix}.png"
                out.append(plot_sample(plot_dir / name, pred, true, f"{task} {variant} test sample {k}",
                                       extent=extents.get(task), channels=tuple(tree["tasks"][task].get("channels", ()))))
        scores = tree["tasks"][task]["variants"]
        if not any(s.get("n_samples") and len(s["nrmse_per_step"]) > 1 for s in scores.values()):
            continue  # steady tasks have one step: no curve
        curves = {variant: s["nrmse_per_step"] for variant, s in scores.items()}
        curves |= {f"{name} (reference)": s["nrmse_per_step"] for name, s in tree["tasks"][task]["references"].items()}
        out.append(plot_curves(plot_dir / f"{_safe(task)}_nrmse_vs_step{suffix}.png", curves, f"{task}: rollout nRMSE"))
    return out
