"""PDEBench's own U-Net code, unchanged, trained on a race's 1D file: the check that the race's U-Net
(`core.models.unet`, trained by `bench.race`) is not worse than its authors' code after as many updates.

    python -m bench.pdebench_unet --pdebench /path/to/PDEBench --config configs/reduced/burgers.yaml \
        --epochs 10 --out bench/results/pdebench-unet-burgers1d.json

``--pdebench`` is a checkout of github.com/pdebench/PDEBench (nothing is downloaded; its package
``pdebench`` is imported from there). Its ``pdebench.models.unet.train.run_training`` runs as its
``config_Bgs.yaml`` sets it (pushforward with ``unroll_step`` 20, Adam 1e-3 with weight decay 1e-4,
StepLR(100, 0.5), batch 50, ``initial_step`` 10), on the config's one task file with the config's
``reduce_x`` and ``reduce_t``; PDEBench's own split (its first tenth is the test set, as the race's,
`pipelines.split`). Two things are PDEBench's and stay: it keeps the checkpoint of the lowest loss on
that test split (its "validation"), and with fewer than 100 epochs its step schedule never lowers the
rate.

Nothing of its code changes. One wrapper is added around ``torch.save``, which it calls whenever it
keeps a checkpoint: a copy per epoch, so the model kept after any number of epochs can be scored.
Each copy is then rolled out on the test split from its 10 given steps by the race's peer rollout
(`bench.fno_baseline.fno_rollout`) and scored by `core.metrics.nrmse` over the predicted steps, the
metric of every race record. The JSON written
holds, per kept epoch, that score, the updates and the wall seconds up to the end of the epoch (its
validation included), and `--config`'s data fingerprint. Compare with a race record of the same
recipe by updates (its ``steps``): the wall seconds move with the machine's speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import shlex
import sys
import time
from pathlib import Path

import h5py
import torch

from bench.fno_baseline import fno_rollout
from bench.provenance import commit_state, record_stamp, refuse_dirty
from core.metrics import nrmse
from entry.config.cli import exits_on_user_error
from entry.config.load import ConfigError, load_config
from entry.data.files import data_inputs, task_key, task_path

GIVEN_STEPS = 10
"""PDEBench's ``initial_step`` for 1D tasks: the frames the model is given."""


def pdebench_args(file: Path, reduce_x: int, reduce_t: int, epochs: int) -> dict:
    """``run_training``'s arguments as PDEBench's ``config_Bgs.yaml`` sets them for its U-Net, on
    ``file`` at ``reduce_x``, ``reduce_t`` for ``epochs`` epochs."""
    return dict(if_training=True, continue_training=False, num_workers=0, initial_step=GIVEN_STEPS, t_train=200,
                in_channels=1, out_channels=1, batch_size=50, unroll_step=20, ar_mode=True, pushforward=True,
                epochs=epochs, learning_rate=1e-3, scheduler_step=100, scheduler_gamma=0.5, model_update=1,
                flnm=file.name, single_file=True, reduced_resolution=reduce_x, reduced_resolution_t=reduce_t,
                reduced_batch=1, plot=False, channel_plot=0, x_min=-1, x_max=1, y_min=-1, y_max=1, t_min=0,
                t_max=5, base_path=str(file.parent) + "/", training_type="autoregressive")


def rollout_nrmse(model: torch.nn.Module, loader) -> float:
    """Test nRMSE (`core.metrics.nrmse`, predicted steps only) of ``model``'s free rollout over
    ``loader``'s PDEBench batches (``xx`` ``[B, X, 10, 1]``, ``yy`` ``[B, X, T, 1]``), rolled out by
    the race's own peer rollout (`bench.fno_baseline.fno_rollout`)."""
    preds, refs = [], []
    with torch.no_grad():
        for _, yy in loader:
            u_BTCX = yy.permute(0, 2, 3, 1)
            preds.append(fno_rollout(model, u_BTCX, GIVEN_STEPS))
            refs.append(u_BTCX)
    to_bctx = lambda u: torch.cat(u).transpose(1, 2)  # [B, T, C, X] -> [B, C, T, X]
    return float(nrmse(to_bctx(preds), to_bctx(refs), given_steps=GIVEN_STEPS))


