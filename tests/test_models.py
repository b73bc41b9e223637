"""Behaviour of core.models: identity at init, window-shift equivariance, shapes, codec accuracy, compile.

Legend: B batch, L tokens, D latent dim, H hidden dim, C channels, X/Y grid sizes, W window size.
Models are tiny and CPU-only; seeds are fixed here (core/ never seeds).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.models import (AdaLNZero, Denoiser, GridDecoder, GridEncoder, PDETBlock, PDETUNet, cell_centres,
                         morton_permutation)
from core.models.denoiser import SIGMA_DATA_KEY
from core.models.grid_codec import fit_linear_path


def _randomise_zero_init(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Give every adaLN-Zero / zero output layer random weights, so blocks are no longer the identity."""
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, AdaLNZero):
                sub.linear.weight.copy_(0.3 * torch.randn(sub.linear.weight.shape, generator=generator))
                sub.linear.bias.copy_(0.3 * torch.randn(sub.linear.bias.shape, generator=generator))
        if isinstance(module, PDETUNet):
            module.out_proj.weight.copy_(torch.randn(module.out_proj.weight.shape, generator=generator) * 0.1)


@pytest.mark.parametrize("shifted", [False, True])
def test_block_is_identity_at_init(shifted: bool) -> None:
    torch.manual_seed(0)
    block = PDETBlock(dim=16, num_heads=2, group_size=4, cond_dim=8, shifted=shifted)
    x = torch.randn(3, 12, 16)
    c = torch.randn(3, 8)
    assert torch.equal(block(x, c), x)
    valid = torch.arange(12) < 10  # with a padding mask as well
    assert torch.equal(block(x, c, valid), x)


def test_fresh_operator_returns_input_and_denoiser_skips() -> None:
    torch.manual_seed(0)
    model = PDETUNet(dim=8, hidden_dim=16, depths=(1, 1), num_heads=2, group_size=4, num_tasks=2)
    z = torch.randn(2, 16, 8)
    dt, task = torch.tensor([0.1, 0.05]), torch.tensor([0, 1])
    assert torch.equal(model(z, dt, task), z)
    den = Denoiser(dim=8, hidden_dim=16, depths=(1,), num_heads=2, group_size=4, num_tasks=2, sigma_data=0.5)
    sigma = torch.tensor([0.0, 0.5])
    out = den(z, torch.randn_like(z), sigma, dt, task)
    c_skip = 0.25 / (sigma**2 + 0.25)
    torch.testing.assert_close(out, c_skip[:, None, None] * z)
    assert torch.equal(out[0], z[0])  # sigma = 0: the clean signal is the input


def _small_denoiser(sigma_data: float = 1.0, seed: int = 5) -> Denoiser:
    torch.manual_seed(0)
    den = Denoiser(dim=4, hidden_dim=8, depths=(1,), num_heads=2, group_size=4, num_tasks=2, sigma_data=sigma_data)
    _randomise_zero_init(den.net, torch.Generator().manual_seed(seed))
    return den


def _denoiser_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(6)
    return (torch.randn(2, 8, 4, generator=g), torch.randn(2, 8, 4, generator=g), torch.tensor([0.5, 0.01]),
            torch.tensor([0.1, 0.05]), torch.tensor([0, 1]))


def test_denoiser_sigma_data_is_a_buffer_that_survives_export_and_load(tmp_path) -> None:
    den = _small_denoiser(sigma_data=0.0123)
    assert den.sigma_data == float(torch.tensor(0.0123, dtype=torch.float32))
    assert SIGMA_DATA_KEY in dict(den.named_buffers()) and not any(SIGMA_DATA_KEY in n for n, _ in den.named_parameters())
    # The export format of entry.training.checkpoint.export_weights: plain CPU tensors, loaded weights_only.
    path = tmp_path / "den.pt"
    torch.save({k: v.detach().cpu() for k, v in den.state_dict().items()}, path)
    loaded = _small_denoiser(sigma_data=1.0, seed=7)  # built with the default, other weights
    loaded.load_state_dict(torch.load(path, weights_only=True))  # strict
    assert loaded.sigma_data == den.sigma_data
    with torch.no_grad():
        assert torch.equal(loaded(*_denoiser_inputs()), den(*_denoiser_inputs()))


