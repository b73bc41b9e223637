"""Samplers: disjoint shards, complete union, equal counts per rank, task mix per global batch."""

from collections import Counter

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipelines.samplers import (
    BatchSampler,
    DistributedIndexSampler,
    MultiTaskBatchSampler,
    largest_remainder,
)

FAST = settings(max_examples=60, deadline=None, database=None)


def _shards(n, ws, **kw):
    return [list(DistributedIndexSampler(n, rank=r, world_size=ws, seed=3, **kw)) for r in range(ws)]


@FAST
@given(n=st.integers(0, 97), ws=st.integers(1, 4), shuffle=st.booleans())
def test_shards_disjoint_and_complete_with_wrap_padding(n, ws, shuffle):
    shards = _shards(n, ws, shuffle=shuffle)
    lengths = {len(s) for s in shards}
    assert lengths == {-(-n // ws)}  # every rank gets the same count
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(n))  # union complete
    # duplicates only from the documented wrap padding: exactly total - n extra entries
    assert len(flat) - n == (-(-n // ws)) * ws - n
    if n >= ws:  # padding repeats each index at most once more
        assert max(Counter(flat).values(), default=1) <= 2


@FAST
@given(n=st.integers(0, 97), ws=st.integers(1, 4))
def test_drop_last_shards_disjoint_equal(n, ws):
    shards = _shards(n, ws, drop_last=True)
    assert {len(s) for s in shards} == {n // ws}
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == (n // ws) * ws
    assert set(flat) <= set(range(n))


def test_set_epoch_reshuffles_deterministically():
    a = DistributedIndexSampler(50, rank=1, world_size=3, seed=7)
    b = DistributedIndexSampler(50, rank=1, world_size=3, seed=7)
    e0 = list(a)
    a.set_epoch(1)
    e1 = list(a)
    b.set_epoch(1)
    assert e0 != e1 and list(b) == e1
    a.set_epoch(0)
    assert list(a) == e0
    state = torch.random.get_rng_state()
    list(a)
    assert torch.equal(state, torch.random.get_rng_state())  # global RNG untouched


def test_no_shuffle_is_ordered_and_bad_rank_rejected():
    assert list(DistributedIndexSampler(7, rank=0, world_size=2, seed=0, shuffle=False)) == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="rank"):
        DistributedIndexSampler(7, rank=2, world_size=2, seed=0)


@FAST
@given(n=st.integers(0, 60), ws=st.integers(1, 4), bs=st.integers(1, 9), drop=st.booleans())
def test_batch_sampler_equal_batch_counts(n, ws, bs, drop):
    counts = []
    for r in range(ws):
        s = BatchSampler(DistributedIndexSampler(n, rank=r, world_size=ws, seed=1), bs, drop_last=drop)
        batches = list(s)
        assert len(batches) == len(s)
        assert all(len(b) == bs for b in batches[:-1] if batches)
        counts.append(len(batches))
    assert len(set(counts)) == 1


def _global_steps(sizes, B, ws, strategy, epoch=0, drop_last=True, weights=None):
    samplers = [MultiTaskBatchSampler(sizes, global_batch=B, rank=r, world_size=ws, strategy=strategy, seed=11,
                                      drop_last=drop_last, weights=weights) for r in range(ws)]
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    return samplers[0], per_rank


@FAST
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4), ws=st.integers(1, 4),
       per_rank=st.integers(1, 6), strategy=st.sampled_from(["balanced", "proportional"]),
       drop=st.booleans())
def test_multitask_global_mix_within_one_sample(sizes, ws, per_rank, strategy, drop):
    B = ws * per_rank
    s0, ranks = _global_steps(sizes, B, ws, strategy, drop_last=drop)
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) == len(s0)  # equal batch counts
    weights = [1.0] * len(sizes) if strategy == "balanced" else [float(x) for x in sizes]
    total_w = sum(weights)
    for step in range(len(s0)):
        batch = [i for r in ranks for i in r[step]]
        assert all(len(r[step]) == per_rank for r in ranks)
        assert all(0 <= i < sum(sizes) for i in batch)
        mix = Counter(s0.task_of(i) for i in batch)
        for k, w in enumerate(weights):
            assert abs(mix.get(k, 0) - B * w / total_w) < 1.0, (step, mix, weights)
        # within a step an index repeats only across passes of its task's stream
        for k in range(len(sizes)):
            c = Counter(i for i in batch if s0.task_of(i) == k)
            assert max(c.values(), default=0) <= -(-mix.get(k, 0) // sizes[k]) + 1


@FAST
@given(tasks=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 5)), min_size=1, max_size=4),
       ws=st.integers(1, 3), per_rank=st.integers(1, 6))
