"""Scores for long chaotic rollouts and ensembles: lead-time windows, correlation time, energy
spectra, CRPS and spread-skill.

Legend: K ensemble members, B batch, C channel, T time step, S 1 to 3 spatial axes (N points),
R radial wavenumber shells. A field is ``[B, C, T, *S]`` as in ``core.metrics``; an ensemble is
``[K, B, C, T, *S]``, members first, so ``members[k]`` is one ordinary rollout and
``members.mean(0)`` the ensemble mean. Per-step scores return ``[C, T]``.

Ensemble-mean scores need no function here: they are the ``core.metrics`` scores of the mean,
e.g. ``metrics.vrmse_per_step(members.mean(0), target)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from core.metrics import NRMSE_EPS, check_given_steps, checked_pair, flat_space, radial_wavenumber

# spectrum_error adds this share of the target's total energy to every shell of both spectra, so
# shells fainter than it are swamped in both and count as about equal. It sits above float32
# round-off (amplitude ~1e-7 relative, energy ~1e-14), which would otherwise set the log error of
# a smooth field's far tail.
_SPECTRUM_FLOOR = 1e-10


# ---------------------------------------------------------------- lead-time windows
def lead_time_windows(num_steps: int, edges: Sequence[int] = (10, 30)) -> list[tuple[int, int]]:
    """Split ``num_steps`` predicted steps into lead-time windows ending at ``edges``.

    Reporting a rollout score per window of lead times follows The Well's rollout tables
    (VRMSE averaged over steps 6:12 and 13:30): one mean over a long chaotic rollout hides
    whether a model is good early and saturates late, or the other way round.

    Args:
        num_steps: number of predicted steps (the given ones excluded), >= 0.
        edges: strictly increasing positive lead times (1-based) at which a window ends; edges at
            or past ``num_steps`` are dropped and the last window runs to ``num_steps``.

    Returns:
        Half-open index ranges into the predicted steps, e.g. ``[(0, 10), (10, 30), (30, 64)]``
        for 64 steps; they cover every step exactly once, in order (``[]`` for 0 steps).
        ``windowed`` names them by 1-based lead time: "1-10", "11-30", "31-64".
    """
    if not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f"num_steps must be an int >= 0, got {num_steps!r}")
    edges = tuple(edges)
    if any(not isinstance(e, int) or e <= 0 for e in edges) or any(
        b <= a for a, b in zip(edges, edges[1:])
    ):
        raise ValueError(f"edges must be strictly increasing positive ints, got {edges}")
    bounds = [0, *(e for e in edges if e < num_steps), num_steps]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def windowed(
    per_step_CT: Tensor, windows: Sequence[tuple[int, int]], *, given_steps: int = 0
) -> dict[str, Tensor]:
    """Average a per-step metric over lead-time windows.

    Args:
        per_step_CT: [C, T] metric over all steps (given ones included, as ``core.metrics`` returns).
        windows: half-open ranges into the predicted steps (``lead_time_windows``).
        given_steps: leading steps of ``per_step_CT`` that were given, not predicted; skipped.

    Returns:
        ``{"1-10": [C], "11-30": [C], ...}``: the mean over each window's steps, named by
        1-based lead time (first and last predicted step of the window).
    """
    if per_step_CT.ndim != 2:
        raise ValueError(f"expected a [C, T] metric, got {tuple(per_step_CT.shape)}")
    check_given_steps(given_steps, per_step_CT.shape[1])
    predicted_CT = per_step_CT[:, given_steps:]
    out = {}
    for start, end in windows:
        if not 0 <= start < end <= predicted_CT.shape[1]:
            raise ValueError(
                f"window ({start}, {end}) is not inside the {predicted_CT.shape[1]} predicted steps "
                f"of a metric of shape {tuple(per_step_CT.shape)} with given_steps={given_steps}"
            )
        out[f"{start + 1}-{end}"] = predicted_CT[:, start:end].mean(1)
    return out


# ---------------------------------------------------------------- correlation time
def correlation_per_step(pred: Tensor, target: Tensor) -> Tensor:
    """Pearson correlation over space of prediction and truth, per sample, channel and step.

    Args:
        pred, target: [B, C, T, *S].

    Returns:
        [B, C, T] in [-1, 1]. A spatially constant field has no defined correlation and scores 0
        (decorrelated). NaN inputs give NaN.
    """
    pred, target = checked_pair(pred, target)
    p_BCTN = flat_space(pred)
    q_BCTN = flat_space(target)
    p_BCTN = p_BCTN - p_BCTN.mean(-1, keepdim=True)
    q_BCTN = q_BCTN - q_BCTN.mean(-1, keepdim=True)
    cov_BCT = (p_BCTN * q_BCTN).mean(-1)
    norm_BCT = (p_BCTN.square().mean(-1) * q_BCTN.square().mean(-1)).sqrt()
    # Clamp at the smallest normal number, not add an epsilon: correlation is scale-free, and an
    # additive guard would shrink it for small-amplitude fields. A zero variance gives 0 / tiny = 0.
    return cov_BCT / norm_BCT.clamp_min(torch.finfo(norm_BCT.dtype).tiny)


def correlation_time(
    pred: Tensor, target: Tensor, *, threshold: float = 0.8, given_steps: int = 0
) -> Tensor:
    """Number of predicted steps before the correlation with the truth first drops below threshold.

    PDE-Refiner (Lippe et al. 2023) scores long Kuramoto-Sivashinsky rollouts by the time until
    the Pearson correlation of prediction and truth drops below 0.8. With one channel this is that
    score, in steps (multiply by the step's dt for physical time). With several channels we average
    the per-channel correlations at each step: pooling the channels into one vector would count
    their different means (density ~1, velocity ~0) as agreement.

    Args:
        pred, target: [B, C, T, *S]; the first ``given_steps`` steps are the given ones.
        threshold: a step whose correlation is ``< threshold`` (or NaN, a diverged rollout) ends it.
        given_steps: leading steps not predicted; not counted.

    Returns:
        [B] float (integer-valued): the 0-based index, among predicted steps, of the first step
        below the threshold, i.e. how many predicted steps stay at or above it; a rollout that
        never drops below counts its full length ``T - given_steps``. Later recoveries do not
        count. ``.mean()`` gives the batch mean.
    """
    if not -1.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must lie in [-1, 1], got {threshold}")
    corr_BCT = correlation_per_step(pred, target)
    check_given_steps(given_steps, corr_BCT.shape[2])
    corr_BT = corr_BCT[:, :, given_steps:].mean(1)
    # `>=` is False for NaN, so a diverged step counts as decorrelated; the running product is 1
    # up to the first failing step and 0 from there on, so its sum counts the leading good steps.
    good_BT = (corr_BT >= threshold).to(corr_BT.dtype)
    return good_BT.cumprod(1).sum(1)


# ---------------------------------------------------------------- energy spectrum
def radial_energy_spectrum(u: Tensor) -> Tensor:
    """Shell-summed energy spectrum over the spatial axes (1D, 2D or 3D).

    Integer wavenumber shells as in turbulence practice: mode ``k`` (integer mode indices,
    negative ones included) goes to shell ``round(|k|)``. Normalisation: with ``U = fftn(u)`` over
    the N points, shell r holds ``sum |U_k|^2 / N^2``, so by Parseval the shells add up to the
    spatial mean of ``u^2`` per channel (no 1/2: kinetic energy is half the sum over velocity
    channels). All shells are kept, the partly filled corner shells above ``min(S) // 2`` too, so
    that sum is exact. The shells are physical wavenumbers only where every axis spans the same
    length.

    Args:
        u: [B, C, T, *S].

    Returns:
        [B, C, T, R] with R = round(sqrt(sum_i (S_i // 2)^2)) + 1 shells, shell 0 the mean.
    """
    u, _ = checked_pair(u, u)
    spatial = tuple(u.shape[3:])
    n = math.prod(spatial)
    power = torch.fft.fftn(u, dim=tuple(range(3, u.ndim))).abs().square() / (n * n)
    shell_N = radial_wavenumber(spatial, u.device).round().long().flatten()
    # The largest |k| is at the corner (S_i // 2 on every axis); computed here instead of
    # shell_N.max() so a GPU tensor needs no host sync. |k|^2 is an integer, never a tie.
    num_shells = round(math.sqrt(sum((s // 2) ** 2 for s in spatial))) + 1
    out_BCTR = power.new_zeros(*u.shape[:3], num_shells)
    return out_BCTR.index_add_(-1, shell_N, flat_space(power))


def spectrum_error(pred: Tensor, target: Tensor, *, step: int = -1) -> Tensor:
    """Mean absolute log ratio of the batch-mean energy spectra at one step, per channel.

    ``mean_r |ln(E_pred(r) / E_target(r))|`` over shells ``1 <= r <= min(S) // 2`` (the mean, shell
    0, is crmse's business; shells past that are only partly filled). Why the log: spectra span
    decades, and a relative L1 error ``sum |E_p - E_t| / sum E_t`` is set by the few energetic
    low shells, blind to the high-k energy a surrogate smooths away (spectral bias); the log
    weighs a factor 2 at any scale the same, and for small errors reads as a relative error
    (0.05 = 5%). Why batch means first: a spectrum is a statistic of the state, and a chaotic
    rollout should keep it long after its phases have decorrelated from the truth; a 1D shell
    holds two modes, so per-sample spectra are noise. Shells below ``_SPECTRUM_FLOOR`` times the
    target's energy count as equal (both floored).

    Args:
        pred, target: [B, C, T, *S] with at least 2 points on every spatial axis.
        step: the time step compared (Python indexing; default the last).

    Returns:
        [C], 0 for identical spectra; a prediction scaled by a scores ``2 |ln a|``.
    """
    pred, target = checked_pair(pred, target)
    num_steps = pred.shape[2]
    if not -num_steps <= step < num_steps:
        raise ValueError(f"step={step} is outside the T={num_steps} steps of {tuple(pred.shape)}")
    k_max = min(pred.shape[3:]) // 2
    if k_max < 1:
        raise ValueError(f"need >= 2 points on every spatial axis, got {tuple(pred.shape)}")
    e_pred_CR = radial_energy_spectrum(pred[:, :, [step]]).mean(0)[:, 0]
    e_true_CR = radial_energy_spectrum(target[:, :, [step]]).mean(0)[:, 0]
    return spectra_log_error(e_pred_CR, e_true_CR, k_max)


def spectra_log_error(e_pred_CR: Tensor, e_true_CR: Tensor, k_max: int) -> Tensor:
    """`spectrum_error` of two spectra already averaged over samples, [C, R] each, over shells 1 to
    ``k_max`` (``min(S) // 2``). -> [C]. An evaluation that sums spectra over batches and ranks
    calls this once at the end."""
    # tiny keeps an all-zero target finite (0 / 0 would be nan).
    floor_C1 = _SPECTRUM_FLOOR * e_true_CR.sum(-1, keepdim=True) + torch.finfo(e_true_CR.dtype).tiny
    log_ratio_CR = ((e_pred_CR + floor_C1) / (e_true_CR + floor_C1)).log()
    return log_ratio_CR[:, 1 : k_max + 1].abs().mean(-1)


# ---------------------------------------------------------------- ensembles
def _check_ensemble(members: Tensor, target: Tensor, *, min_members: int) -> tuple[Tensor, Tensor]:
    if members.ndim != target.ndim + 1 or members.shape[1:] != target.shape:
        raise ValueError(
            f"members {tuple(members.shape)} must be [K, *target.shape] for target {tuple(target.shape)}"
        )
    if members.shape[0] < min_members:
        raise ValueError(f"need K >= {min_members} members, got members {tuple(members.shape)}")
    _, target = checked_pair(members[0], target)  # the [B, C, T, *S] layout and dtype promotion
    return members.to(target.dtype), target


def crps_ensemble(members: Tensor, target: Tensor) -> Tensor:
    """Fair (unbiased) CRPS of a K-member ensemble, per point, averaged over space and batch.

    ``CRPS = mean_i |X_i - y| - 1 / (2 K (K - 1)) sum_{i,j} |X_i - X_j|`` (Ferro 2014, "fair"
    scores; WeatherBench 2's unbiased CRPS). Dividing the spread term by K (K - 1) instead of K^2
    makes it an unbiased estimate of the CRPS of the distribution the members are drawn from, so
    small ensembles are not penalised for their size. K = 1 has no spread term: the score is the
    mean absolute error, the CRPS of a point forecast.

    Args:
        members: [K, B, C, T, *S], K >= 1.
        target: [B, C, T, *S].

    Returns:
        [C, T], in the field's units (lower is better).
    """
    members, target = _check_ensemble(members, target, min_members=1)
    k = members.shape[0]
    crps = (members - target).abs().mean(0)
    if k > 1:
        # For members sorted ascending, sum_{i,j} |x_i - x_j| = 2 sum_i (2i - K - 1) x_(i)
        # (i 1-based): O(K log K) and K copies of the field instead of K^2 pairs.
        rank_K = torch.arange(1, k + 1, dtype=members.dtype, device=members.device)
        weight_K = (2 * rank_K - k - 1).view(k, *([1] * target.ndim))
        pair_sum = 2 * (weight_K * members.sort(0).values).sum(0)
        crps = crps - pair_sum / (2 * k * (k - 1))
    return flat_space(crps).mean(-1).mean(0)


def spread_skill_ratio(members: Tensor, target: Tensor) -> Tensor:
    """Ensemble spread over the RMSE of the ensemble mean, finite-ensemble corrected; 1 = calibrated.

    ``sqrt((K + 1) / K) * sqrt(mean var_k(X)) / sqrt(mean (mean_k X - y)^2)``, the means over
    space and batch (squared units pooled before the square roots, so noisy per-sample ratios do
    not bias it), ``var_k`` the unbiased variance over members. For members and truth drawn from
    one distribution the squared error of the K-member mean is (K + 1) / K times the variance
    (Fortin et al. 2014, "Why should ensemble spread match the RMSE of the ensemble mean?"); the
    factor removes that, so a calibrated ensemble scores 1 at any K. Below 1: overconfident.

    Args:
        members: [K, B, C, T, *S], K >= 2 (one member has no spread).
        target: [B, C, T, *S].

    Returns:
        [C, T].
    """
    members, target = _check_ensemble(members, target, min_members=2)
    k = members.shape[0]
    spread_CT = flat_space(members.var(0, correction=1)).mean(-1).mean(0).sqrt()
    skill_CT = flat_space((members.mean(0) - target).square()).mean(-1).mean(0).sqrt()
    return math.sqrt((k + 1) / k) * spread_CT / (skill_CT + NRMSE_EPS)
