"""PDEBench error metrics on decoded fields, written from its definitions.

Layout: every field is ``[B, C, T, *S]`` = batch, channel, time step, then 1, 2 or 3
spatial axes (``[B, C, T, X]`` for 1D tasks, ``[B, C, T, H, W]`` for 2D ones, ``[B, C, T, X, Y, Z]``
for 3D ones). A steady
task (Darcy) uses ``T = 1``. Every per-step metric returns ``[C, T]``.

The definitions follow ``metric_func`` in pdebench/PDEBench ``pdebench/models/metrics.py``
(which uses ``[B, *S, T, C]``):

- rmse: per sample, channel and step the RMS error over space; mean over the batch.
- nrmse: that RMS error divided by the RMS of the target over space; mean over the batch.
  PDEBench divides without a guard; we add ``NRMSE_EPS`` so an all-zero target gives a large
  finite number instead of inf/nan.
- vrmse (The Well's ``VRMSE``, ``the_well/benchmark/metrics/spatial.py``): the RMS error divided
  by the target's standard deviation over space, ``sqrt(mse / (var + 1e-7))``; mean over the batch.
- crmse (PDEBench ``err_CSV``): error of the spatial mean (the conserved quantity), RMS
  over the batch.
- max_error (``err_Max``): largest absolute error over space and the whole batch.
- brmse (``err_BD``): RMS error over the boundary points (1D: the two end points; 2D: the
  four edges, 3D: the six faces, points on several faces counted once per face as PDEBench
  does); mean over the batch.
- frmse_low/mid/high (``err_F``): error in radial wavenumber bands ``|k| < i_low``,
  ``i_low <= |k| < i_high``, ``|k| >= i_high`` (PDEBench: iLow=4, iHigh=12), RMS over batch.
  Deviation, on purpose: PDEBench averages per-bin amplitudes over the bins of a band and
  drops the 2D corner modes, so its bands do not add up to anything. Ours are the band
  parts of the error energy, so ``low**2 + mid**2 + high**2 == mean_b(rmse_b**2)``
  (Parseval) and the bands read on the same scale as rmse.

Summaries average the ``[C, T]`` values over channels and over the predicted steps
``t >= given_steps``. PDEBench scored the given initial steps too (its issue #41); that
convention is ``nrmse_pdebench2022``, kept for comparison with the published tables.
"""

from __future__ import annotations

import torch
from torch import Tensor

RECONSTRUCTION_LOSSES = ("squared_relative", "nrmse", "mse")
"""The codec's reconstruction losses (`core.steps.autoencoder.AutoencoderStepConfig.loss`), named here,
where the config reads them without loading the training steps."""

# Guards the nRMSE denominator against an all-zero target; tiny next to any real field.
NRMSE_EPS = 1e-12
# The Well's VRMSE guard (its metrics add 1e-7 to the variance): a constant target frame scores
# its RMS error / 3e-4 instead of inf.
_VAR_EPS = 1e-7
I_LOW = 4
I_HIGH = 12


