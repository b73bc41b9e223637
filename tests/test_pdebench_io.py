"""PDEBench file naming, reading through pipelines.layouts (files with ONLY PDEBench's keys), atomic
writing, and splits."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.layouts import DataError
from pipelines.pdebench_io import PDEBenchWriter, write_pdebench
from pipelines.split import split_indices, split_of_sources
from pipelines.task_data import open_task, read_task, read_trajectories, task_description, task_name
from pipelines.tasks import get_task, parse_file_name, task_file_name


def write_raw_1d(path, n=5, nt=11, nx=32, seed=0, **overrides):
    """A file exactly as PDEBench ships it: three datasets, no attributes of ours."""
    rng = np.random.default_rng(seed)
    data = {"tensor": rng.standard_normal((n, nt, nx)).astype(np.float32),
            "x-coordinate": ((np.arange(nx) + 0.5) / nx).astype(np.float32),
            "t-coordinate": (np.arange(nt + 1) * 0.01).astype(np.float32)}
    data.update(overrides)
    with h5py.File(path, "w") as f:
        for key, value in data.items():
            if value is not None:
                f.create_dataset(key, data=value)
    return data


def write_raw_darcy(path, n=3, nx=16, seed=0, **overrides):
    rng = np.random.default_rng(seed)
    data = {"tensor": rng.standard_normal((n, 1, nx, nx)).astype(np.float32),
            "nu": rng.choice([0.1, 1.0], size=(n, nx, nx)).astype(np.float32),
            "x-coordinate": ((np.arange(nx) + 0.5) / nx).astype(np.float32),
            "y-coordinate": ((np.arange(nx) + 0.5) / nx).astype(np.float32)}
    data.update(overrides)
    with h5py.File(path, "w") as f:
        for key, value in data.items():
            if value is not None:
                f.create_dataset(key, data=value)
    return data


# --- names -------------------------------------------------------------------------------

@pytest.mark.parametrize("task, param, name", [
    ("advection1d", 0.1, "1D_Advection_Sols_beta0.1.hdf5"),
    ("advection1d", 1, "1D_Advection_Sols_beta1.0.hdf5"),
    ("burgers1d", 0.001, "1D_Burgers_Sols_Nu0.001.hdf5"),
    ("burgers1d", 4.0, "1D_Burgers_Sols_Nu4.0.hdf5"),
    ("darcy2d", 100.0, "2D_DarcyFlow_beta100.0_Train.hdf5"),
    ("darcy2d", 0.01, "2D_DarcyFlow_beta0.01_Train.hdf5"),
])
def test_file_names_match_pdebench(task, param, name):
    assert task_file_name(task, param) == name
    spec, parsed = parse_file_name(name)
    assert spec.name == task and parsed == float(param)


def test_unknown_task_and_foreign_names():
    with pytest.raises(ValueError, match="unknown task 'heat1d'"):
        get_task("heat1d")
    assert parse_file_name("1D_CFD_Rand_Eta0.01_Zeta0.01_periodic_Train.hdf5") is None
    assert parse_file_name("1D_Burgers_Sols_Nu0.001.hdf5.bak") is None


# --- reading genuine-layout files (through pipelines.layouts, the one reader) ---------------

def test_reads_pdebench_only_1d_file(tmp_path):
    path = tmp_path / "1D_Burgers_Sols_Nu0.01.hdf5"
    raw = write_raw_1d(path)
    desc = task_description(path)
    assert task_name(path, None, desc) == "burgers1d" and desc.parameters == {"Nu": 0.01}
    data = read_task(path)
    assert data.u.shape == (5, 11, 1, 32) and data.u.dtype == np.float32
    np.testing.assert_array_equal(data.u[:, :, 0], raw["tensor"])
    np.testing.assert_allclose(data.t, raw["t-coordinate"][:11])
    np.testing.assert_array_equal(desc.grid.coords[0], raw["x-coordinate"])
    assert data.coefficient is None


def test_reads_pdebench_only_darcy_file(tmp_path):
    path = tmp_path / "2D_DarcyFlow_beta0.1_Train.hdf5"
    raw = write_raw_darcy(path)
    desc = task_description(path, "darcy2d")
    assert desc.steady and desc.parameters == {"beta": 0.1}
    data = read_task(path, task="darcy2d")
    assert data.t is None
    assert data.u.shape == (3, 1, 1, 16, 16) and data.coefficient.shape == (3, 1, 16, 16)
    np.testing.assert_array_equal(data.u[:, :, 0], raw["tensor"])
    np.testing.assert_array_equal(data.coefficient[:, 0], raw["nu"])


def test_reduction_matches_pdebench_slicing(tmp_path):
    path = tmp_path / "1D_Advection_Sols_beta0.4.hdf5"
    raw = write_raw_1d(path, n=4, nt=21, nx=64)
    data = read_task(path, reduce_x=4, reduce_t=5)
    np.testing.assert_array_equal(data.u[:, :, 0], raw["tensor"][:, ::5, ::4])
    np.testing.assert_allclose(data.t, raw["t-coordinate"][:21][::5])
    np.testing.assert_array_equal(data.coords[0], raw["x-coordinate"][::4])
    darcy = tmp_path / "2D_DarcyFlow_beta1.0_Train.hdf5"
    raw2 = write_raw_darcy(darcy, nx=16)
    d2 = read_task(darcy, [2, 0], reduce_x=2)
    np.testing.assert_array_equal(d2.u[:, 0, 0], raw2["tensor"][[2, 0], 0, ::2, ::2])
    np.testing.assert_array_equal(d2.coefficient[:, 0], raw2["nu"][[2, 0], ::2, ::2])


def test_lazy_reads_keep_requested_order(tmp_path):
    path = tmp_path / "1D_Burgers_Sols_Nu1.0.hdf5"
    raw = write_raw_1d(path, n=8)
    with open_task(path) as reader:
        assert reader.desc.trajectories == 8
        for idx in ([5, 1, 3], [2, 2, 0], [3, 4, 5], [7], [6, 0, 6, 7]):
            data = read_trajectories(reader, idx, reduce_t=2)
            np.testing.assert_array_equal(data.u[:, :, 0], raw["tensor"][idx][:, ::2])
        with pytest.raises(DataError, match=r"1D_Burgers_Sols_Nu1.0.hdf5.*\[0, 8\)"):
            read_trajectories(reader, [8])
        assert read_trajectories(reader, []).u.shape == (0, 11, 1, 32)


def test_a_renamed_file_is_read_by_its_keys_and_checked_against_a_named_task(tmp_path):
    path = tmp_path / "renamed.hdf5"
    raw = write_raw_1d(path)
    np.testing.assert_array_equal(read_task(path).u[:, :, 0], raw["tensor"])
    np.testing.assert_array_equal(read_task(path, task="advection1d").u[:, :, 0], raw["tensor"])
    with pytest.raises(DataError, match="renamed.hdf5: holds a 1D field .* but task darcy2d is 2D"):
        task_description(path, "darcy2d")
    with pytest.raises(DataError, match="renamed.hdf5: holds a 1D field .* but task ns2d is 2D"):
        task_description(path, "ns2d")


# --- errors --------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="nothere.hdf5: no such file"):
        read_task(tmp_path / "nothere.hdf5")


@pytest.mark.parametrize("overrides, message", [
    ({"tensor": None, "data": np.zeros((5, 11, 32), np.float32)}, "not one of PDEBench's layouts"),
    ({"t-coordinate": np.arange(5, dtype=np.float32)}, "'t-coordinate' has 5 times but the field has 11 steps"),
    ({"x-coordinate": np.arange(31, dtype=np.float32)}, "'x-coordinate' has 31 points but the field has 32"),
    ({"tensor": np.zeros((5, 32), np.float32)}, r"dataset 'tensor' has shape \[5, 32\], expected 3 or 4 or 5 axes"),
    ({"tensor": np.zeros((5, 11, 32), np.int32)}, "dataset 'tensor' has dtype int32, expected floating"),
])
def test_bad_1d_layouts(tmp_path, overrides, message):
    path = tmp_path / "1D_Advection_Sols_beta0.1.hdf5"
    write_raw_1d(path, **overrides)
    with pytest.raises(DataError, match=rf"1D_Advection_Sols_beta0.1.hdf5: {message}"):
        read_task(path, task="advection1d")


def test_bad_darcy_layouts(tmp_path):
    path = tmp_path / "2D_DarcyFlow_beta1.0_Train.hdf5"
    write_raw_darcy(path, nu=np.ones((3, 16, 8), np.float32))
    with pytest.raises(DataError, match=r"Train.hdf5: 'nu' has shape \[3, 16, 8\] but 'tensor' \[3, 1, 16, 16\]"):
        read_task(path, task="darcy2d")
    path2 = tmp_path / "2D_DarcyFlow_beta0.1_Train.hdf5"
    write_raw_1d(path2)  # a 1D file under a Darcy name
    with pytest.raises(DataError, match="holds a 1D field .* but task darcy2d is 2D steady"):
        read_task(path2, task="darcy2d")


def test_truncated_file(tmp_path):
    path = tmp_path / "1D_Burgers_Sols_Nu0.1.hdf5"
    write_raw_1d(path, n=20, nx=256)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"1D_Burgers_Sols_Nu0.1.hdf5: cannot (open|read)"):
        read_task(path)


# --- writing ---------------------------------------------------------------------------------

def test_write_round_trip_plain_h5py(tmp_path):
    path = tmp_path / task_file_name("burgers1d", 0.001)
    tensor = np.random.default_rng(1).standard_normal((3, 6, 16))
    write_pdebench(path, "burgers1d", tensor=tensor, x_coordinate=(np.arange(16) + 0.5) / 16,
                   t_coordinate=np.arange(7) * 0.01, attrs={"seed": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    with h5py.File(path, "r") as f:
        assert sorted(f.keys()) == ["t-coordinate", "tensor", "x-coordinate"]
        assert f["tensor"].dtype == np.float32 and f["tensor"].shape == (3, 6, 16)
        assert f["t-coordinate"].shape == (7,) and f.attrs["seed"] == 3
    np.testing.assert_allclose(read_task(path).u[:, :, 0], tensor, rtol=1e-6)


def test_writer_failure_leaves_nothing_and_keeps_old_file(tmp_path):
    path = tmp_path / "2D_DarcyFlow_beta1.0_Train.hdf5"
    kwargs = dict(n_samples=4, x_coordinate=np.arange(8.0), y_coordinate=np.arange(8.0))
    with pytest.raises(RuntimeError, match="boom"):
        with PDEBenchWriter(path, "darcy2d", **kwargs) as writer:
            writer.write(0, np.zeros((2, 1, 8, 8)), np.ones((2, 8, 8)))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="never written"):
        with PDEBenchWriter(path, "darcy2d", **kwargs) as writer:
            writer.write(0, np.zeros((2, 1, 8, 8)), np.ones((2, 8, 8)))
    assert [p.name for p in tmp_path.iterdir()] == [path.name] and path.read_bytes() == b"old"


# --- split -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n, n_test, n_val", [(0, 0, 0), (1, 0, 0), (2, 0, 1), (10, 1, 1), (11, 1, 1),
                                              (100, 10, 9), (10000, 1000, 900)])
def test_split_sizes_and_properties(n, n_test, n_val):
    s = split_indices(n, seed=3)
    assert (s.test.size, s.val.size) == (n_test, n_val)
    np.testing.assert_array_equal(s.test, np.arange(n_test))  # PDEBench: the FIRST int(0.1 N)
    everything = np.concatenate([s.train, s.val, s.test])
    np.testing.assert_array_equal(np.sort(everything), np.arange(n))  # disjoint and complete
    for part in (s.train, s.val):
        assert np.all(np.diff(part) > 0) and (part.size == 0 or part.min() >= n_test)
    again = split_indices(n, seed=3)
    np.testing.assert_array_equal(again.val, s.val)


def test_the_wells_split_is_kept_only_when_all_three_folders_hold_trajectories():
    s = split_of_sources({"train": [3, 0, 1], "valid": [4], "test": [2]})
    assert (s.train.tolist(), s.val.tolist(), s.test.tolist()) == ([0, 1, 3], [4], [2])
    assert split_of_sources({"train": [0, 1, 2]}) is None  # a lone train folder is split as one file
    assert split_of_sources({"train": [0, 1], "valid": [2], "test": []}) is None


def test_split_seed_changes_val_only():
    a, b = split_indices(1000, seed=0), split_indices(1000, seed=1)
    np.testing.assert_array_equal(a.test, b.test)
    assert not np.array_equal(a.val, b.val)
    with pytest.raises(ValueError, match="test_fraction"):
        split_indices(10, test_fraction=1.0)
    with pytest.raises(ValueError, match="n must be"):
        split_indices(-1)


@settings(max_examples=80, deadline=None, database=None)
@given(n=st.integers(0, 500), test_fraction=st.floats(0, 0.9), val_fraction=st.floats(0, 0.9),
       seed=st.integers(0, 2**31))
def test_split_partition_property(n, test_fraction, val_fraction, seed):
    s = split_indices(n, test_fraction=test_fraction, val_fraction=val_fraction, seed=seed)
    assert s.test.size == int(n * test_fraction)
    np.testing.assert_array_equal(np.sort(np.concatenate([s.train, s.val, s.test])), np.arange(n))
    if n - s.test.size >= 2 and val_fraction > 0:
        assert s.val.size >= 1 and s.train.size >= 1
