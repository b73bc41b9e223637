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

import datetime
import os
import shutil
from pathlib import Path
from typing import Any

import orjson
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from entry.distributed.process_group import DistInfo
from entry.distributed.sharding import full_state_dict
# Defined with the other user errors (exit 2); imported here, where they are raised, so
# `from entry.training.checkpoint import CheckpointError` names the same class.
from entry.config.errors import CheckpointError, UntrustedCheckpointError
from entry.models.files import description_bytes, remove_weights, write_weights_with
from entry.storage.atomic import atomic_write_bytes, publish
from entry.training.checkpoint_trust import (RefusedPickle, TrustedReader, load_dcp, load_weights_only,
                                              read_metadata_early)

# Named keys of the checkpoint format (a round-trip test guards them).
KEY_MODEL = "model"
KEY_OPTIMIZER = "optimizer"
KEY_EMA = "ema"
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


def read_loop_state(path: str | Path, rank: int) -> dict[str, Any]:
    """The loop state (plain values, read `weights_only`) of `rank` in the checkpoint folder `path` (rank 0's
    when the rank has none: the world size changed). Raises `CheckpointError` naming the file when it
    cannot be read, `UntrustedCheckpointError` when it holds more than plain values and tensors."""
    path = Path(path)
    own = path / f"rank{rank}.pt"
    file = own if own.is_file() else path / "rank0.pt"
    try:
        state = load_weights_only(file)
    except RefusedPickle as e:
        raise UntrustedCheckpointError(e.explain()) from None
    except Exception as e:  # noqa: BLE001 - truncated, garbage or missing: one answer
        raise CheckpointError(f"checkpoint file {file} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or KEY_STEP not in state:
        raise CheckpointError(f"checkpoint file {file} does not hold a loop state")
    return state


SET_ASIDE_KEPT = 3
"""Set-aside checkpoint folders kept per stage; a set-aside beyond these removes the oldest."""


def set_aside_folders(ckpt_dir: str | Path) -> list[Path]:
    """A stage's set-aside checkpoint folders (`<stage>.stale-*` beside `ckpt_dir`), oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.parent.is_dir():
        return []
    prefix = f"{ckpt_dir.name}.stale-"
    # Names carry the time first (`set_aside`); older versions' `<stage>.stale-<hash>` count as oldest.
    return sorted(ckpt_dir.parent.glob(f"{prefix}*"), key=lambda p: (p.name[len(prefix):][:8].isdigit(), p.name))


def set_aside(ckpt_dir: str | Path, stale_hash: str | None, info: DistInfo) -> tuple[Path, list[Path]]:
    """Rank 0 moves a stage's checkpoint folder out of the way, so a run never resumes from it.

    Takes the folder and the config hash its checkpoints were written for. Returns (where it went,
    the older set-aside folders removed to keep `SET_ASIDE_KEPT`). The name is unique
    (`<stage>.stale-<time>-<hash>`): a set-aside folder is never overwritten or merged into.
    """
    ckpt_dir = Path(ckpt_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    aside = ckpt_dir.with_name(f"{ckpt_dir.name}.stale-{stamp}-{stale_hash or 'unknown'}")
    removed: list[Path] = []
    if info.is_main:
        ckpt_dir.rename(aside)
        removed = set_aside_folders(ckpt_dir)[:-SET_ASIDE_KEPT]
        for old in removed:
            shutil.rmtree(old, ignore_errors=True)
    return aside, removed


def save_checkpoint(ckpt_dir: str | Path, info: DistInfo, model: nn.Module, optimizer: torch.optim.Optimizer,
                    loop_state: dict[str, Any], *, keep: int, ema: nn.Module | None = None) -> Path:
    """Write one checkpoint collectively (every rank calls this at the same step); with `ema`, the
    moving average of the weights too (sharded like the model).

    Returns the final folder. Rank 0 renames the temporary folder once DCP has finished,
    which happens only after every rank's files are written, then prunes to `keep`.
    """
    ckpt_dir = Path(ckpt_dir)
    final = _step_dir(ckpt_dir, int(loop_state[KEY_STEP]))
    # One temporary name per torchrun attempt: a restarted job never writes into, or deletes,
    # a folder another rank of the same attempt is filling, so no barrier is needed here.
    tmp = final.with_name(f"{final.name}.tmp{info.restart_count}")
    tmp.mkdir(parents=True, exist_ok=True)
    _save_synced(loop_state, tmp / f"rank{info.rank}.pt")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {KEY_MODEL: model_sd, KEY_OPTIMIZER: optim_sd}
    if ema is not None:
        state[KEY_EMA] = get_model_state_dict(ema)
    dcp.save(state, checkpoint_id=str(tmp))  # fsyncs its files
    if info.is_main:
        _save_synced(None, tmp / COMPLETE_MARK, text="ok\n")
        if final.exists():
            shutil.rmtree(final)
        publish(tmp, final)
        for old in complete_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in ckpt_dir.glob(f"{PREFIX}*.tmp*"):
            if not stale.name.endswith(f".tmp{info.restart_count}"):
                shutil.rmtree(stale, ignore_errors=True)
    return final


def _save_synced(obj: Any, path: Path, *, text: str | None = None) -> None:
    """torch.save `obj` (or write `text`) to `path` and fsync it: the folder is renamed into place
    only once its contents are on disk."""
    with open(path, "wb") as f:
        if text is None:
            torch.save(obj, f)
        else:
            f.write(text.encode())
        f.flush()
        os.fsync(f.fileno())


def remove_unfinished(ckpt_dir: str | Path) -> list[Path]:
    """Delete the temporary checkpoint folders dead attempts left in `ckpt_dir`; returns them.
    Only while holding the run folder's lock (no other job can be writing one)."""
    found = sorted(Path(ckpt_dir).glob(f"{PREFIX}*.tmp*")) if Path(ckpt_dir).is_dir() else []
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found


def load_checkpoint(path: str | Path, info: DistInfo, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None, *, ema: nn.Module | None = None) -> dict[str, Any]:
    """Load model (and optimizer, and `ema`'s average) state in place from a complete checkpoint; returns this rank's
    loop state. A rank whose own file is missing (world size changed) takes rank 0's. Raises
    `CheckpointError` (loop state) or DCP's `CheckpointException` (model, optimizer) when a file is
    unreadable, `UntrustedCheckpointError` when one holds more than a checkpoint may (no file runs
    code: entry.training.checkpoint_trust); entry.training.resume decides what to do then."""
    path = Path(path)
    loop_state = read_loop_state(path, info.rank)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {KEY_MODEL: model_sd, KEY_OPTIMIZER: optim_sd}
    else:
        state = {KEY_MODEL: get_state_dict(model, [])[0]}
    if ema is not None:
        state[KEY_EMA] = get_model_state_dict(ema)
    try:
        if optimizer is not None:
            _drop_state_the_checkpoint_lacks(state[KEY_OPTIMIZER], path)
        load_dcp(state, path)
    except RefusedPickle as e:
        raise UntrustedCheckpointError(e.explain()) from None
    set_model_state_dict(model, state[KEY_MODEL])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state[KEY_OPTIMIZER], options=StateDictOptions(strict=False))
    if ema is not None:
        set_model_state_dict(ema, state[KEY_EMA])
    return loop_state


