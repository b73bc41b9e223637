"""Behaviour of the field codec (codec ``fields``, core/models/field_codec.py): fields with identity.

Legend: B batch, F fields, X/Y grid sizes, L tokens per frame, D latent width.
Models are tiny and CPU-only; seeds are fixed here (core/ never seeds). Comparisons that reorder a
float sum (the merge over fields) allow 1e-5 of the compared tensor's largest magnitude: float32
sums of a few terms in another order differ by a few ulps, far below that.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.models.field_codec import FieldCodec, dataset_buffer_key, field_key, fit_field_scales
from core.models.registry import build, describe, rebuild

FIELDS = ["u", "Vx", "Vy", "density"]
DATASETS = [["line", ["u"]], ["flow", ["Vx", "Vy", "density"]]]
"""A 1D dataset of one field and a 2D one of three (the default codec's)."""
ORDER_TOLERANCE = 1e-5
"""Relative tolerance of a result whose float sums ran in another order (see the module docstring)."""


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the shared 2-core machine runs these small models fastest that way."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _codec(seed: int = 0, datasets: list | None = None, *, fresh: bool = False, tasks=None) -> FieldCodec:
    """A tiny codec of `datasets` (default DATASETS); its decoder heads (zero when `fresh`) given random
    weights, so every output depends on every parameter, as a trained codec's does."""
    torch.manual_seed(seed)
    model = build("codec", "fields", datasets=datasets or DATASETS, dim=16, tokens={"1": 16, "2": 16},
                  modes={"1": 2, "2": 4}, hidden=32, depth=1, heads=4, tasks=tasks)
    if not fresh:
        g = torch.Generator().manual_seed(seed + 1000)
        with torch.no_grad():
            for p in model.decoder.head.parameters():
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _smooth(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Smooth random fields [B, F, *grid] on the unit interval/square: three sine modes with random
    amplitudes per field (what a codec of a few cells and modes can represent well)."""
    B, F, *grid = shape
    axes = [(torch.arange(n) + 0.5) / n for n in grid]
    mesh = torch.meshgrid(*axes, indexing="ij")
    a = torch.randn(B, F, 3, generator=generator)
    out = torch.zeros(shape)
    for k in range(3):
        wave = torch.ones(grid)
        for i, x in enumerate(mesh):
            wave = wave * torch.sin(2 * math.pi * (k + 1 + i) * x + k)
        out += a[:, :, k].reshape(B, F, *[1] * len(grid)) * wave
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= ORDER_TOLERANCE * b.abs().max())


@settings(max_examples=12, deadline=None)
@given(perm=st.permutations(range(3)))
def test_permuting_fields_permutes_the_decoded_fields_and_keeps_the_latent(perm: list[int]) -> None:
    model = _codec().eval()
    u = _smooth((2, 3, 16, 16), torch.Generator().manual_seed(1))
    names = ("Vx", "Vy", "density")
    with torch.no_grad():
        z, u_hat = model(u, "flow")
        z_p, u_hat_p = model(u[:, perm], "flow", tuple(names[i] for i in perm))
    assert _close(z_p, z)
    assert _close(u_hat_p, u_hat[:, perm])


def test_decode_gives_exactly_the_requested_fields() -> None:
    model = _codec().eval()
    z = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        all_three = model.decode(z, "flow", (16, 8))
        one = model.decode(z, "flow", (16, 8), ("Vy",))
    assert all_three.shape == (2, 3, 16, 8) and one.shape == (2, 1, 16, 8)
    assert _close(one[:, 0], all_three[:, 1])  # a field reads the tokens alone: the others change nothing


def test_adding_a_dataset_leaves_an_old_task_bitwise_unchanged() -> None:
    model = _codec().eval()
    u = _smooth((2, 3, 16, 16), torch.Generator().manual_seed(3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        z, u_hat = model(u, "flow")
    model.add_dataset("wave", ["pressure", "Vx"], generator=torch.Generator().manual_seed(4))
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert set(after) - set(before) == {f"{half}.{key}" for half in ("encoder", "decoder") for key in (
        f"embed.{field_key('pressure')}", f"scales.{dataset_buffer_key('wave')}")}  # Vx: a known field
    with torch.no_grad():
        z2, u_hat2 = model(u, "flow")
    assert torch.equal(z2, z) and torch.equal(u_hat2, u_hat)
    # The new dataset is usable at once, and a key already known is refused.
    with torch.no_grad():
        assert model(u[:, :2], "wave")[1].shape == (2, 2, 16, 16)
    with pytest.raises(ValueError, match="already known"):
        model.add_dataset("flow", ["Vx"])


def test_a_new_field_starts_at_the_mean_embedding_without_a_generator() -> None:
    model = _codec()
    mean = torch.stack([model.encoder.embed[field_key(n)] for n in FIELDS]).mean(0)
    model.add_dataset("heat", ["T"])
    assert torch.equal(model.encoder.embed[field_key("T")], mean)


def test_a_one_field_1d_task_and_a_three_field_2d_task_train_in_one_step() -> None:
    model = _codec()
    g = torch.Generator().manual_seed(5)
    u1, u2 = _smooth((3, 1, 32), g), _smooth((2, 3, 16, 16), g)
    tasks = ((u1, "line"), (u2, "flow"))
    z1, z2 = model.encode(u1, "line"), model.encode(u2, "flow")
    assert z1.shape[1:] == z2.shape[1:] == (16, 16)  # one token count per frame: one operator serves both

    # Shared: all but the per-field embeddings and the per-dimension patch, head and positions.
    shared = {n: p for n, p in model.named_parameters() if ".embed." not in n and ".patch." not in n
              and ".head." not in n and ".pos." not in n}
    grads = []
    for u, names in tasks:  # each task alone reaches every shared parameter
        model.zero_grad()
        ((model(u, names)[1] - u) ** 2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in shared.items()})
    # ... but the merge's scores: a frame of one field has merge weight 1 whatever they are.
    assert all(grads[0][n].abs().sum() > 0 for n in shared if not n.startswith("encoder.score"))
    assert all(grads[1][n].abs().sum() > 0 for n in shared)

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in shared.items()}
    opt.zero_grad()
    loss = sum(((model(u, names)[1] - u) ** 2).mean() for u, names in tasks)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(not torch.equal(p, before[n]) for n, p in shared.items())
    # Each task's field embeddings got their gradient in the joint step.
    assert model.encoder.embed[field_key("u")].grad is not None
    assert model.encoder.embed[field_key("Vy")].grad is not None


def test_rebuild_from_the_description_with_the_weights_gives_the_same_outputs() -> None:
    model = _codec(seed=6).eval()
    model.add_dataset("heat", ["T", "u"], generator=torch.Generator().manual_seed(7))
    description = json.loads(json.dumps(describe(model)))
    assert description["args"]["datasets"] == [*DATASETS, ["heat", ["T", "u"]]]
    torch.manual_seed(99)  # another initialisation, replaced by the weights
    twin = rebuild(description).eval()
    twin.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(8)
    for u, key in ((_smooth((2, 2, 32), g), "heat"), (_smooth((2, 3, 16, 16), g), "flow")):
        with torch.no_grad():
            assert all(torch.equal(a, b) for a, b in zip(twin(u, key), model(u, key)))


def test_reconstruction_error_falls_by_a_clear_factor_with_training() -> None:
    model = _codec(seed=9, datasets=[["line", ["u"]], ["pair", ["a", "b"]]], fresh=True)
    g = torch.Generator().manual_seed(10)
    tasks = ((_smooth((16, 1, 32), g), "line"), (_smooth((16, 2, 16, 16), g), "pair"))

    def errors() -> list[float]:
        with torch.no_grad():
            return [float((model(u, names)[1] - u).norm() / u.norm()) for u, names in tasks]

    with torch.no_grad():  # a fresh decoder returns zeros: nRMSE 1 (up to the norms' summation order)
        assert not any(model(u, names)[1].any() for u, names in tasks)
    start = errors()
    assert start == pytest.approx([1.0, 1.0], rel=1e-6)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(200):
        opt.zero_grad()
        sum(((model(u, names)[1] - u) ** 2).mean() for u, names in tasks).backward()
        opt.step()
    end = errors()
    # Relative to the task's own field norm and to the untrained codec: no absolute float threshold.
    # (Seed-fixed, 200 steps gave about 50x lower on the 1D task and 4x on the compressed 2D one.)
    assert all(e < 0.5 * s for e, s in zip(end, start)), (start, end)


def test_mistakes_are_value_errors_naming_them() -> None:
    model = _codec()
    with pytest.raises(ValueError, match="add_dataset"):
        model.encode(torch.zeros(1, 1, 32), "nope")
    with pytest.raises(ValueError, match="has fields"):
        model.encode(torch.zeros(1, 1, 32), "line", ("Vx",))
    with pytest.raises(ValueError, match="as many names"):
        model.encode(torch.zeros(1, 2, 32), "line")
    with pytest.raises(ValueError, match="spatial dimensions"):
        model.encode(torch.zeros(1, 1, 4, 4, 4), "line")
    with pytest.raises(ValueError, match="share the key"):
        _codec(datasets=[["x", ["a.b", "a_b"]]])
    with pytest.raises(ValueError, match="share the table"):
        _codec(datasets=[["a.b", ["u"]], ["a_b", ["u"]]])
    with pytest.raises(ValueError, match="does not know"):
        _codec(tasks=["flow", "wave"])
    with pytest.raises(ValueError, match="power of 4"):
        build("codec", "fields", datasets=[["x", ["u"]]], dim=8, tokens={"2": 8}, modes={"2": 2}, hidden=8, depth=1,
              heads=2)


def test_a_task_id_batch_and_a_bound_view_read_the_task_s_dataset() -> None:
    """The stack's batches carry task ids (``tasks`` names each task's dataset), as a tensor or one id on
    the host; its evaluation binds a task (``for_task``): each gives what the dataset's key gives."""
    model = _codec(tasks=["line", "flow"]).eval()
    u = _smooth((2, 3, 16, 16), torch.Generator().manual_seed(11))
    view = model.for_task(1)
    with torch.no_grad():
        z, u_hat = model(u, "flow")
        assert all(torch.equal(a, b) for a, b in zip(model(u, torch.ones(2, dtype=torch.long)), (z, u_hat)))
        assert all(torch.equal(a, b) for a, b in zip(model(u, 1), (z, u_hat)))
        assert torch.equal(view.encode(u), z) and torch.equal(view.decode(z, (16, 16)), u_hat)
        assert all(torch.equal(a, b) for a, b in zip(view(u), (z, u_hat)))
    with pytest.raises(ValueError, match="one task"):
        model(u, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="task ids 0..1"):
        model.for_task(2)
    with pytest.raises(ValueError, match="ids 0..1, got ids \\[2\\]"):
        model(u, 2)
    with pytest.raises(ValueError, match="knows datasets"):
        model.for_dataset("wave")


def test_fitted_scales_make_a_field_in_other_units_give_the_same_latent() -> None:
    """Normalisation per dataset and field (``fit_field_scales``): the same fields in other units
    (1000 u + 5) encode to the same latent and decode to 1000 times the decoded fields plus 5; a
    constant field keeps a finite scale."""
    g = torch.Generator().manual_seed(12)
    u = _smooth((4, 3, 16, 16), g)
    plain, other_units = _codec(seed=13).eval(), _codec(seed=13).eval()
    fitted = fit_field_scales(plain, [("flow", u[:2]), ("flow", u[2:])])
    assert list(fitted) == ["flow"] and list(fitted["flow"]) == ["Vx", "Vy", "density"] and fitted["flow"]["Vx"][1] > 0
    fit_field_scales(other_units, [("flow", 1000 * u + 5)])
    with torch.no_grad():
        z, u_hat = plain(u, "flow")
        z2, u_hat2 = other_units(1000 * u + 5, "flow")
    assert (z2 - z).abs().max() <= 1e-3 * z.abs().max()  # float32 rounding of 1000 u + 5, normalised back
    assert (u_hat2 - (1000 * u_hat + 5)).abs().max() <= 1e-3 * (1000 * u_hat + 5).abs().max()
    constant = fit_field_scales(_codec(), [("line", torch.full((2, 1, 32), 3.0))])
    assert constant == {"line": {"u": (3.0, 3.0)}}


def test_two_datasets_sharing_a_field_name_at_100x_scales_each_encode_as_alone() -> None:
    """A name two datasets share is one embedding with two normalisations: a flow whose velocity is
    100 times another's, fitted in one codec, encodes and decodes as a codec fitted on it alone does
    (bitwise: the same weights, the same table), and each dataset's table is its own data's mean and RMS."""
    g = torch.Generator().manual_seed(14)
    slow, fast = 0.01 * _smooth((4, 2, 16, 16), g), 1.0 * _smooth((4, 2, 16, 16), g) + 3.0
    pair = [["slow", ["Vx", "Vy"]], ["fast", ["Vx", "Vy"]]]
    both, alone = _codec(seed=15, datasets=pair).eval(), _codec(seed=15, datasets=pair).eval()
    fitted = fit_field_scales(both, [("slow", slow), ("fast", fast)])
    fit_field_scales(alone, [("slow", slow)])
    for key, u in (("slow", slow), ("fast", fast)):
        for c, name in enumerate(("Vx", "Vy")):
            values = u[:, c].double()
            assert fitted[key][name][0] == pytest.approx(float(values.mean()), abs=1e-9 + 1e-6 * float(values.std()))
            assert fitted[key][name][1] == pytest.approx(float(values.std(unbiased=False)), rel=1e-6)
    assert fitted["fast"]["Vx"][1] > 30 * fitted["slow"]["Vx"][1]
    with torch.no_grad():  # the fast flow's data change nothing of the slow one's encode and decode
        assert all(torch.equal(a, b) for a, b in zip(both(slow, "slow"), alone(slow, "slow")))
