"""`python -m bench.codec`: the codec's trade-off against PCA on a tiny generated file. The
global linear path is the PCA of the fields, so at every compression it reconstructs the test
frames as well as an independent PCA fitted on the same frames; at 1x it is exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
import yaml

from bench import codec


def _bench(tmp_path, name: str, task: dict, latent: dict, *args: str) -> Path:
    """Run `bench.codec` on one generated task; returns the result file."""
    tree = {"data": {"root": str(tmp_path / "data"), "generate_if_missing": True, "tasks": [task]},
            "latent": latent,
            "logging": {"run_dir": str(tmp_path / "runs"), "run_name": name, "wandb": {"mode": "disabled"}}}
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    assert codec.main(["--config", str(cfg), *args, "--out", str(tmp_path / "out")]) == 0
    [path] = list((tmp_path / "out").glob(f"*-codec-{name}*.json"))
    return path


def test_codec_bench_writes_the_trade_off_and_meets_pca(tmp_path, capsys):
    path = _bench(tmp_path, "tiny", {"name": "burgers1d", "param": 0.01, "samples": 60, "nx": 64, "nt": 11,
                                     "initial_step": 3}, {"tokens": 4, "dim": 16, "hidden": 0}, "--ratios", "1,4")
    result = orjson.loads(path.read_bytes())
    rows = result["tasks"]["burgers1d"]["ratios"]
    assert set(rows) == {"1", "4"} and rows["4"]["latent_numbers"] == 16
    assert rows["1"]["ours_global"]["nrmse"] < 1e-5 and rows["1"]["ours_local"]["nrmse"] < 1e-5
    assert rows["4"]["ours_global"]["nrmse"] == pytest.approx(rows["4"]["pca"]["nrmse"], rel=1e-3, abs=1e-6)
    assert Path(result["plot"]).stat().st_size > 0
    assert "| burgers1d | 4x |" in path.with_suffix(".md").read_text()


def test_conv_codec_rows_at_every_rate_on_a_2d_flow(tmp_path):
    """Diffusion-reaction (2 channels, 16 x 16): the conv codec's linear and trained rows, local and
    global, and the PCA of the same latent size at 1x, 4x, 16x, 64x, finite per field; at 1x the
    linear path is exact, and the global linear path reconstructs as the PCA does at every rate.
    The grid codec's one-channel rows are skipped with a reason."""
    path = _bench(tmp_path, "flow", {"name": "dr2d", "param": 0.005, "samples": 16, "nx": 16, "resolution": 32,
                                     "nt": 6}, {"tokens": 16, "dim": 32, "hidden": 0},
                  "--ratios", "1,4,16,64", "--train-s", "0.5", "--conv-hidden", "4", "--conv-linear", "local,global")
    assert path.name.endswith("-codec-flow-conv_local_global.json")
    task = orjson.loads(path.read_bytes())["tasks"]["dr2d"]
    rows = task["ratios"]
    assert set(rows) == {"1", "4", "16", "64"}
    for r, row in rows.items():
        assert row["latent_numbers"] * int(r) == 2 * 16 * 16
        conv = row["conv"]
        assert conv["latent_channels"] * int(r) == 2 * conv["patch"] ** 2
        if row["pca"]["components"] == row["latent_numbers"]:  # the PCA row keeps at most a component per frame
            assert row["conv_global"]["nrmse_fields"] == pytest.approx(row["pca"]["nrmse_fields"], rel=1e-2, abs=1e-5)
        trained = ("conv+trained", "conv_global+trained") if r != "1" else ()
        for m in ("pca", "conv", "conv_global", *trained):
            assert set(row[m]["nrmse_per_field"]) == set(row[m]["vrmse_per_field"]) == {"activator", "inhibitor"}
            assert np.isfinite([row[m]["nrmse"], row[m]["nrmse_fields"], row[m]["vrmse_fields"]]).all(), (r, m)
        assert "skipped" in row["ours"]
    assert rows["1"]["conv"]["nrmse_fields"] < 1e-5 and rows["1"]["conv"]["vrmse_fields"] < 1e-4
    assert (rows["64"]["conv"]["patch"], rows["64"]["conv"]["latent_channels"]) == (8, 2)
    assert rows["16"]["pca"]["components"] == 32 < task["n_train_frames"]  # the comparison above happened
    table = path.with_suffix(".md").read_text()
    assert "| dr2d | 64x | 8 | 8, 2, local |" in table and "| dr2d | 64x | 8 | 8, 2, global |" in table