def train_pdebench(run_args: dict) -> tuple[list[float], dict[int, str]]:
    """Runs PDEBench's ``run_training(**run_args)`` in the working directory (its checkpoints land
    there, a copy per kept epoch beside each). Returns (wall seconds since the start at the end of each
    epoch, its validation included; each epoch whose checkpoint it kept -> that copy's path)."""
    from pdebench.models.unet import train as pdebench_train  # its code, imported as is

    start = time.perf_counter()
    epoch_end: list[float] = []
    kept: dict[int, str] = {}

    class EpochClock(logging.Handler):
        """Notes the time of each of PDEBench's per-epoch log lines ("epoch: N, loss: ...") and prints it."""

        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("epoch:"):
                epoch_end.append(time.perf_counter() - start)
            print(f"pdebench: {message}", flush=True)

    save = torch.save

    def save_each_kept(obj, path, *a, **kw):  # PDEBench keeps a checkpoint: keep a copy by epoch too
        save(obj, path, *a, **kw)
        kept[obj["epoch"]] = f"{path}.ep{obj['epoch']}"
        save(obj, kept[obj["epoch"]], *a, **kw)

    clock = EpochClock()
    pdebench_train.logger.addHandler(clock)
    pdebench_train.logger.setLevel(logging.INFO)
    pdebench_train.torch.save = save_each_kept
    try:
        pdebench_train.run_training(**run_args)
    finally:
        pdebench_train.torch.save = save
        pdebench_train.logger.removeHandler(clock)
    return epoch_end, kept


def score_kept(file: Path, task, run_args: dict, epoch_end: list[float], kept: dict[int, str]) -> list[dict]:
    """Each kept checkpoint (in the working directory) rolled out on PDEBench's test split of ``file``
    and scored by `rollout_nrmse`: one dict per kept epoch (its updates and wall seconds by its end)."""
    from pdebench.models.unet.unet import UNet1d
    from pdebench.models.unet.utils import UNetDatasetSingle

    test = UNetDatasetSingle(file.name, saved_folder=str(file.parent) + "/", initial_step=GIVEN_STEPS,
                             reduced_resolution=task.reduce_x, reduced_resolution_t=task.reduce_t, if_test=True)
    loader = torch.utils.data.DataLoader(test, batch_size=50, shuffle=False)
    with h5py.File(file, "r") as f:  # its training split: all but the test tenth, in batches of 50
        per_epoch = math.ceil((f["tensor"].shape[0] - len(test)) / run_args["batch_size"])
    scores = []
    for epoch, path in kept.items():
        model = UNet1d(GIVEN_STEPS, 1)
        model.load_state_dict(torch.load(path)["model_state_dict"])
        tic = time.perf_counter()
        score = rollout_nrmse(model.eval(), loader)
        scores.append({"epoch": epoch, "updates_by_its_end": (epoch + 1) * per_epoch,
                       "wall_s_at_its_end": epoch_end[epoch], "test_nrmse": score,
                       "test_rollout_s": time.perf_counter() - tic})
        print(f"bench.pdebench_unet: kept after epoch {epoch} ({epoch_end[epoch]:.0f} s): test nRMSE {score:.4f}")
    return scores


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pdebench", type=Path, required=True, help="a checkout of github.com/pdebench/PDEBench")
    p.add_argument("--config", required=True, help="a config with one 1D task (its file, reduce_x, reduce_t)")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--out", type=Path, required=True, help="the JSON written")
    p.add_argument("--work", type=Path, default=Path("runs/pdebench_unet"), help="where its checkpoints go")
    p.add_argument("--note", default="", help="what the machine was doing (written with the numbers)")
    p.add_argument("--allow-dirty", action="store_true", help="measure from a work tree with uncommitted changes "
                   "(a development run: its record says dirty)")
    args = p.parse_args(argv)
    if not (args.pdebench / "pdebench" / "models" / "unet" / "train.py").is_file():
        raise ConfigError(f"--pdebench {args.pdebench} holds no pdebench/models/unet/train.py: pass a checkout of "
                          "github.com/pdebench/PDEBench")
    cfg = load_config(args.config)
    if len(cfg.data.tasks) != 1 or cfg.data.tasks[0].spec.spatial_dims != 1:
        raise ConfigError(f"--config {args.config}: give a config with one 1D task (PDEBench's U-Net 1D run)")
    refuse_dirty(args.allow_dirty, "bench.pdebench_unet")
    stamp = record_stamp(torch.device("cpu"))
    task = cfg.data.tasks[0]
    file = task_path(cfg, task).resolve()
    run_args = pdebench_args(file, task.reduce_x, task.reduce_t, args.epochs)

    sys.path.insert(0, str(args.pdebench.resolve()))
    args.work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cwd = Path.cwd()
    os.chdir(args.work)  # PDEBench writes its checkpoints to the working directory
    try:
        epoch_end, kept = train_pdebench(run_args)
        scores = score_kept(file, task, run_args, epoch_end, kept)
    finally:
        os.chdir(cwd)
    record = {"command": shlex.join(["python", "-m", "bench.pdebench_unet", *(argv or sys.argv[1:])]),
              "date": datetime.date.today().isoformat(), **stamp, "note": args.note,
              "pdebench_commit": commit_state(args.pdebench)[0],
              "data_fingerprint": data_inputs(cfg)[task_key(cfg, 0)], "pdebench_args": run_args,
              "epochs": args.epochs, "epoch_end_wall_s": epoch_end, "kept": scores}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