@pytest.mark.parametrize("built_with", [1.0, 0.25])
def test_denoiser_weights_without_sigma_data_load_with_the_built_value(built_with: float) -> None:
    old = _small_denoiser(sigma_data=1.0)  # weights from before the buffer existed were trained at 1
    state = {k: v for k, v in old.state_dict().items() if k != SIGMA_DATA_KEY}
    # Nested, so the key is found under the parent's prefix as well.
    parent = torch.nn.ModuleDict({"den": _small_denoiser(sigma_data=built_with, seed=7)})
    result = parent.load_state_dict({f"den.{k}": v for k, v in state.items()}, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    assert parent["den"].sigma_data == built_with
    parent["den"].load_state_dict(state)  # strict load passes too
    if built_with == 1.0:
        with torch.no_grad():
            assert torch.equal(parent["den"](*_denoiser_inputs()), old(*_denoiser_inputs()))


@pytest.mark.parametrize("shifted", [False, True])
def test_window_shift_commutes_with_block(shifted: bool) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    W = 4
    block = PDETBlock(dim=16, num_heads=2, group_size=W, cond_dim=8, shifted=shifted)
    _randomise_zero_init(block, g)
    x = torch.randn(2, 16, 16, generator=g)
    c = torch.randn(2, 8, generator=g)
    out = block(x, c)
    assert not torch.allclose(out, x, atol=1e-3)  # the block really does something
    for k in (1, 2, -1):
        rolled = block(torch.roll(x, k * W, dims=1), c)
        torch.testing.assert_close(rolled, torch.roll(out, k * W, dims=1), atol=1e-5, rtol=1e-5)


def test_padding_tokens_do_not_leak_into_real_tokens() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    model = PDETUNet(dim=8, hidden_dim=16, depths=(1, 2), num_heads=2, group_size=4, num_tasks=1)
    _randomise_zero_init(model, g)
    z = torch.randn(1, 11, 8, generator=g)  # padded to 16
    dt, task = torch.tensor([0.1]), torch.tensor([0])
    captured = []
    original = PDETBlock.forward

    def spy(self, x, c, valid=None):
        captured.append(valid)
        return original(self, x, c, valid)

    PDETBlock.forward = spy
    try:
        out = model(z, dt, task)
    finally:
        PDETBlock.forward = original
    assert out.shape == z.shape and torch.isfinite(out).all()
    assert captured[0].tolist() == [True] * 11 + [False] * 5
    assert captured[1].tolist() == [True] * 6 + [False] * 2  # merged pairs: real iff first is real
    # Real outputs ignore whatever the padded positions hold: mask keys of padded tokens.
    block = model.blocks()[0]
    x = torch.randn(1, 16, 16, generator=g)
    c = torch.randn(1, 16, generator=g)
    valid = torch.arange(16) < 11
    y1 = block(x, c, valid)
    x2 = x.clone()
    x2[:, 11:] = 100 * torch.randn(1, 5, 16, generator=g)
    torch.testing.assert_close(block(x2, c, valid)[:, :11], y1[:, :11], atol=1e-5, rtol=1e-5)


def test_blocks_lists_every_block_and_fresh_modules() -> None:
    model = PDETUNet(dim=8, hidden_dim=16, depths=(2, 3, 1), num_heads=2, group_size=2, num_tasks=1)
    blocks = model.blocks()
    assert len(blocks) == 2 + 3 + 1 + 2 + 3 and all(isinstance(b, PDETBlock) for b in blocks)
    assert len({id(b) for b in blocks}) == len(blocks)
    shifted = [b.attn.shift > 0 for b in model.down[0]]
    assert shifted == [False, True]


def test_morton_runs_are_squares() -> None:
    side = 8
    perm = morton_permutation(side)
    assert sorted(perm.tolist()) == list(range(side * side))
    for run in (4, 16):
        rows, cols = perm // side, perm % side
        for start in range(0, side * side, run):
            r, c = rows[start:start + run], cols[start:start + run]
            edge = math.isqrt(run)
            assert r.max() - r.min() == edge - 1 and c.max() - c.min() == edge - 1


def test_morton_runs_are_cubes_in_3d_and_the_2d_order_is_kept() -> None:
    side = 8
    perm = morton_permutation(side, 3)
    assert sorted(perm.tolist()) == list(range(side ** 3))
    xyz = torch.stack([perm // side ** 2, perm // side % side, perm % side])
    for run in (8, 64):
        edge = round(run ** (1 / 3))
        for start in range(0, side ** 3, run):
            block = xyz[:, start:start + run]
            assert ((block.max(1).values - block.min(1).values) == edge - 1).all()
    # The 2D order as it was written before 3D existed (row bit above column bit): weights and
    # caches of 2D models keep their token order.
    codes = [sum(((r >> b) & 1) << (2 * b + 1) | ((c >> b) & 1) << (2 * b) for b in range(3))
             for r in range(side) for c in range(side)]
    assert torch.equal(morton_permutation(side), torch.argsort(torch.tensor(codes)))


@settings(max_examples=12, deadline=None)
@given(
    batch=st.integers(1, 3),
    tokens_log4=st.integers(1, 3),
    dim=st.sampled_from([4, 8]),
    x1=st.integers(1, 70),
    x2=st.integers(1, 40),
    y2=st.integers(1, 40),
)
def test_codec_shapes(batch: int, tokens_log4: int, dim: int, x1: int, x2: int, y2: int) -> None:
    L = 4**tokens_log4
    enc = GridEncoder(in_channels=2, tokens=L, dim=dim, hidden=16, depth=1, heads=2)
    dec = GridDecoder(out_channels=2, tokens=L, dim=dim, hidden=16, depth=1, heads=2)
    z1 = enc(torch.randn(batch, 2, x1))
    z2 = enc(torch.randn(batch, 2, x2, y2))
    assert z1.shape == z2.shape == (batch, L, dim)
    assert dec(z1, (x1,)).shape == (batch, 2, x1)
    assert dec(z2, (x2, y2)).shape == (batch, 2, x2, y2)
    coords = torch.rand(batch, 5, 2)
    assert dec.query(z2, coords).shape == (batch, 5, 2)


@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 2), tokens_log8=st.integers(0, 2), channels=st.integers(1, 4),
       grid=st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(1, 12)))