def test_per_field_scores_leave_out_the_frames_where_a_field_is_zero():
    """swe2d's velocities are exactly zero at t = 0: dividing by them would make the field's mean
    nRMSE a number of 1e7. The per-field means leave such frames out (and say how many); on the
    other frames and fields they are core.metrics' numbers, frame by frame."""
    from bench.codec_conv import scores
    from core.metrics import nrmse_per_step, vrmse_per_step

    gen = torch.Generator().manual_seed(0)
    frames = torch.randn(300, 2, 8, 8, generator=gen, dtype=torch.float64)  # more than a batch of frames
    rest = torch.zeros(len(frames), dtype=torch.bool)
    rest[:5] = rest[260:263] = True  # the second field at rest on eight frames, in both batches
    frames[rest, 1] = 0.0
    noise = 1e-3 * torch.randn(frames.shape, generator=gen, dtype=torch.float64)
    got = scores(_Add(noise), frames, ("h", "u"))
    per_frame = [(nrmse_per_step(r[:, :, None], t[:, :, None])[:, 0], vrmse_per_step(r[:, :, None], t[:, :, None])[:, 0])
                 for r, t in ((frames[i:i + 1] + noise[i:i + 1], frames[i:i + 1]) for i in range(len(frames)))]
    n = torch.stack([p[0] for p in per_frame])  # [N, C]
    v = torch.stack([p[1] for p in per_frame])
    assert got["frames_left_out"] == {"u": 8}
    assert got["nrmse_per_field"]["h"] == pytest.approx(n[:, 0].mean().item(), rel=1e-9)
    assert got["vrmse_per_field"]["h"] == pytest.approx(v[:, 0].mean().item(), rel=1e-9)
    assert got["nrmse_per_field"]["u"] == pytest.approx(n[~rest, 1].mean().item(), rel=1e-9)
    assert got["vrmse_per_field"]["u"] == pytest.approx(v[~rest, 1].mean().item(), rel=1e-9)
    assert n[rest, 1].min() > 1e3  # what the mean would have held


def test_the_codec_trains_on_the_number_it_is_scored_by():
    """`nrmse_loss` is core.metrics' nRMSE per frame and field, mean over each frame's fields (a
    field at rest on a frame left out, as the scores do) and then over the frames, with a finite
    gradient there: training minimises the number validation selects by and the table reports."""
    from bench.codec_conv import nrmse_loss
    from core.metrics import nrmse_per_step

    gen = torch.Generator().manual_seed(1)
    frames = torch.randn(40, 3, 8, 8, generator=gen, dtype=torch.float64)
    frames[:6, 2] = 0.0
    noise = torch.randn(frames.shape, generator=gen, dtype=torch.float64) * torch.logspace(-4, 0, 40)[:, None, None, None]
    model = _Scaled(noise)
    loss = nrmse_loss(model, frames)
    loss.backward()
    n = torch.stack([nrmse_per_step(frames[i:i + 1, :, None] + noise[i:i + 1, :, None], frames[i:i + 1, :, None])[:, 0]
                     for i in range(len(frames))])  # [N, C]
    present = torch.ones_like(n, dtype=torch.bool)
    present[:6, 2] = False
    per_frame = (n * present).sum(1) / present.sum(1)
    assert loss.item() == pytest.approx(per_frame.mean().item(), rel=1e-9)
    assert torch.isfinite(model.scale.grad).all() and model.scale.grad.item() > 0


class _Scaled(torch.nn.Module):
    """A stand-in codec: frames plus `scale` times a fixed perturbation, as (latent, field)."""

    def __init__(self, noise):
        super().__init__()
        self.noise, self.scale = noise, torch.nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, u):
        return None, u + self.scale * self.noise


class _Add:
    """A stand-in codec that adds a fixed perturbation to each frame it is given, in order."""

    def __init__(self, noise):
        self.noise, self.at = noise, 0

    def __call__(self, u):
        out = u + self.noise[self.at:self.at + len(u)]
        self.at += len(u)
        return out


def test_a_codec_correction_keeps_its_best_validated_weights_the_untrained_ones_included():
    """`bench.timed_training` (the codecs' corrections, through the product's budgeted loop): on a
    fake clock, 1 s steps for a 4 s budget, validated every 2 s; the weights kept are those of the
    lowest score, the untrained ones when they score lowest, and the steps they had taken."""
    from torch import nn

    from bench.timed_training import train_for_seconds

    now = [0.0]

    def run(scores: list[float]) -> tuple[dict, nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        start, pending, x = model.weight.detach().clone(), iter(scores), torch.randn(8, 3)

        def batch_loss() -> torch.Tensor:
            now[0] += 1.0
            return model(x).square().mean()

        return train_for_seconds(model, batch_loss, lambda: next(pending), 4.0, lr=0.1, validations=2,
                                 clock=lambda: now[0]), model, start

    info, model, start = run([0.5, 0.7, 0.9])
    assert info["steps"] == 4 and info["best_step"] == 0 and info["val_curve"] == [(0.0, 0.5), (2.0, 0.7), (4.0, 0.9)]
    assert torch.equal(model.weight, start)
    info, model, start = run([0.5, 0.2, 0.9])
    assert info["best_step"] == 2 and not torch.equal(model.weight, start)
