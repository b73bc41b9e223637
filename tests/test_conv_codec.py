"""The convolutional codec (core.models.conv_codec): exact at rate 1, PCA's error when fitted,
its linear path until trained, better than PCA after a few steps, Morton tokens, rebuildable.

Legend: N frames, C channels, S spatial axes, L tokens, D latent channels, K = C * P^d.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import core.models.conv_codec as cc  # registers codec "conv" (core/models/__init__ may not import it yet)
from core.models.layers import morton_permutation
from core.models.registry import build, describe, rebuild


def smooth_fields(n: int, channels: int, shape: tuple[int, ...], *, seed: int, modes: int = 4) -> torch.Tensor:
    """Seeded smooth periodic fields: sums of Fourier modes (amplitude ~ 1 / (1 + |k|^2), random
    phases), channel c offset by 3c and scaled by 10^c so the normalisation matters. -> [N, C, *S]."""
    g = torch.Generator().manual_seed(seed)
    d = len(shape)
    axes = torch.meshgrid(*[torch.arange(s, dtype=torch.float64) / s for s in shape], indexing="ij")
    u = torch.zeros(n, channels, *shape, dtype=torch.float64)
    expand = (...,) + (None,) * d
    for k in torch.cartesian_prod(*[torch.arange(modes)] * d).reshape(-1, d).tolist():
        amp = torch.randn(n, channels, generator=g, dtype=torch.float64) / (1 + sum(x * x for x in k))
        phase = 2 * math.pi * torch.rand(n, channels, generator=g, dtype=torch.float64)
        arg = sum(2 * math.pi * k[a] * axes[a] for a in range(d))
        u += amp[expand] * torch.cos(arg + phase[expand])
    level = torch.arange(channels, dtype=torch.float64).reshape(1, channels, *[1] * d)
    return (u * 10.0 ** level + 3 * level).float()


def channel_error(u_hat: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Largest error per channel over that channel's largest magnitude. -> [C]."""
    dims = [0] + list(range(2, u.ndim))
    return (u_hat - u).abs().amax(dims) / u.abs().amax(dims)


def normalised_mse(model, u: torch.Tensor) -> torch.Tensor:
    """Reconstruction MSE in the codec's normalised units (each channel over its spread)."""
    scale = model.encoder.norm.scale.reshape(1, -1, *[1] * (u.ndim - 2))
    return (((model(u)[1] - u) / scale) ** 2).mean()


@pytest.mark.parametrize("ndim, channels, patch, grid", [
    (1, 2, 4, (32,)), (2, 3, 2, (16, 8)), (2, 4, 1, (8, 8)), (3, 1, 2, (8, 8, 8)),
])
def test_rate_one_codec_is_exact(ndim, channels, patch, grid):
    """D = C * P^d (rate 1x): the fitted linear path reconstructs unseen fields to float rounding."""
    model = cc.conv_autoencoder(channels, ndim, patch, channels * patch ** ndim, hidden=0)
    assert cc.compression_rate(channels, ndim, patch, channels * patch ** ndim) == 1.0
    assert cc.fit_linear(model, smooth_fields(6, channels, grid, seed=0)) == 1.0
    u = smooth_fields(3, channels, grid, seed=1) + 0.1 * torch.randn(3, channels, *grid,
                                                                        generator=torch.Generator().manual_seed(2))
    z, u_hat = model(u)
    assert z.shape == (3, cc.latent_tokens(grid, patch), channels * patch ** ndim)
    assert channel_error(u_hat, u).max() < 1e-5


def test_fit_edge_cases():
    """Batches fit as their concatenation does; a constant or all-zero channel gets scale 1 and
    is reproduced; a patch as large as the grid is one token."""
    u = smooth_fields(6, 3, (8, 8), seed=8)
    u[:, 1], u[:, 2] = 1e5, 0.0
    whole, chunked = (cc.conv_autoencoder(3, 2, 8, 4, hidden=0) for _ in range(2))
    assert cc.fit_linear(whole, u) == pytest.approx(cc.fit_linear(chunked, (u[:2], u[2:])), rel=1e-9)
    for name, buffer in whole.state_dict().items():
        torch.testing.assert_close(chunked.state_dict()[name], buffer)
    torch.testing.assert_close(whole.encoder.norm.scale[1:], torch.ones(2))
    z, u_hat = whole(u)
    assert z.shape == (6, 1, 4)
    torch.testing.assert_close(u_hat[:, 1:], u[:, 1:])
    with pytest.raises(ValueError, match="at least one frame"):
        cc.fit_linear(whole, [])