def test_codec_shapes_3d(batch: int, tokens_log8: int, channels: int, grid: tuple[int, int, int]) -> None:
    L = 8**tokens_log8
    enc = GridEncoder(channels, tokens=L, dim=8, hidden=16, depth=1, heads=2, ndims=(3,), modes=2)
    dec = GridDecoder(channels, tokens=L, dim=8, hidden=16, depth=1, heads=2, ndims=(3,), modes=2)
    z = enc(torch.randn(batch, channels, *grid))
    assert z.shape == (batch, L, 8)
    assert dec(z, grid).shape == (batch, channels, *grid)
    assert dec.query(z, torch.rand(batch, 5, 3)).shape == (batch, 5, channels)


@settings(max_examples=10, deadline=None)
@given(
    batch=st.integers(1, 3),
    tokens=st.integers(1, 40),
    dim=st.sampled_from([4, 8]),
    depths=st.sampled_from([(1,), (1, 1), (2, 1, 1)]),
)
def test_operator_and_denoiser_shapes(batch: int, tokens: int, dim: int, depths: tuple[int, ...]) -> None:
    z = torch.randn(batch, tokens, dim)
    dt, task = torch.rand(batch), torch.randint(0, 3, (batch,))
    op = PDETUNet(dim=dim, hidden_dim=8, depths=depths, num_heads=2, group_size=4, num_tasks=3)
    assert op(z, dt, task).shape == z.shape
    den = Denoiser(dim=dim, hidden_dim=8, depths=depths, num_heads=2, group_size=4, num_tasks=3)
    assert den(z, torch.randn_like(z), torch.rand(batch), dt, task).shape == z.shape


@pytest.mark.parametrize("tokens, shape", [(16, (6, 5)), (64, (6, 5, 7))])
def test_decoder_query_matches_grid_decode(tokens, shape) -> None:
    torch.manual_seed(0)
    dec = GridDecoder(out_channels=3, tokens=tokens, dim=4, hidden=16, depth=1, heads=2, ndims=(len(shape),))
    z = torch.randn(2, tokens, 4)
    grid = dec(z, shape)
    coords = cell_centres(shape)[None].expand(2, -1, -1)
    torch.testing.assert_close(dec.query(z, coords).transpose(1, 2).reshape(2, 3, *shape), grid)


def test_wrong_inputs_raise() -> None:
    with pytest.raises(ValueError, match="power of 4"):
        GridEncoder(1, tokens=8, dim=4, hidden=16, heads=2)
    enc = GridEncoder(1, tokens=8, dim=4, hidden=16, heads=2, ndims=(1,))
    with pytest.raises(ValueError, match="ndims"):
        enc(torch.randn(1, 1, 4, 4))
    op = PDETUNet(dim=4, hidden_dim=8, depths=(1,), num_heads=2, group_size=4, num_tasks=1)
    with pytest.raises(ValueError, match="noise"):
        op(torch.randn(1, 4, 4), torch.rand(1), torch.zeros(1, dtype=torch.long), noise_B=torch.rand(1))