def _drop_state_the_checkpoint_lacks(optim_sd: dict[str, Any], path: Path) -> None:
    """Remove from `optim_sd` (DCP's, with state for every parameter) the parameters the checkpoint at
    `path` stores none for: one that never had a gradient (a source field's embedding the new data lack)
    has no AdamW state uninterrupted, so resumed it keeps none (the optimizer loads non-strictly). A
    refused `.metadata` raises `RefusedPickle`; an unreadable one is left to `load_dcp`."""
    metadata = read_metadata_early(TrustedReader(path))
    if metadata is None:
        return
    stored = metadata.state_dict_metadata
    state = optim_sd.get("state", {})
    for fqn in [f for f, v in state.items() if not any(f"{KEY_OPTIMIZER}.state.{f}.{k}" in stored for k in v)]:
        del state[fqn]


def export_weights(model: nn.Module, out_file: str | Path, info: DistInfo) -> Path | None:
    """Write one consolidated, `weights_only`-loadable state dict (full tensors, on rank 0) and the
    model's registry description beside it as one pair (entry.models.files.write_weights_with), so
    it rebuilds from the file and a failed write leaves the old pair whole.

    A collective under FSDP2 (every rank gathers); only rank 0 writes. Returns the path on
    rank 0, None elsewhere.
    """
    model_sd = full_state_dict(model, info)
    if model_sd is None:
        return None
    return _write_exported(model_sd, model, out_file)


def export_module(model: nn.Module, out_file: str | Path) -> Path:
    """`export_weights` of a plain (unplaced, unwrapped) module by the one process that holds it: no
    collective. Returns the path."""
    return _write_exported(model.state_dict(), model, out_file)


def _write_exported(state: dict[str, torch.Tensor], model: nn.Module, out_file: str | Path) -> Path:
    cpu = {k: v.detach().cpu() for k, v in state.items()}
    # Through a file object: the zip is not named after the temporary file, so equal tensors give equal bytes.
    # One pair: a full disk leaves the old weights with their own description (entry.models.files).
    return write_weights_with(out_file, lambda tmp: _save_synced(cpu, tmp), description_bytes(model))


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
    atomic_write_bytes(record, orjson.dumps({"stage": stage, "step": step, "val_nrmse": val_nrmse,
                                             "file": weights.name}))
    for old in folder.glob(f"{stage}_best_step*.pt"):
        if old.name != weights.name:
            remove_weights(old)


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
        remove_weights(old)
