"""Step functions (core/steps): the contract every stage keeps, on tiny real models.

Per stage: a scalar finite non-negative loss and a TensorDict of detached scalars; the
same generator state gives a bit-identical loss and another seed a different one; the
generator is not advanced; the loss of a batch is the size-weighted mean of its halves'
and is unchanged by a permutation (both with the sample ids); trained parameters get
finite gradients, frozen networks none and keep their values.

Legend: B batch, L tokens, D latent dim, C channels, X grid points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tensordict import TensorDict
from torch import nn

from core.models.autoencoder import Autoencoder
from core.models.denoiser import SOLUTION_MEAN_KEY, Denoiser
from core.models.grid_codec import GridDecoder, GridEncoder
from core.models.pdet import PDETUNet
from core.steps import (
    AutoencoderStepConfig, ConsistencyStepConfig, DiffusionStepConfig, OperatorStepConfig, SteadyStepConfig,
    attach_operator_prediction, autoencoder_step, consistency_sample, consistency_step, diffusion_step,
    ema_update_, operator_step, refine, steady_sample, steady_step,
)
from core.noise import refiner_sigmas
from core.steps.common import refiner_loss, sample_index, sample_keys, sample_normal, step_seed
from core.steps.diffusion import ode_sample

L, D, C, X, TASKS = 8, 4, 1, 16, 2
BACKBONE = dict(hidden_dim=8, depths=(1,), num_heads=2, group_size=4, num_tasks=TASKS, mlp_ratio=2.0)
HYP = settings(max_examples=8, deadline=None, derandomize=True)


def _perturbed(model: nn.Module, seed: int) -> nn.Module:
    """Zero-initialised output layers (adaLN-Zero, zero out_proj) make a fresh model the
    identity and hide per-sample bugs; give every all-zero parameter small random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _operator(seed: int = 1) -> PDETUNet:
    return _perturbed(PDETUNet(D, **BACKBONE), seed)


def _denoiser(seed: int = 2, sigma_data: float = 1.0) -> Denoiser:
    return _perturbed(Denoiser(D, **BACKBONE, sigma_data=sigma_data), seed)


# The diffusion and consistency cases use a sigma_data other than 1, the same in the model
# and the step config (entry/ keeps them equal; a mismatch would weight the loss wrongly).
SD = 0.5


def _codec(seed: int = 3) -> Autoencoder:
    torch.manual_seed(seed)  # module init draws from the global RNG (tests may seed it)
    return Autoencoder(GridEncoder(C, L, D, hidden=8, ndims=(1,), depth=1, heads=2),
                       GridDecoder(C, L, D, hidden=8, ndims=(1,), depth=1, heads=2))