def _smooth_fields(n: int, X: int, generator: torch.Generator) -> torch.Tensor:
    """Sums of three sines (wavenumbers 1..3, amplitude ~ 1/k, random phase). -> [n, 1, X]."""
    x = (torch.arange(X) + 0.5) / X
    k = torch.arange(1, 4, dtype=torch.float32)[:, None]
    amp = torch.randn(n, 3, 1, generator=generator) / k
    phase = 2 * math.pi * torch.rand(n, 3, 1, generator=generator)
    return (amp * torch.sin(2 * math.pi * k * x + phase)).sum(1, keepdim=True)


@pytest.mark.parametrize("grid, tokens, modes", [((64,), 16, 4), ((256,), 32, 8), ((32, 32), 64, 4), ((16, 16), 16, 4),
                                                 ((16, 16, 16), 64, 4), ((8, 12, 16), 8, 8)])
def test_codec_is_exact_when_the_latent_holds_the_field(grid, tokens, modes) -> None:
    # One cosine mode per point of a cell and a token as wide as the cell's coefficients: the
    # linear path is the cells' DCT and its inverse, so decode(encode(u)) is u up to rounding,
    # with no training (the correction starts at zero), for any field.
    torch.manual_seed(0)
    d = len(grid)
    dim = modes ** d
    enc = GridEncoder(1, tokens=tokens, dim=dim, hidden=16, ndims=(d,), depth=1, heads=2, modes=modes)
    dec = GridDecoder(1, tokens=tokens, dim=dim, hidden=16, ndims=(d,), depth=1, heads=2, modes=modes)
    u = torch.randn(4, 1, *grid)
    rel = ((dec(enc(u), grid) - u).flatten(1).norm(dim=1) / u.flatten(1).norm(dim=1)).max()
    assert rel < 1e-5, f"relative error {rel:.2e}"


def _local_pca_error(u_NX: torch.Tensor, cell: int, keep: int) -> torch.Tensor:
    """Relative error of projecting every cell of `cell` points onto the top `keep` principal
    directions of the cells (numpy SVD, centred): the best local linear code of that size."""
    import numpy as np

    x = u_NX.double().numpy().reshape(-1, cell)
    mean = x.mean(0)
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
    rec = ((x - mean) @ vt[:keep].T @ vt[:keep] + mean).reshape(u_NX.shape)
    err = np.linalg.norm(rec - u_NX.double().numpy(), axis=1) / np.linalg.norm(u_NX.double().numpy(), axis=1)
    return torch.tensor(err.mean())


