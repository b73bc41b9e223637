"""Tests for core.metrics (PDEBench metrics), core.noise and core.physics.

Hand-computed cases use tiny fields; a numpy transcription of PDEBench's ``metric_func``
formulas (layout [B, *S, T, C]) cross-checks the metrics we take over unchanged.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core import metrics, noise, physics


def _rand(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------- metrics, by hand
def test_hand_computed_1d_batch_of_two():
    target = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4).repeat(2, 1, 1, 1)
    pred = target.clone()
    pred[0, 0, 0, 3] = 6.0  # sample 0: error [0, 0, 0, 2]; sample 1 is perfect
    m = metrics.pdebench_metrics(pred, target)
    assert m["rmse"].shape == (1, 1)
    assert m["rmse"].item() == pytest.approx((1.0 + 0.0) / 2)  # sqrt(4/4), mean over batch
    assert m["nrmse"].item() == pytest.approx(1.0 / math.sqrt(7.5) / 2)  # RMS target sqrt(30/4)
    assert m["max_error"].item() == pytest.approx(2.0)  # worst case over batch
    assert m["crmse"].item() == pytest.approx(math.sqrt((0.5**2 + 0.0) / 2))  # RMS over batch
    assert m["brmse"].item() == pytest.approx(math.sqrt((0 + 4) / 2) / 2)
    assert m["nrmse_mean"].item() == pytest.approx(m["nrmse"].item())


def test_hand_computed_2d_boundary_counts_corners_twice():
    target = torch.zeros(1, 1, 1, 3, 3)
    pred = target.clone()
    pred[..., 0, 0] = 1.0  # a corner: on row 0 and on column 0
    assert metrics.brmse(pred, target).item() == pytest.approx(math.sqrt(2 / (2 * 3 + 2 * 3)))
    pred = target.clone()
    pred[..., 1, 1] = 1.0  # the interior point never counts
    assert metrics.brmse(pred, target).item() == 0.0


def test_two_nrmse_conventions_with_given_steps():
    target = torch.tensor([3.0, 4.0]).reshape(1, 1, 1, 2).repeat(1, 1, 4, 1)  # RMS sqrt(12.5)
    pred = target.clone()  # steps 0, 1 are the given ones, copied
    pred[0, 0, 2] += torch.tensor([1.0, -1.0])  # RMS error 1
    pred[0, 0, 3] += torch.tensor([2.0, 2.0])  # RMS error 2
    norm = math.sqrt(12.5)
    assert metrics.nrmse_per_step(pred, target)[0].tolist() == pytest.approx([0, 0, 1 / norm, 2 / norm])
    assert metrics.nrmse(pred, target, given_steps=2).item() == pytest.approx(1.5 / norm)
    assert metrics.nrmse_pdebench2022(pred, target).item() == pytest.approx(0.75 / norm)
    m = metrics.pdebench_metrics(pred, target, given_steps=2)
    assert m["nrmse_mean"].item() == pytest.approx(1.5 / norm)
    assert m["nrmse_pdebench2022"].item() == pytest.approx(0.75 / norm)
    assert m["rmse_mean"].item() == pytest.approx(1.5)


def test_perfect_prediction_scores_zero_and_edge_shapes():
    for shape in [(1, 1, 1, 8), (1, 2, 1, 4, 4), (3, 1, 5, 1)]:
        u = _rand(*shape)
        m = metrics.pdebench_metrics(u, u.clone())
        for name, value in m.items():
            assert torch.all(value == 0), name
        assert m["rmse"].shape == (shape[1], shape[2])


def test_zero_target_is_guarded_and_bad_input_rejected():
    target = torch.zeros(1, 1, 2, 4)
    assert torch.isfinite(metrics.nrmse(target + 1, target))
    with pytest.raises(ValueError, match="given_steps"):
        metrics.pdebench_metrics(target, target, given_steps=2)
    with pytest.raises(ValueError, match="differ"):
        metrics.rmse(target, target[..., :3])
    with pytest.raises(ValueError, match="spatial"):
        metrics.rmse(torch.zeros(1, 1, 1, 2, 2, 2, 2), torch.zeros(1, 1, 1, 2, 2, 2, 2))


def _pdebench_reference(pred, target):
    """numpy transcription of metric_func's RMSE/nRMSE/CSV/Max/BD, input [B, *S, T, C]."""
    p, t = np.moveaxis(pred, -1, 1), np.moveaxis(target, -1, 1)  # [B, C, *S, T]
    nb, nc, nt = p.shape[0], p.shape[1], p.shape[-1]
    pf, tf = p.reshape(nb, nc, -1, nt), t.reshape(nb, nc, -1, nt)
    err = np.sqrt(np.mean((pf - tf) ** 2, axis=2))
    nrm = np.sqrt(np.mean(tf**2, axis=2))
    csv = np.sqrt(np.mean((pf.sum(2) - tf.sum(2)) ** 2, axis=0)) / pf.shape[2]
    mx = np.abs(pf - tf).max(axis=2).max(axis=0)
    sq = (p - t) ** 2
    if p.ndim == 4:
        bd = np.mean(np.sqrt((sq[:, :, 0] + sq[:, :, -1]) / 2), axis=0)
    elif p.ndim == 5:
        nx, ny = p.shape[2:4]
        bx = (sq[:, :, 0] + sq[:, :, -1]).sum(-2)
        by = (sq[:, :, :, 0] + sq[:, :, :, -1]).sum(-2)
        bd = np.mean(np.sqrt((bx + by) / (2 * nx + 2 * ny)), axis=0)
    else:  # 3D: the six faces over 2XY + 2YZ + 2ZX points, as metric_func's 3D branch
        nx, ny, nz = p.shape[2:5]
        bx = (sq[:, :, 0] + sq[:, :, -1]).sum((-3, -2))
        by = (sq[:, :, :, 0] + sq[:, :, :, -1]).sum((-3, -2))
        bz = (sq[:, :, :, :, 0] + sq[:, :, :, :, -1]).sum((-3, -2))
        bd = np.mean(np.sqrt((bx + by + bz) / (2 * nx * ny + 2 * ny * nz + 2 * nz * nx)), axis=0)
    return dict(rmse=err.mean(0), nrmse=(err / nrm).mean(0), crmse=csv, max_error=mx, brmse=bd)