def _latent_batch(b: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict({
        "z_t": torch.randn(b, L, D, generator=g),
        "z_next": torch.randn(b, L, D, generator=g),
        "dt": 0.01 + 0.1 * torch.rand(b, generator=g),
        "task_id": torch.randint(0, TASKS, (b,), generator=g),
        "sample_id": torch.randperm(10 * b + 10, generator=g)[:b] + 10**9,
        "u_next": torch.randn(b, C, X, generator=g),
    }, batch_size=[b])


def _unrolled_batch(b: int, seed: int = 0, steps: int = 3) -> TensorDict:
    batch = _latent_batch(b, seed)
    g = torch.Generator().manual_seed(seed + 1)
    later = torch.randn(b, steps - 1, L, D, generator=g)
    batch["z_seq"] = torch.cat([batch["z_next"][:, None], later], dim=1)
    return batch


@dataclass
class Case:
    """One stage: its step, trained model, frozen modules and a batch maker."""

    name: str
    step: Callable
    model: nn.Module
    cfg: Any
    batch: Callable[[int], TensorDict]
    frozen: dict[str, nn.Module] = field(default_factory=dict)
    random: bool = True


def _freeze(m: nn.Module) -> nn.Module:
    return m.requires_grad_(False).eval()


def _make_case(name: str) -> Case:
    if name == "autoencoder":
        def batch(b):
            g = torch.Generator().manual_seed(5)
            x = torch.linspace(0, 1, X)
            u = torch.sin(2 * math.pi * (x + torch.rand(b, 1, 1, generator=g))) * (1 + torch.rand(b, 1, 1, generator=g))
            return TensorDict({"u": u, "sample_id": torch.arange(b)}, batch_size=[b])
        return Case(name, autoencoder_step, _codec(), AutoencoderStepConfig(), batch, random=False)
    if name == "operator":
        return Case(name, operator_step, _operator(), OperatorStepConfig(input_noise=0.1), _latent_batch)
    if name == "operator_unrolled":
        return Case(name, operator_step, _operator(), OperatorStepConfig(input_noise=0.1), _unrolled_batch)
    if name == "operator_decoded":
        return Case(name, operator_step, _operator(), OperatorStepConfig(input_noise=0.1, decoded_loss_weight=0.5),
                    _latent_batch, frozen={"decoder": _freeze(_codec().decoder)})
    if name == "diffusion":
        op = _freeze(_operator(7))
        return Case(name, diffusion_step, _denoiser(sigma_data=SD),
                    DiffusionStepConfig(num_levels=3, sigma_min=1e-2, sigma_data=SD),
                    lambda b: attach_operator_prediction(op, _latent_batch(b)))
    if name == "diffusion_operator_kw":
        return Case(name, diffusion_step, _denoiser(sigma_data=SD),
                    DiffusionStepConfig(num_levels=3, sigma_min=1e-2, sigma_data=SD),
                    _latent_batch, frozen={"operator": _freeze(_operator(7))})
    if name == "steady":
        def batch(b):
            lat = _latent_batch(b)
            return TensorDict({"z_coef": lat["z_t"], "z_sol": lat["z_next"], "task_id": lat["task_id"],
                               "sample_id": lat["sample_id"]}, batch_size=[b])
        return Case(name, steady_step, _denoiser(), SteadyStepConfig(num_levels=4, sigma_min=1e-2), batch)
    if name == "consistency":
        op = _freeze(_operator(7))
        # Teacher and target deliberately keep requires_grad=True: no_grad alone must stop them.
        return Case(name, consistency_step, _denoiser(11, SD),
                    ConsistencyStepConfig(num_scales=6, sigma_min=1e-2, sigma_data=SD),
                    lambda b: attach_operator_prediction(op, _latent_batch(b)),
                    frozen={"teacher": _denoiser(12, SD), "target": _denoiser(13, SD)})
    raise KeyError(name)


NAMES = ["autoencoder", "operator", "operator_unrolled", "operator_decoded", "diffusion", "diffusion_operator_kw", "steady", "consistency"]
CASES = {name: _make_case(name) for name in NAMES}


def _loss(case: Case, batch: TensorDict, seed: int = 0, params: dict | None = None):
    g = torch.Generator().manual_seed(seed)
    params = dict(case.model.named_parameters()) if params is None else params
    return case.step(case.model, params, batch, cfg=case.cfg, generator=g, **case.frozen)


@pytest.mark.parametrize("name", NAMES)
def test_loss_and_metrics_shapes(name):
    case = CASES[name]
    for b in (1, 3):
        loss, metrics = _loss(case, case.batch(b))
        assert loss.shape == () and torch.isfinite(loss) and loss >= 0
        assert isinstance(metrics, TensorDict) and metrics.batch_size == torch.Size([])
        assert len(metrics.keys()) >= 1
        for key, value in metrics.items():
            assert value.shape == () and not value.requires_grad and torch.isfinite(value), key


@pytest.mark.parametrize("name", NAMES)
def test_seed_determinism_and_generator_untouched(name):
    case = CASES[name]
    batch = case.batch(4)
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    first, _ = case.step(case.model, dict(case.model.named_parameters()), batch, cfg=case.cfg, generator=g,
                         **case.frozen)
    assert torch.equal(g.get_state(), state), "a step must peek at the generator, not advance it"
    again, _ = _loss(case, batch, seed=3)
    assert torch.equal(first, again)
    other, _ = _loss(case, batch, seed=4)
    assert (not torch.equal(first, other)) == case.random


@pytest.mark.parametrize("name", NAMES)
@HYP
@given(b=st.integers(2, 6), cut=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_batch_mean_equals_weighted_halves(name, b, cut, seed):
    case = CASES[name]
    cut = min(cut, b - 1)
    batch = case.batch(b)
    with torch.no_grad():
        whole, _ = _loss(case, batch, seed)
        first, _ = _loss(case, batch[:cut], seed)
        second, _ = _loss(case, batch[cut:], seed)
    assert torch.allclose(whole, (cut * first + (b - cut) * second) / b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
@HYP
@given(b=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), perm_seed=st.integers(0, 1000))
def test_permuting_the_batch_keeps_the_loss(name, b, seed, perm_seed):
    case = CASES[name]
    batch = case.batch(b)
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(perm_seed))
    with torch.no_grad():
        loss, metrics = _loss(case, batch, seed)
        loss_p, metrics_p = _loss(case, batch[perm], seed)
    assert torch.allclose(loss, loss_p, rtol=1e-5, atol=1e-7)
    for key in metrics.keys():
        assert torch.allclose(metrics[key], metrics_p[key], rtol=1e-5, atol=1e-7), key


@pytest.mark.parametrize("name", NAMES)
def test_gradients_reach_trained_params_only(name):
    case = CASES[name]
    frozen_before = {k: [p.detach().clone() for p in m.parameters()] for k, m in case.frozen.items()}
    params = {k: p for k, p in case.model.named_parameters() if p.requires_grad}
    loss, _ = _loss(case, case.batch(3), params=params)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    assert all(g is None or torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0
    # Frozen networks: no gradient even through backward(), and unchanged values.
    for m in case.frozen.values():
        for p in m.parameters():
            p.grad = None
    loss, _ = _loss(case, case.batch(3), params=params)
    loss.backward()
    for key, m in case.frozen.items():
        assert all(p.grad is None for p in m.parameters()), key
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), frozen_before[key])), key
    case.model.zero_grad(set_to_none=True)