@pytest.mark.parametrize("scope", ["local", "global"])
def test_fitted_linear_path_is_the_pca_of_its_scope(scope: str) -> None:
    # A codec smaller than the field: the fitted linear path is PCA, of the cells (local) or of
    # whole fields (global), and reconstructs exactly as an independent SVD projection does.
    g = torch.Generator().manual_seed(0)
    X, L, keep = 64, 8, 3
    u = _smooth_fields(400, X, g) + 0.05 * torch.randn(400, 1, X, generator=g)
    enc = GridEncoder(1, tokens=L, dim=keep, hidden=0, ndims=(1,), modes=X // L, linear=scope)
    dec = GridDecoder(1, tokens=L, dim=keep, hidden=0, ndims=(1,), modes=X // L, linear=scope)
    captured = fit_linear_path(enc, dec, [u[:200], u[200:]])
    assert 0 < captured[1] < 1
    with torch.no_grad():
        rel = ((dec(enc(u), (X,)) - u).norm(dim=-1) / u.norm(dim=-1)).mean()
    want = _local_pca_error(u[:, 0], X // L, keep) if scope == "local" else _local_pca_error(u[:, 0], X, L * keep)
    torch.testing.assert_close(rel.double(), want, rtol=1e-3, atol=1e-6)


def test_codec_correction_starts_at_zero_and_learns() -> None:
    # The learned correction cannot change a fresh codec (its output layers are zero), and its
    # gradients are live: one optimizer step moves the reconstruction.
    torch.manual_seed(0)
    X, L = 64, 8
    enc = GridEncoder(1, tokens=L, dim=2, hidden=16, ndims=(1,), depth=1, heads=2, modes=X // L)
    dec = GridDecoder(1, tokens=L, dim=2, hidden=16, ndims=(1,), depth=1, heads=2, modes=X // L)
    lin_enc = GridEncoder(1, tokens=L, dim=2, hidden=0, ndims=(1,), modes=X // L)
    lin_dec = GridDecoder(1, tokens=L, dim=2, hidden=0, ndims=(1,), modes=X // L)
    u = _smooth_fields(32, X, torch.Generator().manual_seed(1))
    for e, dd in ((enc, dec), (lin_enc, lin_dec)):
        fit_linear_path(e, dd, [u])
    assert torch.equal(dec(enc(u), (X,)), lin_dec(lin_enc(u), (X,)))
    params = [*enc.parameters(), *dec.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    loss = (dec(enc(u), (X,)) - u).square().mean()
    loss.backward()
    assert all(p.grad is not None for p in (enc.out.weight, dec.coef["1d"].weight))
    opt.step()
    assert not torch.equal(dec(enc(u), (X,)), lin_dec(lin_enc(u), (X,)))


def test_per_dimension_token_counts() -> None:
    # 1D and 2D fields may have their own token counts (the operator and the steady prior each
    # see one kind); each kind decodes back to its own grid.
    enc = GridEncoder(1, tokens={1: 16, 2: 64}, dim=16, hidden=8, depth=1, heads=2, modes={1: 4, 2: 4})
    dec = GridDecoder(1, tokens={1: 16, 2: 64}, dim=16, hidden=8, depth=1, heads=2, modes={1: 4, 2: 4})
    u1, u2 = torch.randn(2, 1, 64), torch.randn(2, 1, 32, 32)
    z1, z2 = enc(u1), enc(u2)
    assert z1.shape == (2, 16, 16) and z2.shape == (2, 64, 16)
    torch.testing.assert_close(dec(z2, (32, 32)), u2, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="L="):
        dec.query(z1, torch.rand(2, 5, 2))  # 16 tokens are not a 2D latent here


def _compile_forward_backward(model: torch.nn.Module, *inputs: torch.Tensor, **kwargs) -> None:
    compiled = torch.compile(model, backend="aot_eager")
    out = compiled(*inputs, **kwargs)
    eager = model(*inputs, **kwargs)
    torch.testing.assert_close(out, eager, atol=1e-4, rtol=1e-4)
    out.square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(gr).all() for gr in grads)


def test_the_query_key_norm_under_bf16_autocast_takes_torch_fused_kernel() -> None:
    """An unsharded block under bf16 autocast normalises bf16 queries with fp32 weights: torch's fused
    RMSNorm needs one dtype and warns when it falls back. The norm casts its weight: no warning,
    nn.RMSNorm's result bitwise in fp32, and within one bf16 rounding of it in bf16."""
    import warnings

    from core.models.pdet import WindowAttention, _norm_in_own_dtype

    g = torch.Generator().manual_seed(0)
    norm = torch.nn.RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(8, generator=g))  # a trained weight, not the ones of init
    q = torch.randn(6, 2, 4, 8, generator=g)
    assert torch.equal(_norm_in_own_dtype(norm, q), norm(q))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mixed = norm(q.bfloat16())  # the fallback, for reference
    ours = _norm_in_own_dtype(norm, q.bfloat16())
    assert ours.dtype == torch.bfloat16
    assert ((ours.float() - mixed.float()).abs() <= 2 ** -7 * mixed.float().abs() + 1e-6).all()
    attn = WindowAttention(16, 2, 4, shifted=True)
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("error")
        out = attn(torch.randn(2, 8, 16, generator=g))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compile_forward_backward() -> None:
    """Every network the stages compile traces (dynamo's graph capture and AOT autograd's backward,
    the "aot_eager" backend) and computes what the eager network does. Inductor's code generation
    is tests/test_recipe_matrix.py's: it trains an inductor-compiled operator in fp32 and bf16 at
    one and two ranks against eager. Here inductor cost 30 s a network on 2 cores with a warm cache
    and over two minutes with the empty one a fresh venv starts with, for a check that matrix makes."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    enc = GridEncoder(1, tokens=16, dim=4, hidden=16, depth=1, heads=2, ndims=(1,))
    _compile_forward_backward(enc, torch.randn(2, 1, 32))
    dec = GridDecoder(1, tokens=16, dim=4, hidden=16, depth=1, heads=2, ndims=(2,))
    _compile_forward_backward(dec, torch.randn(2, 16, 4), (8, 8))
    dt, task = torch.rand(2), torch.tensor([0, 1])
    op = PDETUNet(dim=4, hidden_dim=16, depths=(1, 1), num_heads=2, group_size=4, num_tasks=2)
    _randomise_zero_init(op, torch.Generator().manual_seed(3))
    _compile_forward_backward(op, torch.randn(2, 16, 4), dt, task)
    # A sigma_data other than 1, so the compiled graph reads the buffer (not a folded constant 1).
    den = Denoiser(dim=4, hidden_dim=16, depths=(1, 1), num_heads=2, group_size=4, num_tasks=2, sigma_data=0.05)
    _randomise_zero_init(den.net, torch.Generator().manual_seed(4))
    _compile_forward_backward(den, torch.randn(2, 12, 4), torch.randn(2, 12, 4), torch.rand(2), dt, task)