@pytest.mark.parametrize("spatial", [(16,), (6, 10), (4, 5, 6)])
def test_matches_pdebench_formulas(spatial):
    pred, target = _rand(3, 2, 4, *spatial, seed=1), _rand(3, 2, 4, *spatial, seed=2)
    ours = metrics.pdebench_metrics(pred, target)
    to_pdebench = lambda u: np.moveaxis(np.moveaxis(u.numpy(), 1, -1), 1, -2)  # -> [B,*S,T,C]
    ref = _pdebench_reference(to_pdebench(pred), to_pdebench(target))
    for name, value in ref.items():
        np.testing.assert_allclose(ours[name].numpy(), value, rtol=1e-10, err_msg=name)


# ---------------------------------------------------------------- Fourier bands
@pytest.mark.parametrize("shape", [(2, 3, 4, 64), (2, 1, 3, 32, 24), (1, 1, 1, 5)])
def test_fourier_bands_partition_the_error_parseval(shape):
    pred, target = _rand(*shape, seed=3), _rand(*shape, seed=4)
    mse_BCT = (pred - target).flatten(3).square().mean(-1)
    bands = metrics.fourier_band_mse(pred, target)
    torch.testing.assert_close(bands.sum(-1), mse_BCT)
    low, mid, high = metrics.frmse(pred, target)
    torch.testing.assert_close(low**2 + mid**2 + high**2, mse_BCT.mean(0))


@pytest.mark.parametrize(("k", "band"), [(0, 0), (3, 0), (4, 1), (11, 1), (12, 2), (31, 2)])
def test_single_mode_lands_in_its_band_1d(k, band):
    x = torch.arange(64, dtype=torch.float64) / 64
    err = torch.cos(2 * math.pi * k * x).reshape(1, 1, 1, 64)
    bands = metrics.fourier_band_mse(err, torch.zeros_like(err))[0, 0, 0]
    assert bands.argmax().item() == band
    assert bands[band].item() == pytest.approx(err.square().mean().item())


def test_single_mode_radial_band_2d():
    y, x = torch.meshgrid(*[torch.arange(32, dtype=torch.float64) / 32] * 2, indexing="ij")
    err = torch.sin(2 * math.pi * (3 * x + 3 * y)).reshape(1, 1, 1, 32, 32)  # |k| = 4.24
    bands = metrics.fourier_band_mse(err, torch.zeros_like(err))[0, 0, 0]
    assert bands[1].item() == pytest.approx(0.5) and bands[0].item() < 1e-20