def test_operator_without_noise_is_plain_latent_mse():
    case = CASES["operator"]
    batch = case.batch(3)
    loss, metrics = operator_step(case.model, dict(case.model.named_parameters()), batch,
                                  cfg=OperatorStepConfig(), generator=torch.Generator())
    pred = case.model(batch["z_t"], batch["dt"], batch["task_id"])
    assert torch.allclose(loss, (pred - batch["z_next"]).square().mean(), rtol=1e-5)
    assert torch.allclose(metrics["latent_mse"], loss)


def test_operator_unrolled_loss_is_the_mean_over_its_own_rollout():
    case = CASES["operator_unrolled"]
    batch = case.batch(3)
    params = dict(case.model.named_parameters())
    loss, _ = operator_step(case.model, params, batch, cfg=OperatorStepConfig(), generator=torch.Generator())
    z, losses = batch["z_t"], []
    for r in range(batch["z_seq"].shape[1]):
        z = case.model(z, batch["dt"], batch["task_id"])  # predictions fed back, not the truth
        losses.append((z - batch["z_seq"][:, r]).square().mean())
    assert torch.allclose(loss, torch.stack(losses).mean(), rtol=1e-5)
    # pushforward: the same loss value; gradients stop at each step's input, so they differ
    grads = {}
    for mode in ("full", "pushforward"):
        value, _ = operator_step(case.model, params, batch, cfg=OperatorStepConfig(unroll_grad=mode),
                                 generator=torch.Generator())
        assert torch.allclose(value, loss, rtol=1e-5)
        grads[mode] = torch.autograd.grad(value, list(params.values()), allow_unused=True)
    assert any(a is not None and b is not None and not torch.allclose(a, b)
               for a, b in zip(grads["full"], grads["pushforward"]))


def test_operator_decoded_loss_needs_its_inputs():
    case = CASES["operator_decoded"]
    params = dict(case.model.named_parameters())
    batch = case.batch(2)
    with pytest.raises(ValueError, match="u_next"):
        operator_step(case.model, params, batch.exclude("u_next"), cfg=case.cfg, generator=torch.Generator(),
                      **case.frozen)
    with pytest.raises(ValueError, match="decoder"):
        operator_step(case.model, params, batch, cfg=case.cfg, generator=torch.Generator())
    trainable = _codec().decoder
    with pytest.raises(ValueError, match="require grad"):
        operator_step(case.model, params, batch, cfg=case.cfg, generator=torch.Generator(), decoder=trainable)


