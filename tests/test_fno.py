"""Tests for core.models.fno (FNO1d/FNO2d after PDEBench) and bench.fno_baseline."""

import math

import pytest
import torch
from torch import nn

from bench.fno_baseline import build_fno, fno_rollout, fno_rollout_loss, fno_validate, train_fno
from core.metrics import nrmse
from core.models.fno import FNO1d, FNO2d, SpectralConv1d, SpectralConv2d


def _seeded(make, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def _randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- shapes
@pytest.mark.parametrize("x", [1, 8, 33, 64])
@pytest.mark.parametrize("batch", [1, 3])
def test_fno1d_shapes(x, batch):
    model = _seeded(lambda: FNO1d(3, channels=2, modes=12, width=8))
    out = model(_randn(batch, 6, x))
    assert out.shape == (batch, 2, x)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("xy", [(1, 1), (8, 12), (17, 5), (32, 32)])
def test_fno2d_shapes(xy):
    model = _seeded(lambda: FNO2d(2, channels=3, modes=6, width=8))
    out = model(_randn(2, 6, *xy))
    assert out.shape == (2, 3, *xy)
    assert torch.isfinite(out).all()


def test_pdebench_parameter_count_and_bad_input():
    # PDEBench's FNO1d at num_channels=1, modes=12, width=20, initial_step=10:
    # fc0 11*20+20, 4 * (20*20*12 complex + 1x1 conv 20*20+20), fc1 20*128+128, fc2 128+1.
    model = FNO1d(10)
    assert sum(p.numel() for p in model.parameters()) == 240 + 4 * (2 * 4800 + 420) + 2688 + 129
    with pytest.raises(ValueError, match="expected u"):
        model(torch.zeros(1, 9, 16))
    with pytest.raises(ValueError, match="grid"):
        model(torch.zeros(1, 10, 16), grid=torch.zeros(1, 1, 15))
    with pytest.raises(ValueError, match="in_steps"):
        FNO1d(0)


def test_explicit_grid_matches_default_cell_centres():
    model = _seeded(lambda: FNO1d(2, width=8))
    u = _randn(2, 2, 16)
    grid = ((torch.arange(16) + 0.5) / 16).reshape(1, 1, 16)
    torch.testing.assert_close(model(u, grid=grid), model(u))
    assert not torch.allclose(model(u, grid=grid + 0.3), model(u))


# ---------------------------------------------------------------- spectral convolution
def _wave_1d(n, k, phase):
    x = torch.arange(n, dtype=torch.float64)
    return torch.cos(2 * math.pi * k * x / n + phase)


@pytest.mark.parametrize("k", [0, 1, 3, 4, 5, 9, 16])
def test_spectral_conv1d_acts_on_one_mode_only(k):
    modes, n, cin, cout = 5, 32, 3, 2
    conv = _seeded(lambda: SpectralConv1d(cin, cout, modes)).double()
    u = torch.zeros(1, cin, n, dtype=torch.float64)
    u[0, 1] = 0.7 * _wave_1d(n, k, 0.3)
    f_out = torch.fft.rfft(conv(u))
    if k >= modes:
        assert f_out.abs().max() < 1e-12  # modes at or above `modes` are dropped
        return
    f_in = torch.fft.rfft(u)
    expected = f_in[0, 1, k] * torch.view_as_complex(conv.weight)[1, :, k].to(f_in.dtype)
    if k == 0:  # irfft keeps only the real part of the zero frequency
        expected = expected.real.to(f_in.dtype)
    torch.testing.assert_close(f_out[0, :, k], expected)
    others = torch.ones(f_out.shape[-1], dtype=torch.bool)
    others[k] = False
    assert f_out[..., others].abs().max() < 1e-10
    # linear: a second input mode adds its own image
    v = torch.zeros_like(u)
    v[0, 2] = _wave_1d(n, 2, -1.0)
    torch.testing.assert_close(conv(2 * u - 3 * v), 2 * conv(u) - 3 * conv(v))


@pytest.mark.parametrize("k1, k2, kept", [(2, 1, True), (-3, 2, True), (0, 3, True), (4, 1, False), (1, 4, False)])
def test_spectral_conv2d_acts_on_one_mode_only(k1, k2, kept):
    modes, nx, ny = 4, 16, 12
    conv = _seeded(lambda: SpectralConv2d(2, 3, modes, modes)).double()
    x = torch.arange(nx, dtype=torch.float64).reshape(nx, 1)
    y = torch.arange(ny, dtype=torch.float64).reshape(1, ny)
    u = torch.zeros(1, 2, nx, ny, dtype=torch.float64)
    u[0, 0] = torch.cos(2 * math.pi * (k1 * x / nx + k2 * y / ny) + 0.4)
    f_out = torch.fft.rfft2(conv(u))
    if not kept:
        assert f_out.abs().max() < 1e-12
        return
    row = k1 % nx
    weight = conv.weight1 if k1 >= 0 else conv.weight2
    w_row = k1 if k1 >= 0 else modes + k1  # the negative block holds rows -modes..-1
    f_in = torch.fft.rfft2(u)
    expected = f_in[0, 0, row, k2] * torch.view_as_complex(weight)[0, :, w_row, k2].to(f_in.dtype)
    torch.testing.assert_close(f_out[0, :, row, k2], expected)
    f_out[0, :, row, k2] = 0
    assert f_out.abs().max() < 1e-10


# ---------------------------------------------------------------- rollout and training step
class _Scale(nn.Module):
    """Stub operator: ``a`` times the newest input frame (C = 1)."""

    def __init__(self, a):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a), dtype=torch.float64))

    def forward(self, u):
        return self.a * u[:, -1:]


