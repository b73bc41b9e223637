"""Field datasets and the task-alternating sampler on tiny PDEBench-layout files."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from pipelines.fields import (SAMPLE_ID_STRIDE, ConcatFields, FieldSnapshots, FieldTrajectoryPairs,
                              TaskAlternatingBatchSampler, build_field_loader)
from pipelines.pdebench_io import DataError

N, T, X = 6, 9, 16
ND, XD = 5, 8


@pytest.fixture
def files(tmp_path):
    """A 1D Burgers file and a Darcy file, values distinct per (row, step, point)."""
    rng = np.random.default_rng(0)
    p1 = tmp_path / "1D_Burgers_Sols_Nu0.01.hdf5"
    tensor = rng.standard_normal((N, T, X)).astype(np.float32)
    with h5py.File(p1, "w") as f:
        f["tensor"] = tensor
        f["x-coordinate"] = ((np.arange(X) + 0.5) / X).astype(np.float32)
        f["t-coordinate"] = (np.arange(T + 1) * 0.05).astype(np.float32)
    p2 = tmp_path / "2D_DarcyFlow_beta1.0_Train.hdf5"
    nu = rng.standard_normal((ND, XD, XD)).astype(np.float32)
    sol = rng.standard_normal((ND, 1, XD, XD)).astype(np.float32)
    with h5py.File(p2, "w") as f:
        f["nu"], f["tensor"] = nu, sol
        f["x-coordinate"] = f["y-coordinate"] = ((np.arange(XD) + 0.5) / XD).astype(np.float32)
    return {"1d": (p1, tensor), "darcy": (p2, nu, sol)}


@pytest.mark.parametrize("in_memory_bytes", [0, 1 << 30])  # lazy HDF5 reads and the in-memory copy
def test_snapshots_1d_values(files, in_memory_bytes):
    path, tensor = files["1d"]
    rows = np.array([1, 4, 5])
    ds = FieldSnapshots(path, rows, reduce_x=2, reduce_t=3, task_id=2, in_memory_bytes=in_memory_bytes)
    assert ds.in_memory == bool(in_memory_bytes)
    per_row = len(range(0, T, 3))
    assert len(ds) == rows.size * per_row
    idx = [7, 0, 8, 3, 7]  # unsorted, repeated
    b = ds.gather(idx)
    assert b["u"].shape == (5, 1, len(range(0, X, 2)))
    for n, i in enumerate(idx):
        j, k = divmod(i, per_row)
        np.testing.assert_array_equal(b["u"][n, 0].numpy(), tensor[rows[j], 3 * k, ::2])
        assert b["sample_id"][n] == 2 * SAMPLE_ID_STRIDE + rows[j] * per_row + k
    assert b["task_id"].tolist() == [2] * 5
    assert b["sample_id"].dtype == torch.int64


@pytest.mark.parametrize("in_memory_bytes", [0, 1 << 30])
def test_snapshots_darcy_both_fields(files, in_memory_bytes):
    path, nu, sol = files["darcy"]
    rows = np.array([0, 2, 3])
    ds = FieldSnapshots(path, rows, reduce_x=2, in_memory_bytes=in_memory_bytes)
    assert len(ds) == 2 * rows.size
    b = ds.gather([5, 0, 1, 2])
    assert b["u"].shape == (4, 1, XD // 2, XD // 2)
    want = [sol[3, 0], nu[0], sol[0, 0], nu[2]]
    for n, w in enumerate(want):
        np.testing.assert_array_equal(b["u"][n, 0].numpy(), w[::2, ::2])
    only = FieldSnapshots(path, rows, field="tensor", in_memory_bytes=in_memory_bytes)
    assert len(only) == rows.size
    np.testing.assert_array_equal(only.gather([1])["u"][0].numpy(), sol[2])


def test_snapshots_errors_and_empty(files, tmp_path):
    path, _ = files["1d"]
    with pytest.raises(DataError):
        FieldSnapshots(path, [N])
    with pytest.raises(DataError):
        FieldSnapshots(tmp_path / "missing.hdf5", [0])
    with pytest.raises(ValueError):
        FieldSnapshots(path, [0], field="nu")
    ds = FieldSnapshots(path, [0], in_memory_bytes=0)
    with pytest.raises(IndexError):
        ds.gather([T])
    assert ds.gather([])["u"].shape == (0, 1, X)
    assert len(FieldSnapshots(path, [])) == 0


def test_trajectory_pairs(files):
    path, tensor = files["1d"]
    rows = np.array([2, 3])
    ds = FieldTrajectoryPairs(path, rows, reduce_x=1, reduce_t=2, horizon=2)
    kept = len(range(0, T, 2))
    assert len(ds) == rows.size * (kept - 2)
    b = ds.gather([3, 0, 4])
    for n, i in enumerate([3, 0, 4]):
        j, t = divmod(i, kept - 2)
        np.testing.assert_array_equal(b["u_t"][n, 0].numpy(), tensor[rows[j], 2 * t])
        np.testing.assert_array_equal(b["u_next"][n, 0].numpy(), tensor[rows[j], 2 * (t + 2)])
        assert b["sample_id"][n] == rows[j]
    torch.testing.assert_close(b["dt"], torch.full((3,), 0.2))

    dpath, nu, sol = files["darcy"]
    d = FieldTrajectoryPairs(dpath, [1, 4], task_id=1)
    b = d.gather([1, 0])
    np.testing.assert_array_equal(b["u_t"][0, 0].numpy(), nu[4])
    np.testing.assert_array_equal(b["u_next"][0].numpy(), sol[4])
    assert b["task_id"].tolist() == [1, 1] and b["dt"].tolist() == [1.0, 1.0]


def test_concat_routes_single_task_batches(files):
    p1, tensor = files["1d"]
    p2, nu, _ = files["darcy"]
    a = FieldSnapshots(p1, [0, 1], task_id=0)
    d = FieldSnapshots(p2, [0, 1], task_id=1)
    cat = ConcatFields([a, d])
    assert len(cat) == len(a) + len(d)
    assert list(cat.task_sizes.values()) == [len(a), len(d)]
    b = cat.gather([len(a), len(a) + 2])
    assert b["u"].shape == (2, 1, XD, XD) and b["task_id"].tolist() == [1, 1]
    np.testing.assert_array_equal(b["u"][1, 0].numpy(), nu[1])
    with pytest.raises(ValueError, match="one task"):
        cat.gather([0, len(a)])


SIZES = {"a": 37, "b": 20, "c": 9}


def _all_ranks(world_size, batch=2, seed=3, epoch=0, sizes=SIZES):
    out = []
    for r in range(world_size):
        s = TaskAlternatingBatchSampler(sizes, batch_size_per_rank=batch, rank=r,
                                        world_size=world_size, seed=seed)
        s.set_epoch(epoch)
        out.append((s, list(s)))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sampler_single_task_same_task_disjoint(world_size):
    ranks = _all_ranks(world_size)
    offsets = np.cumsum([0, *SIZES.values()])
    lengths = {len(batches) for _, batches in ranks}
    assert len(lengths) == 1 and lengths == {len(ranks[0][0])}
    seen = []
    for step in range(len(ranks[0][1])):
        tasks = set()
        for s, batches in ranks:
            batch = batches[step]
            assert len(batch) == 2
            ks = {int(np.searchsorted(offsets, i, side="right")) - 1 for i in batch}
            assert len(ks) == 1  # single-task batch
            tasks |= ks
            assert ks == {s.task_at(step)}
            seen += batch
        assert len(tasks) == 1  # the same task on every rank
    assert len(seen) == len(set(seen))  # shards disjoint, nothing repeated in an epoch
    want = sum(n // world_size // 2 for n in SIZES.values()) * 2 * world_size
    assert len(seen) == want


def test_sampler_round_robin_determinism_and_epochs():
    s = TaskAlternatingBatchSampler(SIZES, batch_size_per_rank=4, rank=0, world_size=1, seed=0)
    # batches per task: 9, 5, 2 -> round robin, skipping finished tasks
    assert s.schedule[:6] == [0, 1, 2, 0, 1, 2] and s.schedule[6:9] == [0, 1, 0]
    assert len(s) == 16
    first = list(s)
    assert first == list(s)  # same epoch, same batches
    s.set_epoch(1)
    assert list(s) != first
    s.set_epoch(0)
    assert list(s) == first


def test_sampler_errors():
    with pytest.raises(ValueError, match="no task"):
        TaskAlternatingBatchSampler({"a": 3}, batch_size_per_rank=2, rank=0, world_size=2, seed=0)
    with pytest.warns(UserWarning, match="too small"):
        s = TaskAlternatingBatchSampler({"a": 8, "b": 1}, batch_size_per_rank=2, rank=1, world_size=2, seed=0)
    assert len(s) == 2 and all(i < 8 for b in s for i in b)
    with pytest.raises(ValueError):
        TaskAlternatingBatchSampler({"a": 8}, batch_size_per_rank=2, rank=2, world_size=2, seed=0)


def test_build_field_loader_end_to_end(files):
    p1, _ = files["1d"]
    p2, _, _ = files["darcy"]
    datasets = [FieldSnapshots(p1, range(N), task_id=0), FieldSnapshots(p2, range(ND), task_id=1)]
    loader = build_field_loader(datasets, rank=1, world_size=2, batch_size_per_rank=2, seed=0,
                                num_workers=2, prefetch_factor=2, pin_memory=False)
    with loader:
        loader.set_epoch(0)
        batches = list(loader)
    assert len(batches) == len(loader) == len(loader.batch_sampler)
    for step, b in enumerate(batches):
        task = loader.batch_sampler.task_at(step)
        assert b["task_id"].tolist() == [task, task]
        assert b["u"].shape[2:] == ((X,) if task == 0 else (XD, XD))