def test_missing_sample_id_is_refused():
    case = CASES["diffusion"]
    with pytest.raises(KeyError, match="sample_id"):
        _loss(case, case.batch(2).exclude("sample_id"))


class _Flat(nn.Module):
    """An encoder that keeps the field, flattened to tokens of one number: [B, C, X] -> [B, C * X, 1]."""

    def forward(self, u):
        return u.reshape(u.shape[0], -1, 1)


def test_autoencoder_identity_has_zero_loss_and_relative_is_scale_free():
    class Unflat(nn.Module):
        def forward(self, z, grid_shape):
            return z.reshape(z.shape[0], -1, *grid_shape)

    u = torch.randn(3, C, X)
    batch = TensorDict({"u": u, "sample_id": torch.arange(3)}, batch_size=[3])
    ident = Autoencoder(_Flat(), Unflat())
    loss, metrics = autoencoder_step(ident, {}, batch, cfg=AutoencoderStepConfig(), generator=torch.Generator())
    assert loss == 0 and metrics["mse"] == 0
    zero = Autoencoder(_Flat(), type("Zero", (nn.Module,), {"forward": lambda self, z, s: torch.zeros(z.shape[0], C, *s)})())
    for scale in (0.1, 1e3):  # eps = 1e-8 is absolute: keep the mean square well above it
        b2 = TensorDict({"u": scale * u, "sample_id": torch.arange(3)}, batch_size=[3])
        rel, _ = autoencoder_step(zero, {}, b2, cfg=AutoencoderStepConfig(), generator=torch.Generator())
        assert torch.allclose(rel, torch.tensor(1.0), rtol=1e-4)


def test_autoencoder_nrmse_loss_is_the_per_field_nrmse_of_each_frame():
    """loss "nrmse": each frame's fields' nRMSE (core.metrics, not squared), mean over the fields
    that are not zero on that frame, then over the batch; a frame twice as wrong counts twice,
    not four times, and the other losses keep their meaning."""
    from core.metrics import nrmse_per_step

    g = torch.Generator().manual_seed(3)
    u = torch.randn(4, 2, X, generator=g)
    u[1, 1] = 0.0  # a field at rest: no relative error there
    noise = torch.randn(u.shape, generator=g) * torch.tensor([1e-3, 1e-2, 1e-1, 1.0])[:, None, None]

    class Noisy(nn.Module):
        def forward(self, z, grid_shape):
            return z.reshape(z.shape[0], -1, *grid_shape) + noise

    model = Autoencoder(_Flat(), Noisy())
    batch = TensorDict({"u": u, "sample_id": torch.arange(4)}, batch_size=[4])
    got = {loss: autoencoder_step(model, {}, batch, cfg=AutoencoderStepConfig(loss=loss))[0]
           for loss in ("nrmse", "squared_relative", "mse")}
    n_BC = torch.stack([nrmse_per_step((u + noise)[i:i + 1, :, None], u[i:i + 1, :, None])[:, 0]
                        for i in range(len(u))])  # [B, C]
    per_frame = torch.stack([n_BC[0].mean(), n_BC[1, 0], n_BC[2].mean(), n_BC[3].mean()])
    assert got["nrmse"].item() == pytest.approx(per_frame.mean().item(), rel=1e-5)
    mse_B = noise.square().flatten(1).mean(1)
    assert got["mse"].item() == pytest.approx(mse_B.mean().item(), rel=1e-5)
    rel_B = mse_B / (u.square().flatten(1).mean(1) + 1e-8)
    assert got["squared_relative"].item() == pytest.approx(rel_B.mean().item(), rel=1e-5)


def test_consistency_last_pair_targets_the_teacher_step_exactly():
    """With two grid points every pair ends at sigma_min, where f(x, sigma_min) = x: the
    target is the teacher's Euler step itself, whatever the target network's weights."""
    case = CASES["consistency"]
    cfg = ConsistencyStepConfig(num_scales=2, sigma_min=1e-2, sigma_data=SD)
    batch = case.batch(3)
    params = dict(case.model.named_parameters())
    g = torch.Generator().manual_seed(0)
    loss_a, _ = consistency_step(case.model, params, batch, cfg=cfg, generator=g, **case.frozen)
    other = {"teacher": case.frozen["teacher"], "target": _denoiser(99, SD)}
    loss_b, _ = consistency_step(case.model, params, batch, cfg=cfg, generator=g, **other)
    assert torch.equal(loss_a, loss_b)


