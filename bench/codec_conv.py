"""The convolutional codec's rows of `bench.codec`, and the per-field scores every row carries.

Legend: N frames, C field channels, S spatial axes, d spatial dimension, P patch, D latent channels.

At a compression r (field numbers C * prod(S) per latent number) the codec "conv"
(`core.models.conv_codec`) gets the patch P and latent channels D = C * P^d / r with P the first of
4, 8, 16 that divides the grid and makes D a whole number (2D: P = 4 and D = C * 16 / r up to
r = 16 C, so 1x, 4x, 16x of a 3-channel flow are D = 48, 12, 3; P = 8 beyond, so 64x is D = 3).
Rows, each scored on the test frames:

- `conv`: its linear path alone, `fit_linear` on the training frames (the PCA of the per-channel
  normalised P^d patches; exact at 1x);
- `conv+trained`: the same fit plus the learned convolutional correction (hidden width
  `--conv-hidden`, one residual block per stage) trained for `--train-s` seconds of training
  through the product's budgeted loop (`bench.timed_training`: AdamW, lr 1e-3, batch 32, the mean
  per-field nRMSE of `nrmse_loss`, gradients clipped at 1), keeping the weights of the best
  validation nRMSE, mean over the fields (the untrained codec, that is the linear path, included).
  Validation is off the clock. Not trained at 1x, where the linear path is exact.
- `conv_global`, `conv_global+trained` (``--conv-linear global``): the same with the global linear
  path (`latent.linear: global`: the PCA of whole fields in the basis closest to the local code).
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from bench.timed_training import train_for_seconds
from core.metrics import nrmse_per_step, vrmse_per_step
from core.models.conv_codec import GLOBAL_MAX_NUMBERS, conv_autoencoder, fit_linear
from core.steps.autoencoder import field_nrmse

BATCH = 256
PATCHES = (4, 8, 16)


def conv_layout(channels: int, grid: tuple[int, ...], rate: int) -> tuple[int, int] | None:
    """(patch P, latent channels D) of the conv codec at compression `rate` for this field, or
    None when no P in `PATCHES` divides the grid and gives a whole D >= 1."""
    for p in PATCHES:
        numbers = channels * p ** len(grid)
        if all(n % p == 0 for n in grid) and numbers % rate == 0 and numbers >= rate:
            return p, numbers // rate
    return None


@torch.no_grad()
def scores(reconstruct, frames: Tensor, fields: tuple[str, ...]) -> dict:
    """Scores of `reconstruct` (frames [B, C, *S] -> same shape) on `frames` [N, C, *S], batched:
    whole-frame nRMSE per frame (mean `nrmse`, `median`, `p95`, as bench.codec always reported)
    and, with core.metrics (each frame a step of one trajectory), nRMSE and VRMSE per field and
    their means over the fields (`nrmse_fields`, `vrmse_fields`). A field that is identically zero
    on a frame (swe2d's velocities at rest at t = 0) has no relative error there: its nRMSE mean
    leaves that frame out, its VRMSE mean every frame where the field is constant; `frames_left_out`
    counts the latter per field (a zero field is constant too; empty when none)."""
    per_frame = []
    n_sum = v_sum = n_count = v_count = torch.zeros(frames.shape[1], dtype=torch.float64)
    for s in range(0, len(frames), BATCH):
        true = frames[s:s + BATCH]
        rec = reconstruct(true).to(true.dtype)
        err = (rec - true).flatten(1).double().square().mean(1).sqrt()
        per_frame.append(err / true.flatten(1).double().square().mean(1).sqrt().clamp_min(1e-30))
        pair = rec.transpose(0, 1).unsqueeze(0).double(), true.transpose(0, 1).unsqueeze(0).double()  # [1, C, B, *S]
        field_CB = true.transpose(0, 1).flatten(2).double()
        has_norm, has_var = field_CB.square().sum(-1) > 0, field_CB.var(-1, unbiased=False) > 0
        n_sum = n_sum + nrmse_per_step(*pair).where(has_norm, 0).sum(1)
        v_sum = v_sum + vrmse_per_step(*pair).where(has_var, 0).sum(1)
        n_count, v_count = n_count + has_norm.sum(1), v_count + has_var.sum(1)
    per_frame = torch.cat(per_frame)
    nrmse_c, vrmse_c = n_sum / n_count, v_sum / v_count
    left_out = {f: int(len(frames) - v) for f, v in zip(fields, v_count.tolist(), strict=True) if v < len(frames)}
    return {"nrmse": per_frame.mean().item(), "median": per_frame.median().item(),
            "p95": per_frame.quantile(0.95).item(),
            "nrmse_fields": nrmse_c.mean().item(), "vrmse_fields": vrmse_c.mean().item(),
            "nrmse_per_field": dict(zip(fields, nrmse_c.tolist(), strict=True)),
            "vrmse_per_field": dict(zip(fields, vrmse_c.tolist(), strict=True)),
            "frames_left_out": left_out}


class ChannelPCA:
    """PCA of whole frames in per-channel normalised units (each channel's mean and standard
    deviation over the training frames and points, as the conv codec normalises), so that a
    small-valued field weighs as much as a large one; with one channel it is the plain PCA."""

    def __init__(self, train: Tensor) -> None:
        x = train.double().transpose(0, 1).flatten(1)  # [C, N * prod(S)]
        self.shape = (1, train.shape[1], *[1] * (train.ndim - 2))
        self.mean_c = x.mean(1).reshape(self.shape)
        self.std_c = x.std(1).clamp_min(1e-12).reshape(self.shape)
        y = self._flat(train)
        self.mean = y.mean(0)
        _, vectors = torch.linalg.eigh((y - self.mean).T @ (y - self.mean) / len(y))
        self.vectors = vectors.flip(-1)  # descending

    def _flat(self, u: Tensor) -> Tensor:
        return ((u.double() - self.mean_c) / self.std_c).flatten(1)

    def reconstructor(self, k: int):
        """frames [B, C, *S] -> their projection on the top-k components, in field units."""
        v = self.vectors[:, :k]

        def rec(u: Tensor) -> Tensor:
            y = (self._flat(u) - self.mean) @ v @ v.T + self.mean
            return y.reshape(u.shape) * self.std_c + self.mean_c
        return rec


def nrmse_loss(model, u: Tensor) -> Tensor:
    """The codec's training loss on frames u [B, C, *S]: the reconstruction's nRMSE per frame and
    field, mean over the frame's fields and then the frames (`core.steps.autoencoder.field_nrmse`,
    the pipeline's `autoencoder.loss: nrmse`); a scalar with gradients.

    Not squared, and per frame: the table's number weighs each frame's relative error alike.
    Trained 150 s with AdamW on the normalised MSE, the 64x codec of 2D Navier-Stokes did not move
    from PCA (test MSE 3.250e-4 before and after; the same with AdamW's eps at 1e-16, or with the
    loss x 1e4 and no clipping; its gradient norms are heavy-tailed, the largest 70x the median);
    this loss halved the MSE (1.6e-4) and took the mean nRMSE to 0.81x in the same time
    (`bench/results/cpu-2core-2026-11-27-codec-ns2d-t0-floor-notes.md`)."""
    return field_nrmse(model(u)[1], u).mean()


def train_conv(model, train: Tensor, val: Tensor, seconds: float, *, lr: float = 1e-3, batch: int = 32,
               seed: int = 0) -> dict:
    """Train the codec's learned correction for `seconds` of training (`bench.timed_training`); keeps the weights of the
    best validation nRMSE, mean over the fields (step 0, the linear path, included), checked 8
    times over the budget. Returns {"steps", "best_step", "val_curve": [(seconds, val nRMSE)]}."""
    g = torch.Generator().manual_seed(seed)

    def val_score() -> float:
        model.eval()
        fields = tuple(range(val.shape[1]))
        return scores(lambda u: model(u)[1], val, fields)["nrmse_fields"]

    def batch_loss() -> Tensor:
        model.train()
        return nrmse_loss(model, train[torch.randint(0, len(train), (batch,), generator=g)])

    return train_for_seconds(model, batch_loss, val_score, seconds, lr=lr, validations=8)


ROW_NAMES = {"local": "conv", "global": "conv_global"}
"""The rows of each linear-path scope: ``<name>`` (linear path) and ``<name>+trained``."""


def conv_rows(train: Tensor, val: Tensor, test: Tensor, rate: int, fields: tuple[str, ...], *, train_s: float,
              hidden: int, seed: int, linear: str = "local") -> dict:
    """{name: ..., name+trained: ...} at compression `rate` for the linear path's scope `linear`
    ("local": name "conv"; "global": "conv_global", `ROW_NAMES`), the trained row only when
    `train_s` > 0 and the rate is above 1; {name: {"skipped": why}} when no layout fits (or the
    field is too large for a global path)."""
    name = ROW_NAMES[linear]
    channels, grid = train.shape[1], tuple(train.shape[2:])
    chosen = conv_layout(channels, grid, rate)
    if chosen is None:
        return {name: {"skipped": f"no patch in {PATCHES} gives {channels} x {grid} a whole latent at {rate}x"}}
    patch, dim = chosen
    if linear == "global" and channels * math.prod(grid) > GLOBAL_MAX_NUMBERS:
        return {name: {"skipped": f"{channels} x {grid} is more than {GLOBAL_MAX_NUMBERS} numbers"}}
    layout = {"patch": patch, "latent_channels": dim, "tokens": math.prod(n // patch for n in grid), "linear": linear}
    scope = {"linear": linear, "grid": grid if linear == "global" else None}
    batches = lambda: (train[s:s + 1024] for s in range(0, len(train), 1024))  # noqa: E731
    codec = conv_autoencoder(channels, len(grid), patch, dim, hidden=0, **scope)
    t0 = time.perf_counter()
    captured = fit_linear(codec, batches())
    rows = {name: {**scores(lambda u: codec(u)[1], test, fields), **layout, "captured_variance": captured,
                   "fit_s": time.perf_counter() - t0}}
    if train_s > 0 and dim < channels * patch ** len(grid):
        with torch.random.fork_rng():  # parameter init draws from the global RNG; keep it local
            torch.manual_seed(seed)
            model = conv_autoencoder(channels, len(grid), patch, dim, hidden=hidden, blocks=1, **scope)
        # The linear path fitted above, not fitted again (a 64 x 64 x 3 global fit is minutes):
        # every buffer of the parameter-free codec is one of the model's, the trunk is what it lacks.
        missing, unexpected = model.load_state_dict(codec.state_dict(), strict=False)
        assert not unexpected and all(".trunk." in k for k in missing), (missing, unexpected)
        info = train_conv(model, train, val, train_s, seed=seed)
        model.eval()
        rows[f"{name}+trained"] = {**scores(lambda u: model(u)[1], test, fields), **layout, "hidden": hidden,
                                   "train_s": train_s, **info}
    return rows


def conv_table(result: dict) -> str:
    """Markdown: per task, compression and linear-path scope the mean per-field nRMSE of the conv
    codec's linear path, trained, and the channel-normalised PCA of the same latent size, then
    VRMSE per field."""
    lines = ["| task | compression | latent numbers | P, D, linear | nRMSE conv (linear) | nRMSE conv+trained "
             "| nRMSE pca | trained / pca | VRMSE per field: conv, trained where it was (pca) |", "|" + "---|" * 9]
    for key, t in result["tasks"].items():
        for r, row in t["ratios"].items():
            for name in ROW_NAMES.values():
                if name in row:
                    lines.append(_conv_line(key, r, row, name))
    return "\n".join(lines)


def _conv_line(key: str, r: str, row: dict, name: str) -> str:
    conv, trained, pca = row[name], row.get(f"{name}+trained", {}), row["pca"]
    if "nrmse" not in conv:
        return f"| {key} | {r}x | {row['latent_numbers']} | - | {conv.get('skipped', '-')} | - | - | - | - |"
    best = trained or conv
    ratio = f"{best['nrmse_fields'] / pca['nrmse_fields']:.3f}" if trained else "-"  # 1x: both exact
    vr = ", ".join(f"{f} {v:.3e} ({pca['vrmse_per_field'][f]:.3e})" for f, v in best["vrmse_per_field"].items())
    trained_cell = f"{trained['nrmse_fields']:.3e}" if trained else "-"
    return (f"| {key} | {r}x | {row['latent_numbers']} | {conv['patch']}, {conv['latent_channels']}, "
            f"{conv.get('linear', 'local')} | {conv['nrmse_fields']:.3e} | {trained_cell} | {pca['nrmse_fields']:.3e} "
            f"| {ratio} | {vr} |")
