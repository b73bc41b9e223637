"""Atomic, resumable checkpoints with `torch.distributed.checkpoint` (DCP).

Layout of one checkpoint, `<ckpt_dir>/step_00000120/`:
  DCP files      model and optimizer state (sharded under FSDP2)
  rank<k>.pt     this rank's loop state: step, epoch, skips, data-pipeline position, scheduler
  COMPLETE       written last by rank 0, after every rank's files exist
Everything is written into `step_XXXXXXXX.tmp<attempt>` and renamed by rank 0, so a folder without
`.tmp` and with COMPLETE is whole; anything else is ignored by `latest_checkpoint`.

Best weights (evaluation.select=best), in a folder the caller names:
  <stage>_best_step<step>.pt   exported weights of the best validation so far
  <stage>_best.json            the record naming that file, its step and its validation nRMSE
The record is replaced atomically after its file is whole, so it always describes the file it names.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import orjson
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from entry.distributed import DistInfo

# Named keys of the checkpoint format (a round-trip test guards them).
KEY_MODEL = "model"
KEY_OPTIMIZER = "optimizer"
KEY_STEP = "step"
KEY_EPOCH = "epoch"
KEY_SKIPS = "skips_in_a_row"
KEY_LOADER = "loader"
KEY_SCHEDULER = "scheduler"
KEY_CONFIG_HASH = "config_hash"
KEY_TRAIN_WALL_S = "train_wall_s"
"""Wall seconds spent training the stage so far, validation excluded (absent in older checkpoints)."""
COMPLETE_MARK = "COMPLETE"
PREFIX = "step_"


def _step_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"{PREFIX}{step:08d}"


def complete_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders under `ckpt_dir`, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and p.name.startswith(PREFIX) and ".tmp" not in p.name
             and (p / COMPLETE_MARK).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = complete_checkpoints(ckpt_dir)
    return found[-1] if found else None


def checkpoint_config_hash(path: str | Path) -> str | None:
    """The config hash a checkpoint's loop state records (None for checkpoints that predate it)."""
    return torch.load(Path(path) / "rank0.pt", weights_only=False).get(KEY_CONFIG_HASH)


def set_aside_stale(ckpt_dir: str | Path, config_hash: str, info: DistInfo) -> Path | None:
    """Move a stage's checkpoints written for another config out of the way (rank 0), so a run
    never resumes from them; returns where they went (None when there was nothing stale).

    Collective-free and the same decision on every rank: all ranks read the same files.
    Moved, not deleted: they are a user's results.
    """
    ckpt_dir = Path(ckpt_dir)
    latest = latest_checkpoint(ckpt_dir)
    if latest is None or checkpoint_config_hash(latest) in (config_hash, None):
        return None
    aside = ckpt_dir.with_name(f"{ckpt_dir.name}.stale-{checkpoint_config_hash(latest)}")
    if info.is_main:
        if aside.exists():
            shutil.rmtree(aside)
        ckpt_dir.rename(aside)
    return aside


def save_checkpoint(ckpt_dir: str | Path, info: DistInfo, model: nn.Module, optimizer: torch.optim.Optimizer,
                    loop_state: dict[str, Any], *, keep: int) -> Path:
    """Write one checkpoint collectively (every rank calls this at the same step).

    Returns the final folder. Rank 0 renames the temporary folder once DCP has finished,
    which happens only after every rank's files are written, then prunes to `keep`.
    """
    ckpt_dir = Path(ckpt_dir)
    final = _step_dir(ckpt_dir, int(loop_state[KEY_STEP]))
    # One temporary name per torchrun attempt: a restarted job never writes into, or deletes,
    # a folder another rank of the same attempt is filling, so no barrier is needed here.
    tmp = final.with_name(f"{final.name}.tmp{info.restart_count}")
    tmp.mkdir(parents=True, exist_ok=True)
    torch.save(loop_state, tmp / f"rank{info.rank}.pt")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({KEY_MODEL: model_sd, KEY_OPTIMIZER: optim_sd}, checkpoint_id=str(tmp))
    if info.is_main:
        (tmp / COMPLETE_MARK).write_text("ok\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in complete_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in ckpt_dir.glob(f"{PREFIX}*.tmp*"):
            if not stale.name.endswith(f".tmp{info.restart_count}"):
                shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path, info: DistInfo, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load model (and optimizer) state in place from a complete checkpoint; returns this rank's
    loop state. A rank whose own file is missing (world size changed) takes rank 0's."""
    path = Path(path)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {KEY_MODEL: model_sd, KEY_OPTIMIZER: optim_sd}
    else:
        state = {KEY_MODEL: get_state_dict(model, [])[0]}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state[KEY_MODEL],
                   optim_state_dict=state.get(KEY_OPTIMIZER, {}))
    own = path / f"rank{info.rank}.pt"
    return torch.load(own if own.is_file() else path / "rank0.pt", weights_only=False)


def export_weights(model: nn.Module, out_file: str | Path, info: DistInfo) -> Path | None:
    """Write one consolidated, `weights_only`-loadable state dict (full tensors, on rank 0).

    A collective under FSDP2 (every rank gathers); only rank 0 writes. Returns the path on
    rank 0, None elsewhere.
    """
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, _ = get_state_dict(model, [], options=opts)
    if not info.is_main:
        return None
    out_file = Path(out_file)
    tmp = out_file.with_name(out_file.name + ".tmp")
    torch.save({k: v.detach().cpu() for k, v in model_sd.items()}, tmp)
    tmp.replace(out_file)
    return out_file


def best_record_file(folder: str | Path, stage: str) -> Path:
    """The record of `stage`'s best weights in `folder`."""
    return Path(folder) / f"{stage}_best.json"


def save_best_weights(model: nn.Module, folder: str | Path, stage: str, *, step: int, val_nrmse: float,
                      info: DistInfo) -> None:
    """Export `model` as `stage`'s best weights so far (a collective under FSDP2: every rank calls it).

    Rank 0 writes `<stage>_best_step<step>.pt`, then atomically replaces the record to name it,
    then deletes the older best files. A crash at any point leaves a record that names a whole
    file with that file's own step and score (a single overwritten file could not promise that).
    """
    folder = Path(folder)
    weights = folder / f"{stage}_best_step{step:08d}.pt"
    if info.is_main:
        folder.mkdir(parents=True, exist_ok=True)
    export_weights(model, weights, info)
    if not info.is_main:
        return
    record = best_record_file(folder, stage)
    tmp = record.with_name(record.name + ".tmp")
    tmp.write_bytes(orjson.dumps({"stage": stage, "step": step, "val_nrmse": val_nrmse, "file": weights.name}))
    tmp.replace(record)
    for old in folder.glob(f"{stage}_best_step*.pt"):
        if old.name != weights.name:
            old.unlink(missing_ok=True)


def read_best_record(folder: str | Path, stage: str) -> dict[str, Any] | None:
    """`{"step", "val_nrmse", "file"}` of `stage`'s best weights (`file` a full path), or None when
    no best was written (or its file is gone)."""
    record = best_record_file(folder, stage)
    if not record.is_file():
        return None
    out = orjson.loads(record.read_bytes())
    out["file"] = Path(folder) / out["file"]
    return out if out["file"].is_file() else None


def clear_best_weights(folder: str | Path, stage: str, info: DistInfo) -> None:
    """Rank 0 removes `stage`'s best record and files (a fresh start must not inherit an older run's)."""
    if not info.is_main:
        return
    folder = Path(folder)
    best_record_file(folder, stage).unlink(missing_ok=True)
    for old in folder.glob(f"{stage}_best_step*.pt"):
        old.unlink(missing_ok=True)