def test_step_configs_carry_their_models_sigma_data():
    for name in ("diffusion", "diffusion_operator_kw", "consistency"):
        case = CASES[name]
        models = [case.model] + [m for k, m in case.frozen.items() if k in ("teacher", "target")]
        assert all(m.sigma_data == case.cfg.sigma_data for m in models), name


@pytest.mark.parametrize("rms", [1e-2, 1.0])
def test_refiner_loss_has_unit_scale_at_every_level_when_sigma_data_is_the_signal_rms(rms):
    """EDM preconditioning: a Denoiser whose network outputs zeros (a fresh one) has expected
    loss 1 at every noised level when sigma_data is the target's RMS, and 1 + sd^2 at level 0
    (input zeros, sigma 1). With sigma_data = 1 on a residual of RMS 1e-2 (the bug), level 0
    (the prediction from the condition) has a loss of ~2e-4: its target is ~70x below the
    network's unit output scale."""
    b, sigmas = 600, refiner_sigmas(3, 1e-3)
    g = torch.Generator().manual_seed(0)
    target, cond = rms * torch.randn(b, L, D, generator=g), torch.randn(b, L, D, generator=g)
    dt, tid = torch.full((b,), 0.1), torch.zeros(b, dtype=torch.int64)
    keys = sample_keys(step_seed(g), TensorDict({"sample_id": torch.arange(b)}, [b]))

    def per_level(sd: float) -> torch.Tensor:
        den = Denoiser(D, **BACKBONE, sigma_data=sd)  # fresh: zero output layer, D = c_skip * x
        with torch.no_grad():
            loss_B, _, level_B = refiner_loss(den, target, cond, dt, tid, keys, sigmas_K=sigmas, sigma_data=sd)
        return torch.stack([loss_B[level_B == k].mean() for k in range(3)])

    torch.testing.assert_close(per_level(rms), torch.tensor([1 + rms**2, 1.0, 1.0]), rtol=0.1, atol=0)
    if rms != 1.0:
        assert per_level(1.0)[0] < 1e-3


