"""The fair race's pieces (issue 31): the budget clock, schedules annealed to the budget, the budgeted
training loop (hard stop, validation off the clock, EMA), time to targets, the lr sweep, the
resumable result store, and the U-Net and plain-transformer peers.

Every budget test runs on a fake clock that the loss advances by a chosen step time, so nothing
depends on this machine's speed."""

from __future__ import annotations

import itertools
import math
import random
import warnings

import orjson
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import core.models.plain_transformer as pt
import core.models.unet  # registers unet1d, unet2d
from bench import budget as bb
from bench import result_store
from core.models.registry import build, describe, rebuild


class FakeClock:
    """Seconds that move only when a test moves them."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(step_times, budget_s, *, clock=None, **kwargs):
    """Train a Linear(2, 1) on a fixed batch; step ``k`` takes ``step_times(k)`` fake seconds.

    Returns (model returned, curve, live model, per-step log [(step, train_s, lr, loss)], clock)."""
    clock = clock or FakeClock()
    torch.manual_seed(0)
    live = nn.Linear(2, 1)
    x, y = torch.randn(8, 2), torch.randn(8, 1)
    steps = []

    def loss_fn(model, batch):
        clock.now += step_times(len(steps))
        return (model(batch[0]) - batch[1]).square().mean()

    def on_step(*entry):
        steps.append(entry)

    model, curve = bb.train_budgeted(live, lambda: (x, y), loss_fn, budget_s, 1e-2, clock=clock, on_step=on_step,
                                     **kwargs)
    return model, curve, live, steps, clock


# --- the clock and the schedules ---------------------------------------------------------------

def test_the_clock_counts_training_blocks_only():
    fake = FakeClock()
    clock = bb.BudgetClock(10.0, fake)
    with clock.training():
        fake.now += 4.0
    fake.now += 100.0  # validation, logging: outside the block
    with pytest.raises(RuntimeError), clock.training():
        fake.now += 4.0
        raise RuntimeError  # a failed step still cost its time
    assert (clock.spent, clock.remaining, clock.fraction, clock.exhausted) == (8.0, 2.0, 0.8, False)
    with clock.training():
        fake.now += 5.0
    assert (clock.spent, clock.remaining, clock.fraction, clock.exhausted) == (13.0, 0.0, 1.0, True)
    with pytest.raises(ValueError, match="budget_s"):
        bb.BudgetClock(0.0)


def test_cosine_anneals_from_base_to_its_final_value_exactly_at_the_budget():
    assert bb.cosine_lr(1e-3, 0.0) == 1e-3
    assert bb.cosine_lr(1e-3, 1.0) == 0.0
    assert bb.cosine_lr(3e-4, 1.0, final_ratio=0.1) == 3e-4 * 0.1
    assert bb.cosine_lr(1e-3, 2.0, final_ratio=0.1) == 1e-3 * 0.1  # past the budget: stays there
    assert bb.cosine_lr(1e-3, 0.05, warmup_fraction=0.1) == pytest.approx(5e-4)
    assert bb.cosine_lr(1e-3, 0.1, warmup_fraction=0.1) == 1e-3
    lrs = [bb.cosine_lr(1.0, f / 100, 0.1, 0.1) for f in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_pdebench_step_schedule_halves_four_times_over_the_budget():
    at = {f: bb.step_lr_for_budget(1.0, f) for f in (0.0, 0.19, 0.2, 0.39, 0.4, 0.6, 0.8, 0.99, 1.0)}
    assert at == {0.0: 1.0, 0.19: 1.0, 0.2: 0.5, 0.39: 0.5, 0.4: 0.25, 0.6: 0.125, 0.8: 0.0625, 0.99: 0.0625,
                  1.0: 0.0625}


def test_the_loop_sets_each_steps_lr_from_the_budget_fraction():
    # 0.25 s steps, 5 s budget: exactly 20 steps, the last one ending at the budget.
    _, _, _, steps, _ = _run(lambda k: 0.25, 5.0, final_ratio=0.1)
    assert len(steps) == 20 and steps[-1][1] == 5.0
    assert [lr for _, _, lr, _ in steps] == [bb.cosine_lr(1e-2, k / 20, 0.1) for k in range(20)]
    assert bb.cosine_lr(1e-2, steps[-1][1] / 5.0, 0.1) == 1e-2 * 0.1  # where the budget ends, the final lr
    # Twice the budget: the same schedule, stretched (a function of the fraction, not of the steps).
    _, _, _, longer, _ = _run(lambda k: 0.25, 10.0, final_ratio=0.1)
    assert [lr for _, _, lr, _ in longer[::2]] == [lr for _, _, lr, _ in steps]


# --- the hard stop -------------------------------------------------------------------------------

def test_the_prediction_is_exact_for_steady_steps_and_ignores_the_warm_up_step():
    assert bb.predicted_step_s([1.0]) == 1.0
    assert bb.predicted_step_s([30.0, 1.0, 1.0]) == 1.0
    assert bb.predicted_step_s([30.0, 1.0, 1.5]) == 2.0  # the slowest plus the spread
    with pytest.raises(ValueError):
        bb.predicted_step_s([])


_RNG = random.Random(0)
_JITTER = [_RNG.uniform(0.5, 1.5) for _ in range(200)]


@pytest.mark.parametrize("step_s", [
    pytest.param(lambda k: 1.0, id="steady"),
    pytest.param(lambda k: 10.0 if k == 0 else 1.0, id="warm-up first step"),
    pytest.param(lambda k: 1.0 + 0.05 * k, id="each step slower than all before"),
    pytest.param(lambda k: _JITTER[k], id="jitter"),
])
# Budgets at which predicting the mean step time would overrun the slowing and the jittery runs.
@pytest.mark.parametrize("budget_s", [10.6, 11.5, 16.7, 17.9, 23.5])
def test_no_run_passes_its_budget(step_s, budget_s):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and none warns of an overrun
        _, curve, _, steps, _ = _run(step_s, budget_s, validate=lambda m: 0.5)
    assert steps[-1][1] <= budget_s
    assert curve[-1].train_s == steps[-1][1]  # the curve ends where training did
    assert budget_s - steps[-1][1] < 2 * max(step_s(k) for k in range(len(steps) + 1))  # and used the budget


@settings(max_examples=25, deadline=None)
@given(budget_s=st.floats(5.0, 60.0), growth=st.floats(1.0, 1.05))
def test_a_steadily_slowing_run_stops_inside_its_budget(budget_s, growth):
    _, _, _, steps, _ = _run(lambda k: growth**k, budget_s)
    assert steps[-1][1] <= budget_s


def test_a_step_slower_than_any_prediction_is_reported_not_hidden():
    # Steady 1 s steps, then a 3 s stall where 1 s was left: a step cannot be interrupted.
    with pytest.warns(UserWarning, match="slower than predicted"):
        _, curve, _, steps, _ = _run(lambda k: 3.0 if k == 9 else 1.0, 10.0, validate=lambda m: 0.5)
    assert steps[-1][1] == curve[-1].train_s == 12.0


def test_validation_time_is_not_counted():
    fake = FakeClock()

    def validate(model):
        fake.now += 100.0  # far longer than the whole budget
        return 0.5

    _, curve, _, steps, _ = _run(lambda k: 0.25, 5.0, clock=fake, validate=validate, validate_every_s=1.0)
    assert len(steps) == 20 and steps[-1][1] == 5.0
    assert [p.train_s for p in curve] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert fake.now == 5.0 + 100.0 * len(curve)


def test_a_non_finite_loss_ends_the_run():
    """The product's step skips a non-finite step (no optimizer update) and the run ends there: the
    weights come back as the step before left them, finite."""
    clock, steps, weights = FakeClock(), [], []
    model = nn.Linear(2, 1)

    def loss_fn(model, batch):
        clock.now += 1.0
        loss = model(batch).mean()
        return loss * float("nan") if len(steps) == 2 else loss

    def on_step(*entry):
        steps.append(entry)
        weights.append(model.weight.detach().clone())

    with pytest.warns(UserWarning, match="training stopped"):
        returned, _ = bb.train_budgeted(model, lambda: torch.ones(4, 2), loss_fn, 10.0, 1e-3, clock=clock,
                                        on_step=on_step)
    assert len(steps) == 3 and math.isnan(steps[-1][3])
    assert torch.equal(returned.weight, weights[1]) and returned.weight.isfinite().all()
    assert not torch.equal(weights[1], weights[0])  # the steps before it did train


def test_keep_best_returns_the_weights_of_the_lowest_validation():
    """PDEBench keeps the checkpoint of its best validation: with ``keep_best`` the model comes back
    with the weights it had when validation was lowest (here the 2nd of 5), not its last."""
    scores, seen = iter([3.0, 1.0, 2.0, 1.0, 4.0]), []

    def validate(model):
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return next(scores)

    model, curve, _, _, _ = _run(lambda k: 0.25, 5.0, validate=validate, validate_every_s=1.0, keep_best=True)
    assert [p.value for p in curve] == [3.0, 1.0, 2.0, 1.0, 4.0]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, seen[1][k], rtol=0, atol=0)
        assert not torch.equal(v, seen[-1][k])  # training moved the weights after it
    last, _, _, _, _ = _run(lambda k: 0.25, 5.0, validate=lambda m: 1.0, validate_every_s=1.0)
    assert all(torch.equal(v, seen[-1][k]) for k, v in last.state_dict().items())  # the default keeps the last
    with pytest.raises(ValueError, match="keep_best needs validate"):
        _run(lambda k: 0.25, 5.0, keep_best=True)


# --- EMA and seeding -----------------------------------------------------------------------------

def test_with_ema_the_average_is_validated_and_returned():
    torch.manual_seed(0)
    start = nn.Linear(2, 1).state_dict()
    validated, snapshots = [], []
    fake = FakeClock()

    def after_step(*_):
        snapshots.append({k: v.clone() for k, v in live.state_dict().items()})

    torch.manual_seed(0)
    live = nn.Linear(2, 1)
    x, y = torch.randn(8, 2), torch.randn(8, 1)

    def loss_fn(model, batch):
        fake.now += 1.0
        return (model(batch[0]) - batch[1]).square().mean()

    returned, _ = bb.train_budgeted(live, lambda: (x, y), loss_fn, 12.0, 1e-1, clock=fake, ema_decay=0.8,
                                    validate=lambda m: validated.append(m) or 0.5, on_step=after_step)
    expected = {k: v.clone() for k, v in start.items()}
    for n, weights in enumerate(snapshots):
        d = bb.ema_decay_at(0.8, n)
        expected = {k: d * expected[k] + (1 - d) * weights[k] for k in expected}
    assert returned is not live and validated and all(m is returned for m in validated)
    for k, v in returned.state_dict().items():
        torch.testing.assert_close(v, expected[k])
        assert not torch.equal(v, live.state_dict()[k])  # the live weights are not what came back
    assert not returned.training


def test_a_peer_with_batchnorm_trains_on_a_budget_with_ema():
    # The U-Net's BatchNorm statistics are buffers: the average copies them from the live model.
    torch.manual_seed(0)
    live = build("peer", "unet1d", in_channels=2, out_channels=1, init_features=2)
    u, target = torch.randn(4, 2, 20), torch.randn(4, 1, 20)
    fake = FakeClock()

    def loss_fn(model, batch):
        fake.now += 1.0
        return (model(batch[0]) - batch[1]).square().mean()

    returned, curve = bb.train_budgeted(live, lambda: (u, target), loss_fn, 5.0, 1e-2, clock=fake, ema_decay=0.9,
                                        validate=lambda m: (m(u) - target).square().mean().sqrt().item())
    assert [p.train_s for p in curve] == [1.0, 2.0, 3.0, 4.0, 5.0] and all(math.isfinite(p.value) for p in curve)
    for mine, theirs in zip(returned.buffers(), live.buffers()):
        assert torch.equal(mine, theirs)
    assert describe(returned) == describe(live)  # the average rebuilds as the model it averages


def test_the_ema_ramp_keeps_short_runs_off_the_initialisation():
    assert bb.ema_decay_at(0.999, 0) == 0.1
    assert bb.ema_decay_at(0.999, 10**6) == 0.999


def test_a_seed_makes_training_repeatable_and_leaves_the_callers_rng_alone():
    def trained(seed: int) -> torch.Tensor:
        torch.manual_seed(123)
        model = nn.Linear(2, 4)
        before = torch.get_rng_state()
        clock = FakeClock()

        def loss_fn(model, batch):
            clock.now += 0.25
            return nn.functional.dropout(model(batch), 0.5).square().sum()  # draws from the RNG

        bb.train_budgeted(model, lambda: torch.ones(3, 2), loss_fn, 2.0, 1e-2, clock=clock, seed=seed)
        assert torch.equal(before, torch.get_rng_state())
        return model.weight.detach()

    assert torch.equal(trained(7), trained(7)) and not torch.equal(trained(7), trained(8))


# --- time to targets and the lr sweep --------------------------------------------------------------

def test_time_to_targets_reports_the_first_crossing_or_none():
    curve = [bb.CurvePoint(1.0, 0.3), bb.CurvePoint(2.0, 0.06), bb.CurvePoint(3.0, 0.05), bb.CurvePoint(4.0, 0.04)]
    assert bb.time_to_targets(curve) == {0.1: 2.0, 0.05: 3.0, 0.02: None, 0.01: None}
    assert bb.time_to_targets([(1.0, float("nan"))], (0.1,)) == {0.1: None}
    assert bb.time_to_targets([], (0.1,)) == {0.1: None}


@given(st.lists(st.tuples(st.floats(0.01, 10.0), st.floats(0.0, 0.2)), max_size=20),
       st.floats(0.001, 0.3), st.floats(0.0, 1.0))
def test_time_to_targets_on_monotone_curves(steps, target, start):
    # A monotone curve: times increase, values never rise.
    times = [sum(dt for dt, _ in steps[: i + 1]) for i in range(len(steps))]
    values = [start - sum(dv for _, dv in steps[: i + 1]) for i in range(len(steps))]
    got = bb.time_to_targets(list(zip(times, values)), (target,))[target]
    if not values or min(values) > target:
        assert got is None
    else:
        first = next(i for i, v in enumerate(values) if v <= target)
        assert got == times[first] and all(v > target for v in values[:first])


def test_lr_sweep_and_pick():
    assert bb.lr_sweep(1e-3) == pytest.approx([3e-4, 1e-3, 3e-3])
    assert bb.best_lr({3e-4: 0.2, 1e-3: 0.1, 3e-3: 0.1}) == 1e-3  # a tie goes to the lower lr
    assert bb.best_lr({1e-3: 0.3, 3e-3: float("nan")}) == 1e-3  # a diverged run never wins
    with pytest.raises(ValueError, match="finite"):
        bb.best_lr({1e-3: float("inf")})
    with pytest.raises(ValueError):
        bb.lr_sweep(0.0)


@pytest.mark.parametrize("optimum, tried, chosen", [
    (1e-3, [3e-4, 1e-3, 3e-3], 1e-3),                       # inside the grid: no extension
    (1e-2, [3e-4, 1e-3, 3e-3, 9e-3, 2.7e-2], 9e-3),         # beyond the top edge until the best is inside
    (1e-5, [2.7e-5, 9e-5, 3e-4, 1e-3, 3e-3], 2.7e-5),       # below the bottom until the extensions run out
])
def test_a_sweep_whose_best_is_at_an_edge_tries_beyond_it(optimum, tried, chosen):
    calls = []

    def score(lr: float) -> float:  # a valley in log(lr) around the optimum
        calls.append(lr)
        return math.log(lr / optimum) ** 2

    scores = bb.bracketed_sweep(score, 1e-3, (0.3, 1.0, 3.0))
    assert sorted(scores) == pytest.approx(tried, rel=1e-3) and len(calls) == len(tried)
    assert bb.best_lr(scores) == pytest.approx(chosen, rel=1e-3)


# --- the result store ------------------------------------------------------------------------------

def test_a_finished_model_and_seed_is_reused_not_retrained(tmp_path):
    path = tmp_path / "race" / "results.jsonl"
    calls = []

    def train():
        calls.append(1)
        return {"val_nrmse": 0.05, "steps": 20}

    first = result_store.reuse_or_run(path, "unet2d", 0, train)
    again = result_store.reuse_or_run(path, "unet2d", 0, train)
    assert first == again == {"val_nrmse": 0.05, "steps": 20} and len(calls) == 1
    assert result_store.finished(path, "unet2d", 1) is None and result_store.finished(path, "fno2d", 0) is None
    result_store.reuse_or_run(path, "unet2d", 1, train)
    assert len(calls) == 2 and len(path.read_bytes().splitlines()) == 2


def test_a_torn_last_line_is_ignored_and_the_next_record_starts_a_fresh_one(tmp_path):
    path = tmp_path / "results.jsonl"
    result_store.record(path, "unet2d", 0, {"val_nrmse": 0.05})
    with path.open("ab") as f:
        f.write(orjson.dumps({"model": "fno2d", "seed": 0, "payload": {"val_nrmse": 0.1}})[:25])  # a crash mid-write
    with pytest.warns(UserWarning, match="line"):
        assert result_store.finished(path, "unet2d", 0) == {"val_nrmse": 0.05}
    with pytest.warns(UserWarning):
        assert result_store.finished(path, "fno2d", 0) is None  # so the re-run trains it again
    result_store.record(path, "fno2d", 0, {"val_nrmse": 0.1})
    with pytest.warns(UserWarning, match=r"\[2\]"):  # the torn fragment stays alone on line 2
        assert result_store.finished(path, "fno2d", 0) == {"val_nrmse": 0.1}
    assert result_store.finished(tmp_path / "absent.jsonl", "fno2d", 0) is None


# --- the peers -------------------------------------------------------------------------------------

K = 2  # input frames (initial_step)
GRIDS = ([50], [30, 20], [1])


def _peer(arch: str, channels: int, grid: list[int]) -> nn.Module:
    """A small peer built through the registry, mapping [B, C * K, *grid] -> [B, C, *grid]."""
    torch.manual_seed(0)
    if arch == "plain_transformer":
        return build("peer", arch, in_channels=channels * K, out_channels=channels, grid=grid, patch=4, width=16,
                     depth=1, heads=2)
    return build("peer", f"unet{len(grid)}d", in_channels=channels * K, out_channels=channels, init_features=4)


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("channels", [1, 2, 3])
@pytest.mark.parametrize("arch", ["unet", "plain_transformer"])
def test_peers_map_stacked_frames_to_the_next_frame_and_rebuild_from_their_description(arch, channels, grid):
    model = _peer(arch, channels, grid).eval()
    u = torch.randn(2, channels * K, *grid)
    out = model(u)
    assert out.shape == (2, channels, *grid) and out.isfinite().all()
    again = rebuild(orjson.loads(orjson.dumps(describe(model))))
    again.load_state_dict(model.state_dict())
    torch.testing.assert_close(again.eval()(u), out, rtol=0, atol=0)


@pytest.mark.parametrize("arch,grid", [("unet", [50]), ("unet", [30, 20]), ("plain_transformer", [30, 20])])
def test_peers_train_on_odd_grids(arch, grid):
    model = _peer(arch, 2, grid).train()
    model(torch.randn(2, 2 * K, *grid)).square().mean().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_peers_refuse_the_wrong_input():
    with pytest.raises(ValueError, match="expected u"):
        _peer("unet", 2, [50])(torch.randn(1, 3, 50))
    with pytest.raises(ValueError, match="expected u"):
        _peer("plain_transformer", 2, [30, 20])(torch.randn(1, 4, 20, 30))
    with pytest.raises(ValueError, match="multiple of heads"):
        pt.PlainTransformer(2, 1, [8], width=10, heads=4)


def test_unet_pads_periodically_to_the_level_multiple():
    u = torch.arange(5.0).reshape(1, 1, 5)
    assert core.models.unet.pad_periodic(u, 4, 1).flatten().tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert core.models.unet.pad_periodic(u[..., :1], 4, 1).flatten().tolist() == [0, 0, 0, 0]
    assert core.models.unet.pad_periodic(u, 5, 1) is u


@pytest.mark.parametrize("grid", [[6, 4], [5, 3], [7]], ids=str)
def test_plain_transformer_puts_each_patch_back_where_it_came_from(grid):
    # Identity patch embedding and head, no encoder: the output must be the input, point for point.
    patch, channels = 2, 2
    width = channels * patch ** len(grid)
    model = pt.PlainTransformer(channels, channels, grid, patch=patch, width=width, depth=1, heads=1).eval()
    model.encoder = nn.Identity()
    with torch.no_grad():
        model.position.zero_()
        model.embed.weight.copy_(torch.eye(width).reshape(model.embed.weight.shape))
        model.embed.bias.zero_()
        model.head.weight.copy_(torch.eye(width))
        model.head.bias.zero_()
    u = torch.randn(3, channels, *grid)
    torch.testing.assert_close(model(u), u)


@pytest.mark.parametrize("target", [200_000, 1_000_000, 5_000_000])
def test_plain_transformer_size_helper_hits_a_parameter_target(target):
    args = pt.plain_transformer_args(target, in_channels=20, out_channels=2, grid=[64, 64], patch=4, depth=4,
                                     heads=4)
    with torch.device("meta"):  # counts without allocating
        count = sum(p.numel() for p in pt.PlainTransformer(**args).parameters())
    assert count == pt.plain_transformer_params(**args)
    assert abs(count - target) <= 0.1 * target
    assert orjson.loads(orjson.dumps(args)) == args  # plain JSON, as the registry keeps it