@example(tasks=[(1, 1)] * 4, ws=1, per_rank=2)  # equal weights: the leftover units must go round the tasks
def test_weighted_tasks_get_their_share_of_every_global_batch_and_of_the_epoch(tasks, ws, per_rank):
    """`data.task_weights`: task k gets w_k / sum w of every global batch (within two samples),
    of every prefix of the epoch (within one: no task is starved by rounding when a batch holds
    less than one of its samples), on every rank equally many batches; the epoch is long enough
    for the task the weights sample least relative to its size to be drawn once."""
    sizes, weights = [n for n, _ in tasks], [w for _, w in tasks]
    B, W = ws * per_rank, sum(weights)
    s0, ranks = _global_steps(sizes, B, ws, "balanced", weights=weights)
    assert len({len(r) for r in ranks}) == 1
    drawn = Counter()
    for step in range(len(s0)):
        mix = Counter(s0.task_of(i) for r in ranks for i in r[step])
        drawn.update(mix)
        for k, w in enumerate(weights):
            assert abs(mix.get(k, 0) - B * w / W) < 2.0, (step, mix, weights)
            assert abs(drawn[k] - (step + 1) * B * w / W) < 1.0, (step, drawn, weights)
    assert len(s0) == max(-(-n * W // w) for n, w in tasks) // B


def test_equal_weights_are_the_balanced_mix_and_bad_weights_are_refused():
    _, plain = _global_steps([13, 7, 5], 6, 2, "balanced")
    _, ones = _global_steps([13, 7, 5], 6, 2, "balanced", weights=[1, 1, 1])
    assert plain == ones
    for weights, strategy in (([1, 2], "balanced"), ([1, 0, 1], "balanced"), ([1.5, 1, 1], "balanced"),
                              ([1, 1, 1], "proportional")):
        with pytest.raises(ValueError, match="weights must be 3 positive integers"):
            MultiTaskBatchSampler([13, 7, 5], global_batch=6, rank=0, world_size=2, strategy=strategy, seed=0,
                                  weights=weights)


def test_multitask_epoch_length_rule_and_coverage():
    sizes = {"burgers": 40, "darcy": 10, "advection": 22}
    s, ranks = _global_steps(sizes, 12, 2, "balanced")
    assert len(s) == (3 * 40) // 12  # the largest task once, smaller ones cycled
    seen = Counter(i for r in ranks for b in r for i in b)
    assert set(range(40)) <= set(seen)  # largest task covered
    assert all(seen[i] >= 3 for i in range(40, 50))  # the 10-sample task cycled 4x
    p, pranks = _global_steps(sizes, 12, 2, "proportional")
    assert len(p) == 72 // 12  # one pass over the data
    pseen = Counter(i for r in pranks for b in r for i in b)
    assert sum(pseen.values()) == 72 and max(pseen.values()) == 1 and len(pseen) == 72
    _, not_dropped = _global_steps(sizes, 10, 2, "proportional", drop_last=False)
    assert len(not_dropped[0]) == 8  # ceil(72 / 10)


def test_multitask_set_epoch_deterministic():
    _, a0 = _global_steps([13, 7], 6, 3, "balanced", epoch=0)
    _, b0 = _global_steps([13, 7], 6, 3, "balanced", epoch=0)
    _, a1 = _global_steps([13, 7], 6, 3, "balanced", epoch=1)
    assert a0 == b0 and a0 != a1


def test_multitask_rejects_bad_arguments():
    with pytest.raises(ValueError, match="multiple of world_size"):
        MultiTaskBatchSampler([5, 5], global_batch=5, rank=0, world_size=2, strategy="balanced", seed=0)
    with pytest.raises(ValueError, match="non-empty"):
        MultiTaskBatchSampler({"a": 5, "b": 0}, global_batch=4, rank=0, world_size=2,
                              strategy="balanced", seed=0)
    with pytest.raises(ValueError, match="strategy"):
        MultiTaskBatchSampler([5], global_batch=4, rank=0, world_size=2, strategy="uniform", seed=0)


def test_largest_remainder_sums_and_rotates():
    assert largest_remainder([1, 1, 1], 10) == [4, 3, 3]
    assert largest_remainder([1, 1, 1], 10, rotate=1) == [3, 4, 3]
    assert largest_remainder([5, 3, 2], 7) == [4, 2, 1]
    assert largest_remainder([1, 0], 3) == [3, 0]