def test_rollout_copies_given_frames_and_feeds_predictions_back():
    model = _seeded(lambda: FNO1d(3, channels=2, width=8))
    u = _randn(2, 7, 2, 16)
    with torch.no_grad():
        pred = fno_rollout(model, u, 3)
        assert pred.shape == u.shape
        assert torch.equal(pred[:, :3], u[:, :3])
        torch.testing.assert_close(pred[:, 3], model(u[:, :3].flatten(1, 2)))
        window = torch.cat([u[:, 1:3], pred[:, 3:4]], dim=1)  # the prediction is fed back
        torch.testing.assert_close(pred[:, 4], model(window.flatten(1, 2)))
        assert torch.equal(fno_rollout(model, u[:, :3], 3), u[:, :3])  # nothing to predict
    with pytest.raises(ValueError, match="initial_step"):
        fno_rollout(model, u, 8)


def test_the_training_loss_is_the_free_running_sum_of_step_mses():
    # u_t = r^t u_0; the stub predicts a * (newest frame). Free running (PDEBench):
    # pred_t = a^(t-s+1) u_{s-1}; teacher forcing would give a * u_{t-1} instead.
    s, steps, r, a = 2, 6, 0.9, 1.2
    u0 = torch.linspace(-1, 1, 8, dtype=torch.float64)
    u = torch.stack([r**t * u0 for t in range(steps)]).reshape(1, steps, 1, 8).repeat(2, 1, 1, 1)
    model = _Scale(a)
    loss = fno_rollout_loss(model, u, s).item()
    ms = u0.square().mean().item()
    free = sum((a ** (t - s + 1) * r ** (s - 1) - r**t) ** 2 * ms for t in range(s, steps))
    assert loss == pytest.approx(free, rel=1e-12)
    assert fno_rollout_loss(model, u, s, t_train=4).item() == pytest.approx(
        sum((a ** (t - s + 1) * r ** (s - 1) - r**t) ** 2 * ms for t in range(s, 4)), rel=1e-12)
    with pytest.raises(ValueError, match="no step"):
        fno_rollout_loss(model, u, steps)


