"""Latent rollout and decoding (core/rollout.py) on tiny real models.

Legend: B batch, T time (steps + 1), L tokens, D latent dim, C channels, X grid points.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from core.models.denoiser import Denoiser
from core.models.grid_codec import GridDecoder
from core.models.pdet import PDETUNet
from core.rollout import consistency_refiner, decode_trajectory, diffusion_refiner, rollout

L, D, C, X, TASKS = 8, 4, 1, 12, 2
BACKBONE = dict(hidden_dim=8, depths=(1,), num_heads=2, group_size=4, num_tasks=TASKS, mlp_ratio=2.0)


def _inputs(b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, L, D, generator=g), 0.01 + torch.rand(b, generator=g),
            torch.randint(0, TASKS, (b,), generator=g))


def _operator() -> PDETUNet:
    torch.manual_seed(0)
    op = PDETUNet(D, **BACKBONE)
    with torch.no_grad():  # a fresh operator is the identity (zero output layer): make it move
        op.out_proj.weight.normal_(0.0, 0.1)
    return op


@settings(max_examples=6, deadline=None, derandomize=True)
@given(b=st.integers(1, 3), steps=st.integers(0, 4))
def test_rollout_shapes_and_first_frame(b, steps):
    op = _operator()
    z0, dt, task = _inputs(b)
    z = rollout(op, z0, dt, task, steps)
    assert z.shape == (b, steps + 1, L, D) and not z.requires_grad and torch.isfinite(z).all()
    assert torch.equal(z[:, 0], z0)
    if steps:
        assert torch.allclose(z[:, 1], op(z0, dt, task).detach())
        assert not torch.allclose(z[:, 1], z0)


def test_identity_operator_repeats_z0(monkeypatch):
    op = _operator()
    monkeypatch.setattr(op, "forward", lambda z, dt, task_id: z)
    z0, dt, task = _inputs(2)
    z = rollout(op, z0, dt, task, 5)
    assert torch.equal(z, z0[:, None].expand(-1, 6, -1, -1))


def test_refine_is_applied_after_every_step(monkeypatch):
    op = _operator()
    monkeypatch.setattr(op, "forward", lambda z, dt, task_id: z)
    seen = []

    def refine(z_op, dt, task_id):
        seen.append((dt, task_id))
        return z_op + 1.0

    z0, dt, task = _inputs(2)
    z = rollout(op, z0, dt, task, 4, refine=refine)
    assert len(seen) == 4 and all(d is dt and t is task for d, t in seen)
    for t in range(5):
        assert torch.allclose(z[:, t], z0 + t)


def test_negative_steps_are_refused():
    z0, dt, task = _inputs(1)
    with pytest.raises(ValueError):
        rollout(_operator(), z0, dt, task, -1)


def test_refiners_from_diffusion_and_consistency():
    torch.manual_seed(1)
    den = Denoiser(D, **BACKBONE)
    op = _operator()
    z0, dt, task = _inputs(2)
    for make in (lambda g: diffusion_refiner(den, num_levels=3, sigma_min=1e-2, generator=g),
                 lambda g: consistency_refiner(den, steps=2, sigma_min=1e-2, generator=g)):
        a = rollout(op, z0, dt, task, 3, refine=make(torch.Generator().manual_seed(5)))
        b = rollout(op, z0, dt, task, 3, refine=make(torch.Generator().manual_seed(5)))
        plain = rollout(op, z0, dt, task, 3)
        assert a.shape == plain.shape and torch.equal(a, b) and torch.isfinite(a).all()
        assert not torch.allclose(a[:, 1:], plain[:, 1:])
    with pytest.raises(ValueError):
        consistency_refiner(den, steps=3, generator=torch.Generator())


def test_a_two_step_student_re_noises_to_the_chosen_level():
    """The student's second call sees sigma_mid (shifted by sigma_min, as it was trained), the
    geometric mean of the ends when none is chosen."""
    seen = []

    def student(x, z_op, shifted_B, dt, task_id):
        seen.append(float(shifted_B[0]))
        return torch.zeros_like(z_op)

    z0, dt, task = _inputs(2)
    for mid, want in ((None, (1e-2 * 1.0) ** 0.5), (0.3, 0.3)):
        seen.clear()
        consistency_refiner(student, steps=2, sigma_min=1e-2, sigma_mid=mid, generator=torch.Generator())(z0, dt, task)
        assert seen == pytest.approx([1.0 - 1e-2, want - 1e-2])


def test_decode_trajectory_shapes_and_chunks():
    torch.manual_seed(2)
    dec = GridDecoder(C, L, D, hidden=8, ndims=(1,), depth=1, heads=2)
    z = torch.randn(2, 3, L, D)
    u = decode_trajectory(dec, z, (X,))
    assert u.shape == (2, 3, C, X) and not u.requires_grad
    assert torch.allclose(u[1, 2], dec(z[1, 2:3], (X,))[0], atol=1e-6)
    assert torch.allclose(decode_trajectory(dec, z, (X,), chunk=4), u, atol=1e-6)
    with pytest.raises(ValueError):
        decode_trajectory(dec, z, (X,), chunk=0)
