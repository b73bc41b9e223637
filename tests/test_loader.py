"""Datasets over the latent cache and the torchdata.nodes loader: batches, epochs, resume, memory."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from pipelines.datasets import STEPS_KEY, LatentPairs, LatentTrajectories
from pipelines.latent_cache import load_cache, write_cache
from pipelines.loader import build_loader
from pipelines.samplers import BatchSampler, DistributedIndexSampler, MultiTaskBatchSampler
from tests import tiny_run as tr

N, T, L, D = 10, 7, 3, 2


def _cache(task_id=(1, 0, 1, 0, 0, 1, 1, 0, 1, 1)):
    z = torch.arange(N * T * L * D, dtype=torch.float32).reshape(N, T, L, D)
    return TensorDict({"z": z, "task_id": torch.tensor(task_id), "dt": torch.linspace(0.1, 1.0, N),
                       "nu": torch.arange(N).double()}, batch_size=[N])


def test_latent_pairs_gather_matches_naive_indexing():
    td = _cache()
    ds = LatentPairs(td, horizon_k=2, task_names=["adv", "burgers"])
    assert len(ds) == N * (T - 2)
    assert ds.task_sizes == {"adv": 4 * (T - 2), "burgers": 6 * (T - 2)}
    order = sorted(range(N), key=lambda n: (int(td["task_id"][n]), n))  # task-contiguous, stable
    idx = [0, 7, 11, 26, len(ds) - 1]
    batch = ds.gather(idx)
    assert batch.batch_size == torch.Size([5])
    for b, i in enumerate(idx):
        n, t = order[i // (T - 2)], i % (T - 2)
        assert torch.equal(batch["z_t"][b], td["z"][n, t])
        assert torch.equal(batch["z_next"][b], td["z"][n, t + 2])
        assert batch["dt"][b] == pytest.approx(2 * float(td["dt"][n]))
        assert batch["task_id"][b] == td["task_id"][n] and batch["nu"][b] == n and batch["t"][b] == t
    assert ds.gather(idx[:2])["task_id"].tolist() == [0, 0]  # first indices belong to task 0
    assert ds.gather([]).batch_size == torch.Size([0])
    with pytest.raises(IndexError):
        ds.gather([len(ds)])
    with pytest.raises(ValueError, match="horizon_k"):
        LatentPairs(td, horizon_k=T)


def test_latent_pairs_unrolled_targets_follow_the_trajectory():
    td = _cache()
    ds = LatentPairs(td, horizon_k=2, unroll=3)  # targets t+2, t+4, t+6: starts t = 0 only (T = 7)
    assert len(ds) == N * (T - 6)
    order = sorted(range(N), key=lambda n: (int(td["task_id"][n]), n))
    batch = ds.gather(list(range(len(ds))))
    for b in range(len(ds)):
        n = order[b]
        assert torch.equal(batch["z_seq"][b], td["z"][n, [2, 4, 6]])
        assert torch.equal(batch["z_next"][b], batch["z_seq"][b, 0])
    assert "z_seq" not in LatentPairs(td).gather([0]).keys()
    with pytest.raises(ValueError, match="unroll"):
        LatentPairs(td, horizon_k=2, unroll=4)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(0, 2), st.integers(3, 9)), min_size=1, max_size=8),
       horizon=st.integers(1, 2), unroll=st.integers(1, 2))
def test_trajectories_of_other_lengths_give_exactly_their_own_pairs_and_never_the_padding(lengths, horizon, unroll):
    """Tasks of other trajectory lengths share one cache padded to the longest (``steps`` holds each
    one's own): the pairs are exactly every (trajectory, t) with t + k R inside its own frames."""
    task_id = torch.tensor([task for task, _ in lengths])
    steps = torch.tensor([n for _, n in lengths])
    if horizon * unroll >= int(steps.min()):
        with pytest.raises(ValueError, match="need a trajectory longer|horizon_k must be"):
            LatentPairs(TensorDict({"z": torch.zeros(len(lengths), int(steps.max()), 1, 1), "task_id": task_id,
                                    "dt": torch.ones(len(lengths)), STEPS_KEY: steps}, batch_size=[len(lengths)]),
                        horizon_k=horizon, unroll=unroll)
        return
    n, t_max = len(lengths), int(steps.max())
    z = torch.full((n, t_max, 1, 2), float("nan"))  # padding is NaN: a pair that reads it shows
    for row, length in enumerate(steps.tolist()):
        z[row, :length, 0, 0] = row
        z[row, :length, 0, 1] = torch.arange(length, dtype=torch.float32)
    td = TensorDict({"z": z, "task_id": task_id, "dt": torch.ones(n), STEPS_KEY: steps}, batch_size=[n])
    ds = LatentPairs(td, horizon_k=horizon, unroll=unroll, task_names=["a", "b", "c"])

    batch = ds.gather(range(len(ds)))
    got = sorted(zip(batch["z_t"][:, 0, 0].long().tolist(), batch["z_t"][:, 0, 1].long().tolist()))
    want = sorted((row, t) for row, length in enumerate(steps.tolist()) for t in range(length - horizon * unroll))
    assert got == want
    assert torch.isfinite(batch["z_next"]).all() and torch.equal(batch["z_next"][:, 0, 1], batch["t"] + horizon)
    if unroll > 1:
        assert torch.isfinite(batch["z_seq"]).all()
    assert torch.equal(batch[STEPS_KEY], steps[batch["z_t"][:, 0, 0].long()])
    per_task = {name: sum(length - horizon * unroll for task, length in lengths if task == i)
                for i, name in enumerate("abc")}
    assert ds.task_sizes == {k: v for k, v in per_task.items() if any(task == "abc".index(k) for task, _ in lengths)}
    # task-contiguous order, as the multi-task sampler's global index assumes
    assert batch["task_id"].tolist() == sorted(batch["task_id"].tolist())


def test_latent_trajectories_gather():
    td = _cache()
    ds = LatentTrajectories(td)
    assert len(ds) == N and ds.task_sizes == {"0": 4, "1": 6}
    batch = ds.gather([0, 9])
    assert torch.equal(batch["z"][0], td["z"][1]) and torch.equal(batch["z"][1], td["z"][9])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_yields_the_sampler_batches_in_order(num_workers):
    ds = LatentPairs(_cache())
    sampler = MultiTaskBatchSampler(ds.task_sizes, global_batch=8, rank=1, world_size=2,
                                    strategy="balanced", seed=5)
    with build_loader(ds, sampler, num_workers=num_workers, prefetch_factor=2, pin_memory=True) as loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            sampler.set_epoch(epoch)
            expected = [ds.gather(ix) for ix in sampler]
            got = list(loader)
            assert len(got) == len(expected) == len(loader) > 0
            for g, e in zip(got, expected):
                assert (g == e).all()
        loader.set_epoch(0)
        assert not (next(iter(loader))["z_t"] == got[0]["z_t"]).all()  # epochs differ


def test_resume_in_same_process_rules():
    ds = LatentPairs(_cache())
    sampler = BatchSampler(DistributedIndexSampler(len(ds), rank=0, world_size=1, seed=0), 4)
    with build_loader(ds, sampler, num_workers=1, prefetch_factor=1, pin_memory=False) as loader:
        loader.set_epoch(3)
        full = [b["z_t"] for b in loader]
        state_end = loader.state_dict()
        it = iter(loader)
        next(it)
        state_mid = loader.state_dict()
        assert state_mid["epoch"] == 3 and state_mid["batches_yielded"] == 1
        loader.load_state_dict(state_end)  # finished epoch: the next set_epoch starts afresh
        loader.set_epoch(4)
        sampler.set_epoch(4)
        assert all(torch.equal(b["z_t"], ds.gather(ix)["z_t"]) for b, ix in zip(loader, sampler))
        loader.load_state_dict(state_mid)
        loader.set_epoch(5)
        with pytest.raises(ValueError, match="mid-epoch 3"):
            iter(loader)
        loader.load_state_dict(state_mid)
        rest = [b["z_t"] for b in loader]
        assert len(rest) == len(full) - 1
        assert all(torch.equal(a, b) for a, b in zip(rest, full[1:]))


_RESUME_SCRIPT = textwrap.dedent("""
    import sys, torch
    from pipelines.datasets import LatentPairs
    from pipelines.latent_cache import load_cache
    from pipelines.loader import build_loader
    from pipelines.samplers import MultiTaskBatchSampler
    cache, mode, k, state_path, out_path = sys.argv[1:6]
    ds = LatentPairs(load_cache(cache, {"config_hash": "t"}, "rebuild"), horizon_k=1)
    sampler = MultiTaskBatchSampler(ds.task_sizes, global_batch=6, rank=1, world_size=3,
                                    strategy="proportional", seed=9)
    loader = build_loader(ds, sampler, num_workers=2, prefetch_factor=2, pin_memory=False)
    loader.set_epoch(2)
    if mode == "resume":
        loader.load_state_dict(torch.load(state_path))
    batches = []
    for i, batch in enumerate(loader):
        batches.append(batch.to_dict())
        if mode == "stop" and i + 1 == int(k):
            torch.save(loader.state_dict(), state_path)
            break
    loader.close()
    torch.save(batches, out_path)
""")


@pytest.mark.timeout(300)
def test_resume_in_a_new_process_sees_exactly_the_remaining_batches(tmp_path):
    td = _cache()
    specs = {k: (tuple(v.shape), v.dtype) for k, v in td.items()}
    cache = write_cache(tmp_path / "cache", [td.to_dict()], {"config_hash": "t"}, specs=specs)
    script = tmp_path / "resume.py"
    script.write_text(_RESUME_SCRIPT)
    env = tr.env()

    def run(mode, out):
        args = [sys.executable, str(script), str(cache), mode, "3", str(tmp_path / "state.pt"), str(out)]
        proc = subprocess.run(args, env=env, timeout=120, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return torch.load(out)

    full = run("full", tmp_path / "full.pt")
    first = run("stop", tmp_path / "first.pt")
    rest = run("resume", tmp_path / "rest.pt")
    assert len(full) > 4 and len(first) == 3
    assert len(first) + len(rest) == len(full)
    for got, want in zip(first + rest, full):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def _rss_mib() -> dict[str, float]:
    """VmRSS (everything resident) and RssAnon (private memory: where copies would land)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) / 1024
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_thread_workers_share_one_copy_of_the_cache(tmp_path):
    """Two gather threads + main read one mapping of a 210 MB cache.

    VmRSS also counts file pages the kernel maps around each fault (read-around, large
    folios: on ext4 / Linux 6.18 six batches touching ~25 MB of rows mapped ~170 MiB).
    Those pages are the page cache's single shared copy, so copies are measured on RssAnon
    and the whole-epoch check bounds VmRSS by one copy of the cache (a per-worker copy
    would show two or three).
    """
    n, t, l, d = 200, 16, 64, 256  # float32: 200 * 16 * 64 * 256 * 4 B = 210 MB
    cache_mib = n * t * l * d * 4 / 2**20
    specs = {"z": ((n, t, l, d), torch.float32), "task_id": ((n,), torch.int64), "dt": ((n,), torch.float32)}

    def chunks():
        for start in range(0, n, 20):
            yield {"z": torch.full((20, t, l, d), float(start + 1)),
                   "task_id": torch.zeros(20, dtype=torch.int64), "dt": torch.ones(20)}

    out = write_cache(tmp_path / "big", chunks, {"config_hash": "big"}, specs=specs)
    td = load_cache(out, {"config_hash": "big"}, "rebuild", verify="size")
    ds = LatentPairs(td)
    # batch of 8 pairs: 1 MiB; in flight at most ~8 batches (prefetch, workers, reorder queue)
    sampler = BatchSampler(DistributedIndexSampler(len(ds), rank=0, world_size=1, seed=0), 8)
    before = _rss_mib()
    with build_loader(ds, sampler, num_workers=2, prefetch_factor=2, pin_memory=False) as loader:
        it = iter(loader)
        for _ in range(6):
            assert next(it)["z_t"].shape == (8, l, d)
        few = _rss_mib()
        for batch in it:  # the rest of the epoch touches every row of the cache
            assert torch.all(batch["z_t"] > 0)
        full = _rss_mib()
    grown = {k: {"few": few[k] - before[k], "epoch": full[k] - before[k]} for k in before}
    assert grown["RssAnon"]["few"] < cache_mib / 8, grown
    assert grown["RssAnon"]["epoch"] < cache_mib / 8, grown
    assert grown["VmRSS"]["epoch"] < 1.5 * cache_mib, grown


def test_torchdata_internals_are_where_the_loader_expects():
    """pipelines/loader.py relies on two torchdata internals (pyproject bounds the version to what
    this checks): a Loader state's yielded-batch count under LoaderIterator.NUM_YIELDED_KEY, and each
    running node's iterator at ``node._it`` with a ``_shutdown()`` that stops its threads. If a
    torchdata release moves either, this fails naming it, not a resume or an exit much later."""
    import threading

    import torchdata
    from torchdata.nodes.loader import LoaderIterator

    from pipelines.loader import batches_yielded

    assert isinstance(getattr(LoaderIterator, "NUM_YIELDED_KEY", None), str), \
        f"torchdata {torchdata.__version__}: LoaderIterator.NUM_YIELDED_KEY moved"
    ds = LatentPairs(_cache())
    sampler = MultiTaskBatchSampler(ds.task_sizes, global_batch=8, rank=0, world_size=1, strategy="balanced", seed=5)
    before = threading.active_count()
    loader = build_loader(ds, sampler, num_workers=2, prefetch_factor=2, pin_memory=False)
    it = iter(loader)
    next(it), next(it)
    assert batches_yielded(loader._loader.state_dict()) == 2 == loader.state_dict()["batches_yielded"]
    assert threading.active_count() > before
    # the prefetcher's thread and the mapper's workers: found through _it and stopped by _shutdown()
    assert loader.close() >= 2, \
        f"torchdata {torchdata.__version__}: nodes no longer keep their iterator at _it with _shutdown()"
    for t in threading.enumerate():  # the worker and prefetch threads stop and are joined
        if t is not threading.current_thread() and t.daemon:
            t.join(timeout=5)
    assert threading.active_count() <= before
