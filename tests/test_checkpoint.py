"""Checkpoints: the format's named keys round-trip, and incomplete folders are never picked."""

import shutil

import torch
from torch import nn

from entry.distributed.process_group import DistInfo
from entry.training import checkpoint as ckpt

INFO = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _state(step: int) -> dict:
    return {ckpt.KEY_STEP: step, ckpt.KEY_EPOCH: 1, ckpt.KEY_SKIPS: 0, ckpt.KEY_LOADER: {"pos": 3},
            ckpt.KEY_SCHEDULER: {"last_epoch": step}}


def test_round_trip_restores_model_optimizer_and_loop_state(tmp_path):
    model, opt = _model_and_opt(0)
    path = ckpt.save_checkpoint(tmp_path, INFO, model, opt, _state(7), keep=2)
    assert path.name == "step_00000007" and (path / ckpt.COMPLETE_MARK).is_file()
    other, other_opt = _model_and_opt(1)
    loop = ckpt.load_checkpoint(path, INFO, other, other_opt)
    assert loop == _state(7)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict()["state"], other_opt.state_dict()["state"]
    for k in sa:
        assert all(torch.equal(torch.as_tensor(sa[k][n]), torch.as_tensor(sb[k][n])) for n in sa[k])


def test_format_keys_are_stable():
    # Renaming a key breaks every saved checkpoint: change these only with a migration.
    assert (ckpt.KEY_MODEL, ckpt.KEY_OPTIMIZER, ckpt.KEY_STEP, ckpt.KEY_EPOCH, ckpt.KEY_SKIPS,
            ckpt.KEY_LOADER, ckpt.KEY_SCHEDULER) == (
        "model", "optimizer", "step", "epoch", "skips_in_a_row", "loader", "scheduler")


def test_truncated_or_unfinished_checkpoints_are_skipped(tmp_path):
    model, opt = _model_and_opt(0)
    good = ckpt.save_checkpoint(tmp_path, INFO, model, opt, _state(5), keep=3)
    newer = ckpt.save_checkpoint(tmp_path, INFO, model, opt, _state(10), keep=3)
    # A write cut short: the folder never got its COMPLETE mark.
    (newer / ckpt.COMPLETE_MARK).unlink()
    # A temporary folder of a crashed attempt, even with a mark, is never taken.
    shutil.copytree(good, tmp_path / "step_00000015.tmp0")
    assert ckpt.latest_checkpoint(tmp_path) == good


def test_keep_prunes_old_checkpoints(tmp_path):
    model, opt = _model_and_opt(0)
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, INFO, model, opt, _state(step), keep=2)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]


def test_export_is_weights_only_loadable(tmp_path):
    model, _ = _model_and_opt(0)
    out = ckpt.export_weights(model, tmp_path / "w.pt", INFO)
    loaded = torch.load(out, weights_only=True)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fresh.load_state_dict(loaded)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