def test_untrained_learned_codec_is_its_linear_path():
    """Zero-initialised last layers: the learned codec's latent and reconstruction are the linear path's."""
    u = smooth_fields(8, 2, (16, 16), seed=3)
    linear, learned = (cc.conv_autoencoder(2, 2, 4, 4, hidden=h, blocks=2, stages=2) for h in (0, 8))
    cc.fit_linear(linear, u)
    cc.fit_linear(learned, u)
    for name, buffer in linear.state_dict().items():
        torch.testing.assert_close(learned.state_dict()[name], buffer, rtol=0, atol=0)
    assert any(p.abs().sum() > 0 for p in learned.parameters())  # the trunk itself is not zero
    (z_lin, u_lin), (z, u_hat) = linear(u), learned(u)
    torch.testing.assert_close(z, z_lin)
    torch.testing.assert_close(u_hat, u_lin)
    torch.testing.assert_close(learned.decode(z_lin, (16, 16)), linear.decode(z_lin, (16, 16)))


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
@pytest.mark.parametrize("grid", [(64,), (32, 32), (32, 16), (16, 16, 16)])
def test_shapes(grid, channels):
    """Every dimension and channel count: [B, C, *S] -> [B, prod(S / P), D] -> [B, C, *S]."""
    model = cc.conv_autoencoder(channels, len(grid), 4, 2, hidden=4, blocks=1)
    u = torch.randn(2, channels, *grid, generator=torch.Generator().manual_seed(0))
    z, u_hat = model(u)
    assert z.shape == (2, math.prod(n // 4 for n in grid), 2) == (2, cc.latent_tokens(grid, 4), 2)
    assert u_hat.shape == u.shape and u_hat.dtype == torch.float32
    assert model.decode(z, grid).shape == u.shape


def test_grid_not_divisible_by_patch_is_refused():
    model = cc.conv_autoencoder(1, 2, 4, 2, hidden=0)
    with pytest.raises(ValueError, match=r"grid size 30 .* patch 4"):
        model.encode(torch.zeros(1, 1, 32, 30))
    with pytest.raises(ValueError, match=r"grid size 30 .* patch 4"):
        model.decode(torch.zeros(1, 64, 2), (32, 30))
    with pytest.raises(ValueError, match="at most 2 downsampling stages"):
        cc.conv_autoencoder(1, 2, 4, 2, stages=3)


@pytest.mark.parametrize("cells", [(8,), (8, 8), (4, 4, 4), (1, 1), (4, 8), (6, 6)])
def test_token_order(cells):
    """Square / cubic power-of-two latent grids are listed in the grid codec's Morton order,
    others row-major; tokens_to_grid inverts grid_to_tokens."""
    z = torch.randn(2, 3, *cells, generator=torch.Generator().manual_seed(0))
    tokens = cc.grid_to_tokens(z)
    square = len(set(cells)) == 1 and len(cells) > 1 and cells[0] & (cells[0] - 1) == 0
    order = morton_permutation(cells[0], len(cells)) if square else torch.arange(math.prod(cells))
    torch.testing.assert_close(tokens, z.flatten(2)[:, :, order].transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(cc.tokens_to_grid(tokens, cells), z, rtol=0, atol=0)


def test_fitted_linear_path_is_pca_of_patches():
    """The fitted codec's reconstruction and captured variance are those of a numpy PCA of the
    per-channel normalised 4x4 patches with the same latent size."""
    C, P, D, grid = 2, 4, 5, (16, 16)
    u = smooth_fields(12, C, grid, seed=4)
    model = cc.conv_autoencoder(C, 2, P, D, hidden=0)
    captured = cc.fit_linear(model, u)
    u_hat = model(u)[1]

    x = u.double().numpy()
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    std = x.std(axis=(0, 2, 3), keepdims=True)
    xn = (x - mean) / std
    n, h, w = len(x), grid[0] // P, grid[1] // P
    patches = xn.reshape(n, C, h, P, w, P).transpose(0, 2, 4, 1, 3, 5).reshape(-1, C * P * P)
    centre = patches.mean(0)
    _, sing, vt = np.linalg.svd(patches - centre, full_matrices=False)
    top = vt[:D].T
    recon = (patches - centre) @ top @ top.T + centre
    x_hat = recon.reshape(n, h, w, C, P, P).transpose(0, 3, 1, 4, 2, 5).reshape(x.shape) * std + mean

    assert captured == pytest.approx((sing[:D] ** 2).sum() / (sing ** 2).sum(), rel=1e-6)
    err_codec = float(((u_hat.double().numpy() - x) / std).__pow__(2).mean())
    err_pca = float(((x_hat - x) / std).__pow__(2).mean())
    assert 0 < err_pca and err_codec == pytest.approx(err_pca, rel=1e-4)
    assert np.abs(u_hat.double().numpy() - x_hat).max() < 1e-5 * np.abs(x).max()


def numpy_pca(u: torch.Tensor, test: torch.Tensor, M: int) -> tuple[float, float, np.ndarray, np.ndarray]:
    """An independent PCA of whole fields normalised per channel, fitted to `u` with `M` components:
    (the kept variance fraction, the test fields' normalised squared error, the test fields and the
    channel scales, both float64) for a codec's reconstruction to be compared against."""
    x, xt = u.double().numpy(), test.double().numpy()
    mean, std = x.mean(axis=(0, 2, 3), keepdims=True), x.std(axis=(0, 2, 3), keepdims=True)
    flat = ((x - mean) / std).reshape(len(x), -1)
    centre = flat.mean(0)
    _, sing, vt = np.linalg.svd(flat - centre, full_matrices=False)
    top = vt[:M].T
    ft = ((xt - mean) / std).reshape(len(xt), -1)
    x_hat = (((ft - centre) @ top @ top.T + centre).reshape(xt.shape)) * std + mean
    kept = float((sing[:M] ** 2).sum() / (sing ** 2).sum())
    return kept, float((((x_hat - xt) / std) ** 2).mean()), xt, std


def test_global_linear_path_is_pca_of_whole_fields_and_keeps_tokens_local():
    """linear="global": the reconstruction is a numpy PCA's of the whole normalised fields with
    as many components as the latent holds numbers, the latent is nearly the local codec's
    (the same cells in the same order), a rate-1 global codec is exact, and an untrained learned
    global codec is its linear path."""
    C, P, D, grid = 2, 4, 2, (16, 16)
    u = smooth_fields(80, C, grid, seed=8, modes=6)
    test = smooth_fields(20, C, grid, seed=9, modes=6)
    local = cc.conv_autoencoder(C, 2, P, D, hidden=0)
    glob = cc.conv_autoencoder(C, 2, P, D, hidden=0, linear="global", grid=grid)
    cc.fit_linear(local, u)
    captured = cc.fit_linear(glob, [u[:50], u[50:]])

    kept, err_pca, xt, std = numpy_pca(u, test, D * (grid[0] // P) * (grid[1] // P))
    err_glob = float((((glob(test)[1].double().numpy() - xt) / std) ** 2).mean())
    err_local = float((((local(test)[1].double().numpy() - xt) / std) ** 2).mean())
    assert captured == pytest.approx(kept, rel=1e-6)
    assert 0 < err_pca < 0.5 * err_local and err_glob == pytest.approx(err_pca, rel=1e-3)
    z_local, z_glob = local.encode(test).flatten(), glob.encode(test).flatten()
    assert float(torch.corrcoef(torch.stack([z_local, z_glob]))[0, 1]) > 0.9

    exact = cc.conv_autoencoder(C, 2, P, C * P * P, hidden=0, linear="global", grid=grid)
    cc.fit_linear(exact, u)
    assert channel_error(exact(test)[1], test).max() < 1e-4
    learned = cc.conv_autoencoder(C, 2, P, D, hidden=8, linear="global", grid=grid)
    learned.load_state_dict(glob.state_dict(), strict=False)
    torch.testing.assert_close(learned(test)[1], glob(test)[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="training grid"):
        glob.encode(smooth_fields(1, C, (8, 8), seed=0))


def test_global_linear_path_takes_a_three_channel_128_square_field_and_refuses_more():
    """Fields up to 3 channels on 128 x 128 (49152 numbers) get a global linear path; a fourth
    channel is past the cap, refused when built, before any fit (a 4-channel 64 x 64 field is in)."""
    codec = cc.conv_autoencoder(4, 2, 8, 2, hidden=0, linear="global", grid=(64, 64))
    assert tuple(codec.encoder.field_map.shape) == (128, 16384)
    with pytest.raises(ValueError, match=f"at most {cc.GLOBAL_MAX_NUMBERS} numbers.*65536.*linear='local'"):
        cc.conv_autoencoder(4, 2, 8, 4, hidden=0, linear="global", grid=(128, 128))


def test_a_field_above_the_covariance_size_is_fitted_from_its_frames_to_the_same_pca():
    """A 4-channel 64 x 64 field (16384 numbers, past GLOBAL_COVARIANCE_NUMBERS) is fitted through
    the Gram matrix of its frames: its reconstruction and kept variance are a numpy SVD's of the
    whole normalised fields; fewer frames than kept components is refused with the fix."""
    C, P, D, grid = 4, 8, 2, (64, 64)
    assert C * math.prod(grid) > cc.GLOBAL_COVARIANCE_NUMBERS
    u = smooth_fields(160, C, grid, seed=3, modes=5)
    test = smooth_fields(10, C, grid, seed=4, modes=5)
    glob = cc.conv_autoencoder(C, 2, P, D, hidden=0, linear="global", grid=grid)
    captured = cc.fit_linear(glob, [u[:100], u[100:]])
    kept, err_pca, xt, std = numpy_pca(u, test, D * (grid[0] // P) * (grid[1] // P))
    err_glob = float((((glob(test)[1].double().numpy() - xt) / std) ** 2).mean())
    assert captured == pytest.approx(kept, rel=1e-5)
    assert 0 < err_pca and err_glob == pytest.approx(err_pca, rel=1e-3)
    with pytest.raises(ValueError, match="fitted to 100 frames.*autoencoder.fit_frames"):
        cc.fit_linear(cc.conv_autoencoder(C, 2, P, D, hidden=0, linear="global", grid=grid), u[:100])


def test_training_improves_on_pca():
    """A few Adam steps on the normalised reconstruction loss of smooth 3-channel fields bring a
    16x codec well below its fitted linear path (PCA), which is where it starts."""
    u = smooth_fields(16, 3, (32, 32), seed=5)
    with torch.random.fork_rng():  # parameter init draws from the global RNG; keep it local
        torch.manual_seed(0)
        model = cc.conv_autoencoder(3, 2, 4, 3, hidden=16, blocks=1)
    assert cc.compression_rate(3, 2, 4, 3) == 16.0
    cc.fit_linear(model, u)
    with torch.no_grad():
        linear_err = float(normalised_mse(model, u))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(40):
        loss = normalised_mse(model, u)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        trained_err = float(normalised_mse(model, u))
    print(f"normalised MSE: linear path (PCA) {linear_err:.4e}, after 40 Adam steps {trained_err:.4e}")
    # Seen: about 0.27x. The margin leaves room for other BLAS / thread counts.
    assert trained_err < 0.7 * linear_err


def test_rebuild_from_description_gives_the_same_function():
    """registry.rebuild(describe(model)) plus the state dict (buffers included) is the same codec."""
    u = smooth_fields(4, 2, (16, 16), seed=6)
    model = build("codec", "conv", channels=2, ndim=2, patch=4, latent_channels=2, hidden=8, blocks=1, stages=1)
    cc.fit_linear(model, u)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # move every parameter (zero last layers too) so the learned path matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    again = rebuild(describe(model))
    assert describe(again) == describe(model)
    again.load_state_dict(model.state_dict())
    for a, b in zip(model(u), again(u)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(model(u)[1], rebuild(describe(model))(u)[1])  # the weights carried the fit


def test_latent_of_a_16x_codec_holds_a_sixteenth_of_the_numbers():
    """Latent cache size: C=4, P=4 in 2D, D=4 stores 1/16 of the field's numbers."""
    model = cc.conv_autoencoder(4, 2, 4, 4, hidden=0)
    u = torch.randn(3, 4, 64, 32, generator=torch.Generator().manual_seed(0))
    z = model.encode(u)
    assert cc.compression_rate(4, 2, 4, 4) == 16.0
    assert z.numel() * 16 == u.numel()
    assert z.shape[1] == cc.latent_tokens((64, 32), 4) == 128
