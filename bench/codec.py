"""`python -m bench.codec --config CFG [--ratios 1,4,16] [--train-s S] [--out DIR]`: the codec's trade-off.

A latent surrogate is no better than its codec. For every task of the config this measures the
reconstruction nRMSE of the test frames (the first `data.split.test_fraction` of the file; the
solution field for Darcy) at several compressions (field numbers C * points / latent numbers), side
by side:

- `pca`: principal components of whole frames fitted on the training frames (numpy-free:
  torch.linalg.eigh of the frames' covariance), each channel normalised by its mean and spread
  over the training frames first (a no-op for one channel), the linear anchor any learned codec
  must meet;
- `ours_local`: our codec with spatially local tokens (`latent.linear: local`, what the operator
  steps): the config's token count, each token's cell compressed by the PCA of the cells;
- `ours_global`: our codec with the global linear path (`latent.linear: global`): the field's PCA
  in cosine-cell coordinates; with `--train-s S > 0` also `ours_global+correction`, its learned
  non-linear correction trained for S seconds of training (AdamW, relative reconstruction loss,
  the product's budgeted loop: `bench.timed_training`), keeping the validated weights with the best
  reconstruction. The grid-codec rows are built for one channel
  and take their layout from a grid-codec config: a task of several channels, or a config that
  sets `latent.codec: conv`, is measured with `pca` and `conv` only;
- `conv`, `conv+trained`: the convolutional codec (`latent.codec: conv`) at each compression, its
  patch and latent channels chosen per rate, fitted (and with `--train-s` trained) on the same
  frames: `bench.codec_conv` says how; ``--conv-linear global`` (or ``local,global``) adds
  `conv_global`, `conv_global+trained`, the same with the global linear path.

Every row reports the whole-frame nRMSE (`nrmse`, per frame then averaged) and, with core.metrics,
nRMSE and VRMSE per field and their means over the fields (`nrmse_fields`, `vrmse_fields`).
At 1x every variant of ours is the exact linear path. Writes `<out>/<device>-<date>-codec-<run>.json`,
a Markdown table and a plot of nRMSE against compression per task (``-conv_<scopes>`` added to
the name when ``--conv-linear`` is not just local).
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import torch
from torch import Tensor, nn

from bench.codec_conv import ROW_NAMES, ChannelPCA, conv_rows, conv_table, scores
from bench.provenance import record_stamp
from bench.timed_training import train_for_seconds
from core.models.grid_codec import GridDecoder, GridEncoder, cells_per_axis, fit_linear_path
from entry.config.cli import exits_on_user_error, parse_config
from entry.config.load import ConfigError, config_hash
from entry.config.schema import Config
from entry.data.files import ensure_data, task_path, task_split
from entry.evaluation.plots import headless_pyplot
from entry.evaluation.task_frames import task_label
from entry.models.build import codec_modes, latent_tokens
from entry.training.budgeted import VALIDATIONS
from pipelines.task_data import open_task, read_trajectories

BATCH = 512


def task_frames(cfg: Config, i: int, split: str, cap: int = 0) -> Tensor:
    """Every frame of task `i`'s `split` rows, reduced as the task trains: [N, 1, *S] float32 (Darcy:
    the solution). `cap` > 0 keeps that many frames, evenly spaced."""
    task = cfg.data.tasks[i]
    rows, _ = task_split(cfg, i, split)
    with open_task(task_path(cfg, task), task.spec) as reader:
        u = torch.from_numpy(read_trajectories(reader, rows, reduce_x=task.reduce_x, reduce_t=task.reduce_t).u)
    frames = u.flatten(0, 1)  # [rows * T, C, *S]
    if cap and len(frames) > cap:
        frames = frames[torch.from_numpy(np.linspace(0, len(frames) - 1, cap).round().astype(np.int64))]
    return frames.contiguous()


def nrmse_per_frame(rec: Tensor, true: Tensor) -> Tensor:
    """RMS error over space / RMS of the frame, per frame (PDEBench's nRMSE of one step). -> [N]."""
    err = (rec - true).flatten(1).double().square().mean(1).sqrt()
    return err / true.flatten(1).double().square().mean(1).sqrt().clamp_min(1e-30)


def build_codec(tokens: int, dim: int, modes: int, d: int, scope: str, hidden: int):
    kw = dict(hidden=hidden, ndims=(d,), modes=modes, linear=scope, depth=2, heads=4)
    return GridEncoder(1, tokens, dim, **kw), GridDecoder(1, tokens, dim, **kw)


@torch.no_grad()
def codec_scores(enc, dec, frames: Tensor) -> Tensor:
    grid = tuple(frames.shape[2:])
    return torch.cat([nrmse_per_frame(dec(enc(frames[s:s + BATCH]), grid), frames[s:s + BATCH])
                      for s in range(0, len(frames), BATCH)])


def train_correction(enc, dec, train: Tensor, val: Tensor, seconds: float, *, lr: float = 3e-4,
                     batch: int = 64, seed: int = 0) -> dict:
    """Train the codec's learned correction for `seconds` on the relative reconstruction loss;
    keeps the weights of the best validation reconstruction (the fitted linear path at step 0
    included), validated `VALIDATIONS` times over the budget (`bench.timed_training`). Returns
    {"steps", "best_step", "val_curve"}."""
    g = torch.Generator().manual_seed(seed)
    grid = tuple(train.shape[2:])
    ms = train.flatten(1).square().mean(1)

    def batch_loss() -> Tensor:
        idx = torch.randint(0, len(train), (batch,), generator=g)
        x = train[idx]
        return ((dec(enc(x), grid) - x).flatten(1).square().mean(1) / (ms[idx] + 1e-12)).mean()

    return train_for_seconds(nn.ModuleList([enc, dec]), batch_loss, lambda: codec_scores(enc, dec, val).mean().item(),
                             seconds, lr=lr, validations=VALIDATIONS)


def layout(cfg: Config, d: int, grid: tuple[int, ...], numbers: int) -> tuple[int, int]:
    """(tokens, cosine modes per axis) of a codec of `numbers` latent numbers for this grid: the
    config's token count, quartered (2D) or halved (1D) until it divides `numbers`; each cell gets
    as many modes as it has points per axis (its coefficients hold the cell exactly)."""
    tokens = latent_tokens(cfg, d)
    while numbers % tokens:
        tokens //= 2 ** d
    if tokens < 1:
        raise ConfigError(f"bench.codec: no token layout holds {numbers} latent numbers")
    cells = cells_per_axis(tokens, d)
    return tokens, max(codec_modes(cfg)[d] if numbers == math.prod(grid) else 1, max(math.ceil(n / cells) for n in grid))


def grid_rows(cfg: Config, train: Tensor, val: Tensor, test: Tensor, n: int, train_s: float,
              fields: tuple[str, ...]) -> dict:
    """The grid codec's rows (one-channel frames) at `n` latent numbers: ours_local, ours_global and,
    with `train_s` > 0 below the exact size, ours_global+correction."""
    d = test.ndim - 2
    tokens, modes = layout(cfg, d, tuple(test.shape[2:]), n)
    dim, exact_dim = n // tokens, modes ** d
    rows = {"layout": {"tokens": tokens, "dim": dim, "modes_per_axis": modes}}
    for scope in ("local", "global"):
        enc, dec = build_codec(tokens, dim, modes, d, scope, hidden=0)
        t0 = time.perf_counter()
        fit_linear_path(enc, dec, (train[s:s + 1024] for s in range(0, len(train), 1024)))
        rows[f"ours_{scope}"] = {**scores(lambda u: dec(enc(u), tuple(u.shape[2:])), test, fields), "dim": dim,
                                 "fit_s": time.perf_counter() - t0}
    if train_s > 0 and dim < exact_dim:
        torch.manual_seed(cfg.training.seed)
        enc, dec = build_codec(tokens, dim, modes, d, "global", hidden=cfg.latent.hidden or 64)
        fit_linear_path(enc, dec, (train[s:s + 1024] for s in range(0, len(train), 1024)))
        info = train_correction(enc, dec, train, val, train_s, seed=cfg.training.seed)
        rows["ours_global+correction"] = {**scores(lambda u: dec(enc(u), tuple(u.shape[2:])), test, fields),
                                          "dim": dim, "train_s": train_s, **info}
    return rows


def run_task(cfg: Config, i: int, ratios: list[int], train_s: float, fit_frames: int, conv_hidden: int = 32,
             logger=print, conv_linear: tuple[str, ...] = ("local",)) -> dict:
    """The trade-off of one task: {ratio: {model: summary}}."""
    fields = cfg.data.tasks[i].spec.channels
    train = task_frames(cfg, i, "train", cap=fit_frames)
    val = task_frames(cfg, i, "val", cap=512)
    test = task_frames(cfg, i, "test")
    points, channels = math.prod(test.shape[2:]), test.shape[1]
    if len(fields) != channels:  # a steady task keeps the solution only
        fields = tuple(f"field{c}" for c in range(channels))
    sizes = {r: channels * points // r for r in ratios}
    pca = ChannelPCA(train)
    out = {"points": points, "channels": channels, "n_train_frames": len(train), "n_test_frames": len(test),
           "ratios": {}}
    for r, n in sizes.items():
        k = min(n, len(train), channels * points)
        row = {"latent_numbers": n, "pca": {**scores(pca.reconstructor(k), test, fields), "components": k}}
        for scope in conv_linear:
            row.update(conv_rows(train, val, test, r, fields, train_s=train_s, hidden=conv_hidden,
                                 seed=cfg.training.seed, linear=scope))
        if channels == 1 and cfg.latent.codec == "grid":
            row.update(grid_rows(cfg, train, val, test, n, train_s, fields))
        elif channels > 1:
            row["ours"] = {"skipped": f"the grid codec's rows are built for one channel, this task has {channels}"}
        else:  # the grid rows take their tokens and modes from a grid-codec config
            row["ours"] = {"skipped": f"the grid codec's rows take its layout from a grid-codec config; this one "
                                      f"sets latent.codec: {cfg.latent.codec}"}
        out["ratios"][str(r)] = row
        logger(f"codec: {task_label(cfg, i)} {r}x ({n} numbers), mean per-field nRMSE: " + ", ".join(
            f"{m} {v['nrmse_fields']:.3e}" for m, v in row.items() if isinstance(v, dict) and "nrmse_fields" in v))
    return out


def markdown_table(result: dict) -> str:
    models = ("pca", "ours_local", "ours_global", "ours_global+correction")
    lines = ["| task | compression | latent numbers | " + " | ".join(models) + " |", "|" + "---|" * (3 + len(models))]
    for key, t in result["tasks"].items():
        for r, row in t["ratios"].items():
            cells = [f"{row[m]['nrmse']:.3e}" if "nrmse" in row.get(m, {}) else "-" for m in models]
            lines.append(f"| {key} | {r}x | {row['latent_numbers']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plot(path: Path, result: dict) -> str:
    plt = headless_pyplot()
    tasks = result["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.8), squeeze=False)
    for ax, (key, t) in zip(axes[0], tasks.items()):
        ratios = [int(r) for r in t["ratios"]]
        for model, style in (("pca", "k--o"), ("ours_local", "C1-s"), ("ours_global", "C0-^"),
                             ("ours_global+correction", "C2-v"), ("conv", "C4-D"), ("conv+trained", "C3-P"),
                             ("conv_global", "C5-x"), ("conv_global+trained", "C6-*")):
            pts = [(r, row[model]["nrmse"]) for r, row in zip(ratios, t["ratios"].values())
                   if "nrmse" in row.get(model, {})]
            if pts:
                ax.plot(*zip(*pts), style, label=model)
        ax.set(xscale="log", yscale="log", xlabel="compression (field numbers / latent numbers)",
               ylabel="test reconstruction nRMSE", title=key)
        ax.set_xticks(ratios, [f"{r}x" for r in ratios])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"codec trade-off ({result['device']}, {result['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ratios", default="1,4,16", help="compressions to measure (field numbers / latent numbers)")
    p.add_argument("--train-s", type=float, default=0.0, help="seconds training the learned correction per size")
    p.add_argument("--conv-hidden", type=int, default=32, help="width of the conv codec's learned correction")
    p.add_argument("--conv-linear", default="local", help="the conv codec's linear-path scopes to measure: "
                   "local, global or local,global")
    p.add_argument("--fit-frames", type=int, default=20000, help="training frames the fits and the PCA use")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="result folder")


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _args)
    ratios = [int(r) for r in args.ratios.split(",")]
    scopes = tuple(s.strip() for s in args.conv_linear.split(","))
    if any(r < 1 for r in ratios) or args.train_s < 0 or args.conv_hidden < 1 or not set(scopes) <= set(ROW_NAMES):
        raise ConfigError("--ratios takes integers >= 1, --train-s a number >= 0, --conv-hidden one >= 1 and "
                          f"--conv-linear names from {sorted(ROW_NAMES)}")
    ensure_data(cfg)
    device = torch.device("cpu")
    date = datetime.date.today().isoformat()
    stamp = record_stamp(device)
    tasks = {task_label(cfg, i): run_task(cfg, i, ratios, args.train_s, args.fit_frames, args.conv_hidden,
                                          conv_linear=scopes)
             for i in range(len(cfg.data.tasks))}
    result = {"benchmark": "codec", **stamp, "date": date, "config": args.config,
              "overrides": list(args.overrides), "config_hash": config_hash(cfg), "tasks": tasks}
    args.out.mkdir(parents=True, exist_ok=True)
    name = cfg.logging.run_name or Path(args.config).stem
    scope_tag = "" if scopes == ("local",) else "-conv_" + "_".join(scopes)  # never overwrite the local-only table
    stem = args.out / f"{result['device']}-{date}-codec-{name}{scope_tag}"
    result["plot"] = write_plot(stem.with_suffix(".png"), result)
    stem.with_suffix(".json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    table = (markdown_table(result) + "\n\nConv codec and PCA of its latent size: nRMSE per field, mean over the fields"
             "\n\n" + conv_table(result))
    stem.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"wrote {stem.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
