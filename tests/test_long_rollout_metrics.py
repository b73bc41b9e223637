"""Tests for core.long_rollout: lead-time windows, correlation time, radial spectra, CRPS, spread-skill.

Exact cases are built so the answer is known without the code under test: orthogonal Fourier
modes give a chosen Pearson correlation, a single mode puts its energy in one shell, the CRPS of a
Gaussian has a closed form, and brute-force pairwise sums check the sorted CRPS formula.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core import long_rollout as lr


def _rand(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------- windows
def test_default_windows_and_names():
    windows = lr.lead_time_windows(64)
    assert windows == [(0, 10), (10, 30), (30, 64)]
    per_step_CT = torch.arange(64.0).repeat(2, 1)
    out = lr.windowed(per_step_CT, windows)
    assert list(out) == ["1-10", "11-30", "31-64"]
    assert out["1-10"].tolist() == [4.5, 4.5]  # mean of 0..9
    assert out["31-64"].tolist() == [46.5, 46.5]  # mean of 30..63
    assert lr.lead_time_windows(20) == [(0, 10), (10, 20)]
    assert lr.lead_time_windows(10) == [(0, 10)]
    assert lr.lead_time_windows(3) == [(0, 3)]
    assert lr.lead_time_windows(0) == []


def test_windowed_skips_given_steps():
    per_step_CT = torch.tensor([[0.0, 0.0, 1.0, 2.0, 3.0, 4.0]])  # 2 given, 4 predicted
    out = lr.windowed(per_step_CT, lr.lead_time_windows(4, edges=(1,)), given_steps=2)
    assert {name: v.item() for name, v in out.items()} == {"1-1": 1.0, "2-4": 3.0}


@settings(max_examples=60, deadline=None)
@given(
    num_steps=st.integers(0, 120),
    edges=st.lists(st.integers(1, 150), max_size=5, unique=True).map(sorted),
)
def test_windows_cover_every_step_exactly_once(num_steps, edges):
    windows = lr.lead_time_windows(num_steps, edges)
    covered = [t for start, end in windows for t in range(start, end)]
    assert covered == list(range(num_steps))
    assert all(end in edges or end == num_steps for _, end in windows)


def test_bad_windows_raise():
    with pytest.raises(ValueError, match="strictly increasing"):
        lr.lead_time_windows(10, edges=(5, 5))
    with pytest.raises(ValueError, match="strictly increasing"):
        lr.lead_time_windows(10, edges=(0, 5))
    with pytest.raises(ValueError, match="num_steps"):
        lr.lead_time_windows(-1)
    with pytest.raises(ValueError, match=r"\(1, 6\)"):
        lr.windowed(torch.zeros(1, 6), [(0, 5)], given_steps=2)
    with pytest.raises(ValueError, match=r"\[C, T\].*\(6,\)"):
        lr.windowed(torch.zeros(6), [(0, 5)])


# ---------------------------------------------------------------- correlation time
def _with_correlation(corr_T, n=16):
    """target [1, 1, T, n] and a pred whose Pearson correlation with it is corr_T[t] exactly.

    cos and sin modes are zero-mean, orthogonal and of equal norm, so
    corr(cos, cos + a sin) = 1 / sqrt(1 + a^2); a = sqrt(1 / c^2 - 1) gives correlation c.
    """
    x = torch.arange(n, dtype=torch.float64) * 2 * math.pi / n
    target = x.cos().expand(len(corr_T), n)
    a_T1 = torch.tensor([math.sqrt(1 / c**2 - 1) for c in corr_T], dtype=torch.float64)[:, None]
    pred = target + a_T1 * x.sin()
    return pred[None, None], target[None, None].clone()


def test_correlation_of_constructed_fields_is_exact():
    corr_T = [1.0, 0.95, 0.85, 0.6]
    pred, target = _with_correlation(corr_T)
    assert lr.correlation_per_step(pred, target)[0, 0].tolist() == pytest.approx(corr_T, abs=1e-12)
    # Pearson, not cosine similarity: an affine change of the prediction keeps it.
    affine = lr.correlation_per_step(3 * pred + 5, target)
    assert affine[0, 0].tolist() == pytest.approx(corr_T, abs=1e-12)
    # Scale-free down to tiny amplitudes (an additive epsilon guard would fail this).
    tiny = lr.correlation_per_step(1e-9 * pred, 1e-9 * target)
    assert tiny[0, 0].tolist() == pytest.approx(corr_T, abs=1e-12)
    constant = torch.ones_like(target)
    assert lr.correlation_per_step(pred, constant)[0, 0].tolist() == [0.0] * 4


def test_correlation_time_counts_steps_before_first_drop():
    pred, target = _with_correlation([1.0, 0.95, 0.85, 0.79, 0.99, 0.99])
    assert lr.correlation_time(pred, target).tolist() == [3.0]  # a later recovery does not count
    assert lr.correlation_time(pred, target, threshold=0.9).tolist() == [2.0]
    assert lr.correlation_time(pred, target, given_steps=1).tolist() == [2.0]


def test_identical_rollout_keeps_its_full_length():
    target = _rand(3, 2, 7, 8, 8)
    assert lr.correlation_time(target.clone(), target).tolist() == [7.0, 7.0, 7.0]
    assert lr.correlation_time(target.clone(), target, given_steps=2).tolist() == [5.0, 5.0, 5.0]


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 9))
def test_truth_then_independent_noise_scores_the_switch_step(n):
    target = _rand(4, 1, 9, 256, seed=1)
    pred = target.clone()
    pred[:, :, n:] = _rand(4, 1, 9 - n, 256, seed=2)  # |corr| ~ 1/16 over 256 points, far below 0.8
    assert lr.correlation_time(pred, target).tolist() == [float(n)] * 4


def test_diverged_steps_and_bad_channels_end_the_rollout():
    target = _rand(1, 2, 5, 32)
    pred = target.clone()
    pred[:, :, 3] = float("nan")  # NaN >= 0.8 is False: a diverged step counts as decorrelated
    assert lr.correlation_time(pred, target).tolist() == [3.0]
    pred = target.clone()
    pred[:, 1] = -target[:, 1]  # channel correlations 1 and -1 average to 0
    assert lr.correlation_time(pred, target).tolist() == [0.0]


# ---------------------------------------------------------------- radial spectrum
def _mode(spatial, k, amplitude=2.0):
    """[1, 1, 1, *spatial] field amplitude * cos(2 pi k . x / n)."""
    grids = torch.meshgrid(*[torch.arange(n, dtype=torch.float64) for n in spatial], indexing="ij")
    phase = sum(2 * math.pi * ki * g / n for ki, g, n in zip(k, grids, spatial))
    return (amplitude * torch.cos(phase))[None, None, None]


@pytest.mark.parametrize(
    ("spatial", "k", "shell"),
    [
        ((16,), (3,), 3),
        ((16, 16), (3, 4), 5),
        ((16, 16), (1, 1), 1),  # |k| = 1.41 rounds to 1
        ((16, 16), (2, 2), 3),  # |k| = 2.83 rounds to 3
        ((8, 8, 8), (1, 2, 2), 3),
        ((8, 12, 6), (1, 0, 2), 2),  # |k| = 2.24, non-cubic grid
    ],
)
def test_single_mode_puts_its_energy_in_its_shell(spatial, k, shell):
    spectrum = lr.radial_energy_spectrum(_mode(spatial, k, amplitude=2.0))[0, 0, 0]
    expected = torch.zeros_like(spectrum)
    expected[shell] = 2.0**2 / 2  # mean of (2 cos)^2
    torch.testing.assert_close(spectrum, expected, atol=1e-12, rtol=0)


def test_mean_and_nyquist_modes():
    spectrum = lr.radial_energy_spectrum(torch.full((1, 1, 1, 8), 3.0))[0, 0, 0]
    assert spectrum.tolist() == pytest.approx([9.0, 0, 0, 0, 0])
    nyquist = lr.radial_energy_spectrum(_mode((8,), (4,), amplitude=1.0))[0, 0, 0]
    assert nyquist.tolist() == pytest.approx([0, 0, 0, 0, 1.0], abs=1e-12)  # (-1)^x: no 1/2


@pytest.mark.parametrize(
    ("spatial", "num_shells"), [((16,), 9), ((15,), 8), ((8, 8), 7), ((8, 6), 6), ((4, 4, 4), 4), ((1,), 1)]
)
def test_parseval_holds_in_1d_2d_3d(spatial, num_shells):
    u = _rand(2, 3, 2, *spatial, seed=3) + 0.5
    spectrum = lr.radial_energy_spectrum(u)
    assert spectrum.shape == (2, 3, 2, num_shells)
    torch.testing.assert_close(spectrum.sum(-1), u.square().flatten(3).mean(-1), rtol=1e-12, atol=0)


def test_spectrum_error_zero_for_equal_spectra_and_log_of_a_scale():
    target = _rand(3, 2, 4, 16, 16, seed=4)
    assert lr.spectrum_error(target.clone(), target).tolist() == [0.0, 0.0]
    # A shift changes every phase but no |U_k|: same spectrum, large pointwise error.
    shifted = target.roll(5, dims=-1)
    assert lr.spectrum_error(shifted, target).tolist() == pytest.approx([0.0, 0.0], abs=1e-12)
    # Scaling by a multiplies every shell by a^2.
    assert lr.spectrum_error(1.5 * target, target).tolist() == pytest.approx([2 * math.log(1.5)] * 2)


def test_spectrum_error_looks_at_the_chosen_step():
    target = _rand(2, 1, 3, 32, seed=5)
    pred = target.clone()
    pred[:, :, 0] *= 2.0
    assert lr.spectrum_error(pred, target).item() == 0.0  # default: last step
    assert lr.spectrum_error(pred, target, step=0).item() == pytest.approx(2 * math.log(2.0))
    with pytest.raises(ValueError, match=r"step=3.*\(2, 1, 3, 32\)"):
        lr.spectrum_error(pred, target, step=3)


# ---------------------------------------------------------------- ensembles
def test_crps_of_one_member_is_the_mae():
    members, target = _rand(1, 2, 3, 4, 5, seed=6), _rand(2, 3, 4, 5, seed=7)
    mae_CT = (members[0] - target).abs().mean(dim=(0, 3))
    torch.testing.assert_close(lr.crps_ensemble(members, target), mae_CT)


def test_crps_by_hand_and_against_all_pairs():
    members = torch.tensor([0.0, 2.0]).reshape(2, 1, 1, 1, 1)
    assert lr.crps_ensemble(members, torch.full((1, 1, 1, 1), 1.0)).item() == 0.0  # 1 - 4/4
    assert lr.crps_ensemble(members, torch.full((1, 1, 1, 1), 3.0)).item() == 1.0  # 2 - 4/4
    members, target = _rand(5, 2, 2, 3, 4, 4, seed=8), _rand(2, 2, 3, 4, 4, seed=9)
    k = members.shape[0]
    pairs = (members[:, None] - members[None]).abs().sum(dim=(0, 1))
    brute = (members - target).abs().mean(0) - pairs / (2 * k * (k - 1))
    torch.testing.assert_close(lr.crps_ensemble(members, target), brute.mean(dim=(0, 3, 4)))


def test_crps_of_a_gaussian_ensemble_matches_the_closed_form():
    mu, s, k = 0.3, 1.7, 32
    y_T = torch.tensor([0.3, 1.0, -2.5, 5.0], dtype=torch.float64)  # z = 0, 0.41, -1.65, 2.76
    gen = torch.Generator().manual_seed(10)
    members = mu + s * torch.randn(k, 4, 1, 4, 1024, generator=gen, dtype=torch.float64)
    target = y_T[None, None, :, None].expand(4, 1, 4, 1024)

    def closed_form(y):
        z = (y - mu) / s
        cdf, pdf = 0.5 * (1 + math.erf(z / math.sqrt(2))), math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
        return s * (z * (2 * cdf - 1) + 2 * pdf - 1 / math.sqrt(math.pi))

    expected = [closed_form(y) for y in y_T.tolist()]
    # The relative standard error is under 0.4% (checked over 30 seeds): 2% holds on any seed and CPU.
    assert lr.crps_ensemble(members, target)[0].tolist() == pytest.approx(expected, rel=0.02)


def test_spread_skill_is_one_for_a_calibrated_ensemble():
    k = 3  # small on purpose: without sqrt((K+1)/K) the ratio would be sqrt(3/4) = 0.87
    gen = torch.Generator().manual_seed(11)
    centre = 4 * torch.randn(4, 2, 3, 64, 64, generator=gen, dtype=torch.float64)
    target = centre + torch.randn(centre.shape, generator=gen, dtype=torch.float64)
    members = centre + torch.randn((k, *centre.shape), generator=gen, dtype=torch.float64)
    ratio = lr.spread_skill_ratio(members, target)
    assert ratio.shape == (2, 3)
    assert ratio.flatten().tolist() == pytest.approx([1.0] * 6, rel=0.05)


def test_spread_skill_of_an_underdispersed_ensemble():
    k, s = 5, 0.5  # truth ~ N(0, 1), members ~ N(0, s^2): var 1 + s^2/K for the ensemble mean
    gen = torch.Generator().manual_seed(12)
    target = torch.randn(8, 1, 2, 4096, generator=gen, dtype=torch.float64)
    members = s * torch.randn(k, 8, 1, 2, 4096, generator=gen, dtype=torch.float64)
    expected = math.sqrt((k + 1) / k) * s / math.sqrt(1 + s * s / k)
    ratio = lr.spread_skill_ratio(members, target)
    assert ratio.flatten().tolist() == pytest.approx([expected] * 2, rel=0.05)


# ---------------------------------------------------------------- bad shapes
def test_bad_shapes_raise_and_name_the_shape():
    field = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        lr.correlation_time(field, field)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        lr.radial_energy_spectrum(field)
    with pytest.raises(ValueError, match=r"\(1, 1, 1, 8\).*\(1, 1, 1, 9\)"):
        lr.spectrum_error(torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 9))
    with pytest.raises(ValueError, match=r"\(1, 1, 1, 1\)"):
        lr.spectrum_error(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))  # no shell to compare
    target = torch.zeros(2, 1, 3, 8)
    with pytest.raises(ValueError, match=r"\(4, 2, 1, 3, 9\).*\(2, 1, 3, 8\)"):
        lr.crps_ensemble(torch.zeros(4, 2, 1, 3, 9), target)
    with pytest.raises(ValueError, match=r"\(2, 1, 3, 8\)"):
        lr.crps_ensemble(target, target)  # a plain field is not an ensemble
    with pytest.raises(ValueError, match=r"K >= 2 members.*\(1, 2, 1, 3, 8\)"):
        lr.spread_skill_ratio(torch.zeros(1, 2, 1, 3, 8), target)
    with pytest.raises(ValueError, match=r"\(0, 2, 1, 3, 8\)"):
        lr.crps_ensemble(torch.zeros(0, 2, 1, 3, 8), target)
    with pytest.raises(ValueError, match="given_steps"):
        lr.correlation_time(target, target, given_steps=3)