def test_build_fno_is_seeded_and_leaves_global_rng_alone():
    u = torch.zeros(2, 5, 1, 16)
    state = torch.get_rng_state()
    a, b, c = build_fno(u, 2, seed=1), build_fno(u, 2, seed=1), build_fno(u, 2, seed=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.fc0.weight, b.fc0.weight)
    assert not torch.equal(a.fc0.weight, c.fc0.weight)
    assert isinstance(build_fno(torch.zeros(2, 5, 1, 8, 8), 2), FNO2d)


def test_train_fno_arguments_and_wall_clock_stop():
    u = _randn(4, 5, 1, 16)
    with pytest.raises(ValueError, match="epochs or wall_seconds"):
        train_fno(u, initial_step=2)
    with pytest.warns(UserWarning, match="slower than predicted"):  # the first step always runs
        _, hist = train_fno(u, initial_step=2, wall_seconds=1e-9, width=4, modes=4)
    assert len(hist) == 1 and hist[0].val_nrmse is None  # and no step after it fits


def test_train_fno_halves_its_rate_per_epoch_as_pdebench_steplr():
    """Counted in epochs, the step schedule is PDEBench's StepLR stepped once per epoch: every step
    of epoch e uses lr * gamma ** (e // step_size), however many batches an epoch has."""
    u = _randn(5, 4, 1, 16)  # 5 samples in batches of 2: 3 steps per epoch, the last of one sample
    _, hist = train_fno(u, initial_step=2, epochs=5, batch_size=2, lr=1e-3, step_size=2, gamma=0.5, width=4,
                        modes=4, u_val_NTCS=u[:2], val_every=2)
    assert [h.epoch for h in hist] == list(range(5))
    assert [h.lr for h in hist] == [1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4]
    assert [h.val_nrmse is not None for h in hist] == [False, True, False, True, True]  # every 2nd and the last


# ---------------------------------------------------------------- learns advection
def test_train_fno_beats_persistence_on_tiny_advection(tmp_path):
    from pipelines.generate import generate_task
    from pipelines.task_data import read_task

    path = generate_task("advection1d", 24, tmp_path, nx=64, nt=21, seed=0, param=0.1)
    u = torch.from_numpy(read_task(path).u)  # [N, T, C, X]
    train, val = u[:16], u[16:]
    s = 5
    persistence = val.clone()
    persistence[:, s:] = val[:, s - 1 : s]  # the last given frame, held
    persistence_nrmse = nrmse(persistence.transpose(1, 2), val.transpose(1, 2), given_steps=s).item()

    model, hist = train_fno(train, initial_step=s, epochs=30, batch_size=8, u_val_NTCS=val, val_every=10, seed=0)
    assert [h.epoch for h in hist] == list(range(30))
    assert all(h.wall_s > 0 for h in hist) and hist[-1].wall_s >= hist[0].wall_s
    scores = [h.val_nrmse for h in hist if h.val_nrmse is not None]
    assert len(scores) == 3
    assert scores[-1] == pytest.approx(fno_validate(model, val, s, batch_size=8))
    assert hist[-1].train_loss < hist[0].train_loss
    assert scores[-1] < persistence_nrmse, (scores, persistence_nrmse)


def test_the_one_step_loss_is_the_mse_of_one_true_window_per_trajectory():
    """With a model that returns its newest input frame, the loss is the mean squared change between
    consecutive true frames at the drawn starts, which a second generator of the same seed redraws."""
    from bench.fno_baseline import one_step_loss

    u = torch.randn(5, 9, 2, 16, generator=torch.Generator().manual_seed(0))  # [B, T, C, X]
    given = 3
    newest = lambda x: x[:, -2:]  # noqa: E731  [B, given * C, X] -> the last frame's C channels
    loss = one_step_loss(newest, u, given, generator=torch.Generator().manual_seed(4))
    start = torch.randint(0, 9 - given, (5,), generator=torch.Generator().manual_seed(4))
    expected = torch.stack([(u[b, s + given] - u[b, s + given - 1]).square().mean() for b, s in enumerate(start)])
    torch.testing.assert_close(loss, expected.mean())
    with pytest.raises(ValueError, match="no frame to predict"):
        one_step_loss(newest, u[:, :3], given, generator=torch.Generator())