# ---------------------------------------------------------------- properties
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-3, 1e3), sign=st.sampled_from([-1.0, 1.0]))
def test_nrmse_is_scale_invariant(seed, scale, sign):
    a = sign * scale
    pred, target = _rand(2, 2, 3, 8, seed=seed), _rand(2, 2, 3, 8, seed=seed + 1)
    torch.testing.assert_close(
        metrics.nrmse_per_step(a * pred, a * target), metrics.nrmse_per_step(pred, target), rtol=1e-8, atol=0
    )


# ---------------------------------------------------------------- noise
def test_noise_is_deterministic_per_seed():
    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        x_noisy, eps = noise.add_noise(torch.zeros(4, 3, 5), torch.full((4,), 0.5), generator=g)
        return x_noisy, eps, noise.sample_level_indices(16, 4, generator=g)

    state = torch.get_rng_state()
    a, b, c = draw(7), draw(7), draw(8)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is never touched
    for u, v, w in zip(a, b, c):
        assert torch.equal(u, v) and not torch.equal(u, w)


def test_add_noise_scales_per_sample():
    x, sigma = _rand(3, 2, 4), torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    x_noisy, eps = noise.add_noise(x, sigma, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(x_noisy, x + sigma.reshape(3, 1, 1) * eps)
    assert torch.equal(x_noisy[0], x[0])
    with pytest.raises(ValueError):
        noise.add_noise(x, torch.ones(2), generator=torch.Generator())


def test_schedules():
    s = noise.refiner_sigmas(4, 1e-6)
    assert s[0].item() == 1.0 and s[-1].item() == pytest.approx(1e-6)
    torch.testing.assert_close(s[1:] / s[:-1], torch.full((3,), 1e-2))  # geometric, ratio sigma_min^(1/K)
    assert noise.refiner_sigmas(1, 1e-3).tolist() == [1.0]
    k = noise.karras_sigmas(5, 0.002, 80.0)
    assert k[0].item() == 80.0 and k[-1].item() == pytest.approx(0.002) and torch.all(k[1:] < k[:-1])
    mid = (80.0 ** (1 / 7) + 0.5 * (0.002 ** (1 / 7) - 80.0 ** (1 / 7))) ** 7
    assert k[2].item() == pytest.approx(mid, rel=1e-6)
    levels = noise.sample_level_indices(1000, 3, generator=torch.Generator().manual_seed(0))
    assert set(levels.tolist()) == {0, 1, 2}
    assert noise.sample_level_indices(0, 3, generator=torch.Generator()).shape == (0,)
    torch.testing.assert_close(noise.level_sigmas(torch.tensor([2, 0]), s), s[[2, 0]])
    for bad in [lambda: noise.refiner_sigmas(0, 0.1), lambda: noise.karras_sigmas(1, 0.1, 1.0)]:
        with pytest.raises(ValueError):
            bad()


# ---------------------------------------------------------------- physics guards
def test_physics_guards():
    u = _rand(2, 1, 3, 5, 6)
    before = u.clone()
    assert physics.clamp_bounds(u, 0.0, None).min().item() == 0.0
    assert torch.equal(physics.clamp_bounds(u, None, None), u)
    with pytest.raises(ValueError):
        physics.clamp_bounds(u, 1.0, 0.0)
    projected = physics.project_mean(u, 0.25, spatial_ndim=2)
    mean = physics.spatial_mean(projected, spatial_ndim=2)
    torch.testing.assert_close(mean, torch.full((2, 1, 3), 0.25, dtype=u.dtype))
    torch.testing.assert_close(projected.diff(dim=-1), u.diff(dim=-1))  # only a uniform shift
    per_sample = physics.project_mean(u, torch.tensor([[[1.0]], [[2.0]]], dtype=u.dtype), spatial_ndim=2)
    assert physics.spatial_mean(per_sample, spatial_ndim=2)[1].allclose(torch.tensor(2.0, dtype=u.dtype))
    d = physics.enforce_dirichlet_zero(u)
    assert torch.all(d[..., physics.boundary_mask(5, 6)] == 0)
    assert torch.equal(d[..., 1:-1, 1:-1], u[..., 1:-1, 1:-1])
    assert physics.enforce_dirichlet_zero(torch.full((1, 1), float("nan"))).item() == 0.0
    assert torch.equal(u, before)  # nothing in place