def test_continuous_levels_train_every_sigma_between_the_finest_level_and_one():
    """With ``continuous``, the noisy levels' sigmas are log-uniform in [sigma_min, 1] (what the
    consistency stage's ODE steps query), level 0 still sees zeros at sigma 1, and a sample's sigma
    depends on its keys alone (not its place in the batch); without it only the sampler's levels."""
    b, sigma_min = 4000, 1e-3
    sigmas = refiner_sigmas(3, sigma_min)
    target, cond = torch.randn(b, L, D), torch.zeros(b, L, D)
    dt, tid = torch.zeros(b), torch.zeros(b, dtype=torch.int64)
    keys = sample_keys(torch.tensor([7, 11]), TensorDict({"sample_id": torch.arange(b)}, [b]))
    seen = {}

    def recorder(x, c, sigma_B, dt_B, task_B):
        seen["sigma"], seen["x"] = sigma_B.clone(), x.clone()
        return x

    def sigmas_seen(continuous: bool, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = (keys[0][order], keys[1][order])
        _, _, level_B = refiner_loss(recorder, target[order], cond[order], dt[order], tid[order], k,
                                     sigmas_K=sigmas, sigma_data=1.0, continuous=continuous)
        return seen["sigma"], level_B

    ident = torch.arange(b)
    sigma_B, level_B = sigmas_seen(True, ident)
    noisy = sigma_B[level_B > 0]
    assert (level_B == 0).float().mean().item() == pytest.approx(1 / 3, abs=0.03)
    assert (sigma_B[level_B == 0] == 1.0).all() and (seen["x"][level_B == 0] == 0).all()
    u = torch.log(noisy) / math.log(sigma_min)  # uniform in (0, 1) if log-uniform
    assert u.min() > 0 and u.max() < 1
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert (counts - noisy.numel() / 10).abs().max() < 5 * math.sqrt(noisy.numel() / 10), counts
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(sigmas_seen(True, perm)[0], sigma_B[perm], rtol=0, atol=0)
    discrete, _ = sigmas_seen(False, ident)
    assert set(discrete.unique().tolist()) <= set(sigmas.tolist())


class _GaussianDenoiser:
    """The exact denoiser of a residual drawn N(0, sd^2) per element, whatever the condition:
    ``D(x, sigma) = x sd^2 / (sd^2 + sigma^2)``."""

    def __init__(self, sd: float) -> None:
        self.sigma_data, self.calls = sd, 0

    def __call__(self, x, cond, sigma_B, dt, task_id):
        self.calls += 1
        return x * self.sigma_data**2 / (self.sigma_data**2 + sigma_B[:, None, None] ** 2)


@pytest.mark.parametrize("sd", [0.02, 0.05, 0.22, 0.5])
def test_ode_sampler_draws_the_residuals_spread_and_the_levels_sampler_does_not(sd):
    """With the exact denoiser of a Gaussian residual, EDM's ODE sampler (5 levels) draws samples of
    its spread (within 10%) from 8 calls; PDE-Refiner's levels start from the level-0 prediction (0
    here) and spread no wider than their first noise, far below sd when sd is above it."""
    b = 4000
    z_op, dt, tid = torch.zeros(b, L, D), torch.zeros(b), torch.zeros(b, dtype=torch.int64)
    den = _GaussianDenoiser(sd)
    r = ode_sample(den, z_op, dt, tid, steps=5, sigma_min=2e-3, generator=torch.Generator().manual_seed(0))
    assert abs(r.std().item() / sd - 1) < 0.1 and den.calls == 2 * 5 - 2
    levels = refine(den, z_op, dt, tid, num_levels=4, sigma_min=2e-3, generator=torch.Generator().manual_seed(0))
    first_noise = refiner_sigmas(4, 2e-3)[1].item()
    assert levels.std().item() < first_noise * 1.05
    if sd > 2 * first_noise:
        assert levels.std().item() < 0.6 * sd


def test_consistency_loss_is_in_units_of_sigma_data():
    case = CASES["consistency"]
    batch = case.batch(3)
    params = dict(case.model.named_parameters())
    losses = [consistency_step(case.model, params, batch, cfg=ConsistencyStepConfig(num_scales=6, sigma_min=1e-2,
                                                                                    sigma_data=sd),
                               generator=torch.Generator().manual_seed(0), **case.frozen)[0] for sd in (SD, 1.0)]
    torch.testing.assert_close(losses[0], losses[1] / SD**2)


def test_ema_update_in_place():
    target = [torch.zeros(3), torch.ones(2)]
    student = [torch.ones(3), torch.zeros(2)]
    ema_update_(target, student, 0.75)
    assert torch.allclose(target[0], torch.full((3,), 0.25)) and torch.allclose(target[1], torch.full((2,), 0.75))
    ema_update_(target, student, 0.0)
    assert all(torch.equal(t, s) for t, s in zip(target, student))
    with pytest.raises(ValueError):
        ema_update_(target, student, 1.5)
    with pytest.raises(ValueError):
        ema_update_(target, student[:1], 0.5)


def test_per_sample_noise_depends_on_seed_and_key_only():
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([5, 9, 2**40 + 5])
    td = TensorDict({"sample_id": ids}, batch_size=[3])
    keys = sample_keys(step_seed(g), td)
    eps = sample_normal(keys, 3, (L, D))
    assert eps.shape == (3, L, D)
    perm = torch.tensor([2, 0, 1])
    eps_p = sample_normal(sample_keys(step_seed(g), td[perm]), 3, (L, D))
    assert torch.equal(eps_p, eps[perm])
    assert not torch.equal(eps[0], eps[2])  # ids differing only above bit 32 differ
    assert not torch.equal(sample_normal(keys, 4, (L, D)), eps)  # streams differ
    with_t = TensorDict({"sample_id": ids, "t": torch.tensor([0, 0, 1])}, batch_size=[3])
    assert not torch.equal(sample_normal(sample_keys(step_seed(g), with_t), 3, (L, D))[2], eps[2])
    big = sample_normal(sample_keys(step_seed(g), TensorDict({"sample_id": torch.arange(256)}, [256])), 3, (64,))
    assert abs(float(big.mean())) < 0.02 and abs(float(big.std()) - 1) < 0.02
    idx = sample_index(keys, 2, 3)
    assert idx.dtype == torch.int64 and bool(((idx >= 0) & (idx < 3)).all())


def test_inference_samplers():
    den, op = CASES["diffusion"].model, CASES["diffusion"].frozen.get("operator") or _operator(7)
    batch = _latent_batch(2)
    z_op = op(batch["z_t"], batch["dt"], batch["task_id"])
    kw = dict(num_levels=3, sigma_min=1e-2)
    a = refine(den, z_op, batch["dt"], batch["task_id"], generator=torch.Generator().manual_seed(1), **kw)
    b = refine(den, z_op, batch["dt"], batch["task_id"], generator=torch.Generator().manual_seed(1), **kw)
    assert a.shape == z_op.shape and torch.equal(a, b) and not a.requires_grad
    # One level: the plain prediction from zeros at sigma 1, no randomness.
    one = refine(den, z_op, batch["dt"], batch["task_id"], num_levels=1, sigma_min=1e-2, generator=torch.Generator())
    with torch.no_grad():
        r0 = den(torch.zeros_like(z_op), z_op, torch.ones(2), batch["dt"], batch["task_id"])
    assert torch.allclose(one, z_op + r0)
    for steps in (1, 2):
        c = consistency_sample(den, z_op, batch["dt"], batch["task_id"], steps=steps, sigma_min=1e-2,
                               generator=torch.Generator().manual_seed(1))
        assert c.shape == z_op.shape and torch.isfinite(c).all()
    with pytest.raises(ValueError):
        consistency_sample(den, z_op, batch["dt"], batch["task_id"], steps=3, generator=torch.Generator())
    s = steady_sample(den, batch["z_t"], batch["task_id"], num_levels=2, sigma_min=1e-2,
                      generator=torch.Generator().manual_seed(0))
    assert s.shape == batch["z_t"].shape and torch.isfinite(s).all()


@pytest.mark.parametrize("make", [
    lambda: OperatorStepConfig(input_noise=-1.0), lambda: DiffusionStepConfig(num_levels=0),
    lambda: DiffusionStepConfig(sigma_min=1.5), lambda: SteadyStepConfig(sigma_data=0.0),
    lambda: ConsistencyStepConfig(num_scales=1), lambda: ConsistencyStepConfig(sigma_min=2.0),
    lambda: ConsistencyStepConfig(sigma_data=0.0), lambda: DiffusionStepConfig(sigma_data=-1.0),
    lambda: AutoencoderStepConfig(eps=0.0), lambda: AutoencoderStepConfig(loss="l1"),
])
def test_configs_reject_bad_values(make):
    with pytest.raises(ValueError):
        make()


def _shifted(params: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (p + 0.02 * torch.randn(p.shape, generator=g)).detach() for k, p in params.items()}


@pytest.mark.parametrize("name", NAMES)
def test_the_step_computes_with_the_params_it_is_given(name):
    """``params`` are the weights, not the module's own tensors: other params give exactly the loss
    of a copy of the model that holds those tensors as its own."""
    import copy

    case = CASES[name]
    batch = case.batch(3)
    own = {k: p.detach() for k, p in case.model.named_parameters()}
    other = _shifted(own, seed=5)
    with torch.no_grad():
        base, _ = _loss(case, batch, params=own)
        moved, _ = _loss(case, batch, params=other)
        twin = copy.deepcopy(case.model)
        for k, p in twin.named_parameters():
            p.copy_(other[k])
        reference, _ = _loss(Case(case.name, case.step, twin, case.cfg, case.batch, case.frozen), batch)
    assert not torch.equal(base, moved)
    assert torch.equal(moved, reference)


@pytest.mark.parametrize("name", NAMES)
def test_torch_func_grad_of_the_step_equals_autograd(name):
    """The step is a function of ``params`` in torch.func's sense: its `torch.func.grad` equals the
    gradient autograd computes through the same call."""
    case = CASES[name]
    batch = case.batch(3)
    params = {k: p.detach().requires_grad_(True) for k, p in case.model.named_parameters() if p.requires_grad}

    def loss_of(p):
        return _loss(case, batch, params=p)[0]

    functional = torch.func.grad(loss_of)({k: p.detach() for k, p in params.items()})
    autograd = dict(zip(params, torch.autograd.grad(loss_of(params), list(params.values()), allow_unused=True)))
    assert set(functional) == set(params)
    for k in params:
        want = torch.zeros_like(params[k]) if autograd[k] is None else autograd[k]
        torch.testing.assert_close(functional[k], want, rtol=1e-5, atol=1e-8, msg=k)
    assert any(float(g.abs().sum()) > 0 for g in functional.values())


def test_steady_prior_learns_and_samples_the_deviation_from_the_solution_mean():
    """With a solution mean m the steady loss is exactly the loss on ``z_sol - m[task]``, and the
    sampler returns exactly the mean-free sample plus ``m[task]``, for each sample's own task."""
    case = CASES["steady"]
    batch = case.batch(4)
    batch["task_id"] = torch.tensor([0, 1, 1, 0])
    mean = torch.randn(2, *batch["z_sol"].shape[1:], generator=torch.Generator().manual_seed(8))
    params = dict(case.model.named_parameters())
    with_mean = steady_step(case.model, params, batch, cfg=case.cfg, generator=torch.Generator().manual_seed(3),
                            solution_mean=mean)
    shifted = batch.copy()
    shifted["z_sol"] = batch["z_sol"] - mean[batch["task_id"]]
    plain = steady_step(case.model, params, shifted, cfg=case.cfg, generator=torch.Generator().manual_seed(3))
    assert torch.equal(with_mean[0], plain[0]) and not torch.equal(with_mean[0], _loss(case, batch)[0])
    kw = {"num_levels": 2, "sigma_min": 1e-2}
    sampled = steady_sample(case.model, batch["z_coef"], batch["task_id"], generator=torch.Generator().manual_seed(4),
                            solution_mean=mean, **kw)
    deviation = steady_sample(case.model, batch["z_coef"], batch["task_id"], generator=torch.Generator().manual_seed(4),
                              **kw)
    assert torch.equal(sampled, deviation + mean[batch["task_id"]])


def test_denoiser_weights_carry_their_solution_mean():
    """A Denoiser built without a mean takes the one stored in the weights it loads; weights saved
    before the mean existed load as none; a mean of the wrong shape is refused when building."""
    mean = torch.randn(BACKBONE["num_tasks"], 6, D)
    stored = Denoiser(D, **BACKBONE, solution_mean=mean).state_dict()
    fresh = Denoiser(D, **BACKBONE)
    assert fresh.solution_mean is None
    fresh.load_state_dict(stored)
    assert torch.equal(fresh.solution_mean, mean)
    old = {k: v for k, v in stored.items() if k != SOLUTION_MEAN_KEY}
    again = Denoiser(D, **BACKBONE, solution_mean=mean)
    again.load_state_dict(old)
    assert again.solution_mean is None
    with pytest.raises(ValueError, match="solution_mean"):
        Denoiser(D, **BACKBONE, solution_mean=torch.zeros(6, D))


def test_operator_task_weights_multiply_each_samples_loss_by_its_tasks_weight():
    """The weighted loss is the mean of each sample's unweighted loss times its task's weight; the
    reported latent_mse stays the unweighted mean; weights of 1 give the plain loss bitwise."""
    case = CASES["operator"]
    batch = case.batch(4)
    batch["task_id"] = torch.tensor([0, 1, 1, 0])
    weight = torch.tensor([0.25, 1.75])
    plain, plain_metrics = _loss(case, batch, seed=2)
    loss, metrics = case.step(case.model, dict(case.model.named_parameters()), batch, cfg=case.cfg,
                              generator=torch.Generator().manual_seed(2), task_weight=weight)
    per_sample = [_loss(case, batch[i:i + 1], seed=2)[0] for i in range(4)]  # noise is per sample
    expected = sum(w * s for w, s in zip(weight[batch["task_id"]], per_sample)) / 4
    assert torch.allclose(loss, expected, rtol=1e-5) and not torch.allclose(loss, plain, rtol=1e-3)
    assert torch.equal(metrics["latent_mse"], plain_metrics["latent_mse"])
    ones, _ = case.step(case.model, dict(case.model.named_parameters()), batch, cfg=case.cfg,
                        generator=torch.Generator().manual_seed(2), task_weight=torch.ones(2))
    assert torch.equal(ones, plain)