def checked_pair(pred: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Two fields of one ``[B, C, T, *S]`` shape (1 to 3 spatial axes, not empty), promoted to at
    least float32. ValueError naming the shapes otherwise."""
    if pred.shape != target.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
    if pred.ndim not in (4, 5, 6):
        raise ValueError(f"expected [B, C, T, *S] with 1, 2 or 3 spatial axes, got {tuple(pred.shape)}")
    if pred.numel() == 0:
        raise ValueError(f"empty field {tuple(pred.shape)}")
    # Half precision loses digits in the squared sums; metrics are never the bottleneck.
    dtype = torch.promote_types(torch.promote_types(pred.dtype, target.dtype), torch.float32)
    return pred.to(dtype), target.to(dtype)


def flat_space(u: Tensor) -> Tensor:
    """[B, C, T, *S] -> [B, C, T, N] with N = prod(S)."""
    return u.flatten(start_dim=3)


def rmse(pred: Tensor, target: Tensor) -> Tensor:
    """RMS error over space, mean over batch. [B, C, T, *S] -> [C, T]."""
    pred, target = checked_pair(pred, target)
    err_BCT = flat_space(pred - target).square().mean(-1).sqrt()
    return err_BCT.mean(0)


def nrmse_per_step(pred: Tensor, target: Tensor) -> Tensor:
    """RMS error over space / (RMS target over space + eps), mean over batch. -> [C, T]."""
    pred, target = checked_pair(pred, target)
    err_BCT = flat_space(pred - target).square().mean(-1).sqrt()
    norm_BCT = flat_space(target).square().mean(-1).sqrt()
    return (err_BCT / (norm_BCT + NRMSE_EPS)).mean(0)


def vrmse_per_step(pred: Tensor, target: Tensor) -> Tensor:
    """The Well's VRMSE: RMS error over space / sqrt(variance of the target over space + eps),
    mean over batch. -> [C, T]. Unlike nRMSE it does not reward a field's mean: a prediction equal
    to the target's spatial mean scores 1 whatever that mean is."""
    pred, target = checked_pair(pred, target)
    err_BCT = flat_space(pred - target).square().mean(-1)
    var_BCT = flat_space(target).var(-1, unbiased=False)
    return (err_BCT / (var_BCT + _VAR_EPS)).sqrt().mean(0)


def check_given_steps(given_steps: int, num_steps: int) -> None:
    """ValueError unless ``0 <= given_steps < num_steps``: some step must be predicted."""
    if not 0 <= given_steps < num_steps:
        raise ValueError(f"given_steps={given_steps} must lie in [0, T={num_steps})")


def nrmse(pred: Tensor, target: Tensor, *, given_steps: int = 0) -> Tensor:
    """nRMSE averaged over channels and the predicted steps ``t >= given_steps``. -> []."""
    check_given_steps(given_steps, pred.shape[2])
    return nrmse_per_step(pred, target)[:, given_steps:].mean()


def nrmse_pdebench2022(pred: Tensor, target: Tensor) -> Tensor:
    """nRMSE averaged over channels and ALL steps, the given ones included. -> [].

    This is how PDEBench's 2022 tables were scored: the rollout copied the given initial
    steps into the prediction, so they enter the mean with zero error and pull it down
    (about 0.76x for 1D tasks with 10 of 41 steps given). For comparison only.
    """
    return nrmse_per_step(pred, target).mean()


def max_error(pred: Tensor, target: Tensor) -> Tensor:
    """Largest absolute error over space and batch (PDEBench takes the worst case). -> [C, T]."""
    pred, target = checked_pair(pred, target)
    return flat_space(pred - target).abs().amax(dim=(0, 3))


def crmse(pred: Tensor, target: Tensor) -> Tensor:
    """Error of the spatial mean (conserved quantity), RMS over batch. -> [C, T]."""
    pred, target = checked_pair(pred, target)
    diff_BCT = flat_space(pred).mean(-1) - flat_space(target).mean(-1)
    return diff_BCT.square().mean(0).sqrt()


def brmse(pred: Tensor, target: Tensor) -> Tensor:
    """RMS error over the domain boundary, mean over batch. -> [C, T].

    The two faces of every spatial axis (1D: the end points; 2D: the rows ``h = 0, H-1`` and
    columns ``w = 0, W-1``; 3D: six planes), summed and divided by the number of face points
    (2, ``2H + 2W``, ``2XY + 2YZ + 2ZX``); edges and corners count once per face, as in PDEBench.
    """
    pred, target = checked_pair(pred, target)
    sq_BCTS = (pred - target).square()
    total, points = 0, 0
    for axis in range(3, sq_BCTS.ndim):
        for index in (0, -1):
            face = sq_BCTS.select(axis, index)
            total = total + (face.flatten(3).sum(-1) if face.ndim > 3 else face)
            points += face[0, 0, 0].numel()
    return (total / points).sqrt().mean(0)


def radial_wavenumber(spatial: tuple[int, ...], device: torch.device) -> Tensor:
    """|k| on the full FFT grid (integer wavenumbers, negative ones included). -> [*S]."""
    ks = [torch.fft.fftfreq(n, d=1.0 / n, device=device) for n in spatial]
    grids = torch.meshgrid(*ks, indexing="ij")
    return torch.stack(grids).square().sum(0).sqrt()


def fourier_band_mse(
    pred: Tensor, target: Tensor, *, i_low: int = I_LOW, i_high: int = I_HIGH
) -> Tensor:
    """Per-sample error energy in the low/mid/high wavenumber bands. -> [B, C, T, 3].

    With E = fftn(error) over the N spatial points, Parseval gives
    ``mean_x |e|^2 = sum_k |E_k|^2 / N^2``; each band takes its share of that sum, so the
    three values add up to the per-sample MSE exactly.
    """
    if not 0 < i_low <= i_high:
        raise ValueError(f"need 0 < i_low <= i_high, got i_low={i_low}, i_high={i_high}")
    pred, target = checked_pair(pred, target)
    spatial = tuple(pred.shape[3:])
    n = pred[0, 0, 0].numel()
    dims = tuple(range(3, pred.ndim))
    power = torch.fft.fftn(pred - target, dim=dims).abs().square() / (n * n)
    k = radial_wavenumber(spatial, pred.device)
    masks = torch.stack([k < i_low, (k >= i_low) & (k < i_high), k >= i_high])  # [3, *S]
    power_BCTN = flat_space(power)
    return torch.einsum("bctn,jn->bctj", power_BCTN, masks.flatten(1).to(power.dtype))


def frmse(
    pred: Tensor, target: Tensor, *, i_low: int = I_LOW, i_high: int = I_HIGH
) -> Tensor:
    """Band RMS error, RMS over the batch as PDEBench does. -> [3, C, T] (low, mid, high)."""
    band_BCTJ = fourier_band_mse(pred, target, i_low=i_low, i_high=i_high)
    return band_BCTJ.mean(0).sqrt().permute(2, 0, 1)


def pdebench_metrics(pred: Tensor, target: Tensor, *, given_steps: int = 0) -> dict[str, Tensor]:
    """All PDEBench metrics for one batch of rollouts.

    Args:
        pred, target: [B, C, T, *S]; the first ``given_steps`` steps are the given ones.
        given_steps: number of initial steps handed to the model, not predicted.

    Returns:
        ``rmse, nrmse, vrmse, max_error, crmse, brmse, frmse_low, frmse_mid, frmse_high``: [C, T]
        over all steps; ``<name>_mean``: [] over channels and steps ``t >= given_steps``;
        ``nrmse_pdebench2022``: [] over all steps (the 2022 tables' convention).
    """
    checked_pair(pred, target)
    check_given_steps(given_steps, pred.shape[2])
    low, mid, high = frmse(pred, target)
    per_step = {
        "rmse": rmse(pred, target),
        "nrmse": nrmse_per_step(pred, target),
        "vrmse": vrmse_per_step(pred, target),
        "max_error": max_error(pred, target),
        "crmse": crmse(pred, target),
        "brmse": brmse(pred, target),
        "frmse_low": low,
        "frmse_mid": mid,
        "frmse_high": high,
    }
    out = dict(per_step)
    for name, value_CT in per_step.items():
        out[f"{name}_mean"] = value_CT[:, given_steps:].mean()
    out["nrmse_pdebench2022"] = per_step["nrmse"].mean()
    return out
