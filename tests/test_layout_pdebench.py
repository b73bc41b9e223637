"""PDEBench's five layouts, written here with PDEBench's exact keys and shapes, read back by
`pipelines.layouts`: every value against an h5py read by hand, and bad files refused by name.

Legend: N samples, T time steps, C channels, X/Y/Z grid points.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.layouts import DataError, describe, read_constants, read_window

RNG = np.random.default_rng(0)


def _rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _write(path, datasets: dict, attrs: dict | None = None):
    with h5py.File(path, "w") as f:
        for key, value in datasets.items():
            f.create_dataset(key, data=value)
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
    return path


def scalar_1d(tmp_path):
    """PDEBench 1D advection: tensor [N, T, X], x-coordinate [X], t-coordinate [T + 1]."""
    return _write(tmp_path / "1D_Advection_Sols_beta0.4.hdf5",
                  {"tensor": _rand(5, 7, 16), "x-coordinate": (np.arange(16) + 0.5) / 16,
                   "t-coordinate": np.arange(8) * 0.01})


def darcy(tmp_path):
    return _write(tmp_path / "2D_DarcyFlow_beta1.0_Train.hdf5",
                  {"tensor": _rand(4, 1, 8, 8), "nu": _rand(4, 8, 8), "x-coordinate": np.linspace(0, 1, 8),
                   "y-coordinate": np.linspace(0, 1, 8)})


def cfd(tmp_path, dims: int = 2):
    shape = (3, 6, *(8,) * dims)
    keys = {"density": _rand(*shape), "pressure": _rand(*shape), "Vx": _rand(*shape), "Vy": _rand(*shape),
            "Vz": _rand(*shape)}
    keys = {k: v for k, v in keys.items() if k[0] != "V" or "xyz".index(k[1]) < dims}
    coords = {f"{a}-coordinate": np.linspace(-1, 1, 8) for a in "xyz"[:dims]}
    return _write(tmp_path / f"{dims}D_CFD_Rand_M0.1_Eta0.01_Zeta0.01_periodic_8_Train.hdf5",
                  {**keys, **coords, "t-coordinate": np.linspace(0, 1, 7)})


def groups(tmp_path, channels: int = 2):
    """PDEBench 2D diffusion-reaction: groups 0000.. with data [T, X, Y, C] and grid/{x,y,t}."""
    path = tmp_path / "2D_diff-react_NA_NA.h5"
    with h5py.File(path, "w") as f:
        for i in range(4):
            g = f.create_group(f"{i:04d}")
            g.create_dataset("data", data=_rand(6, 8, 8, channels))
            g.create_dataset("grid/x", data=np.linspace(-1, 1, 8))
            g.create_dataset("grid/y", data=np.linspace(-1, 1, 8))
            g.create_dataset("grid/t", data=np.linspace(0, 5, 6))
    return path


def ns_incompressible(tmp_path):
    return _write(tmp_path / "ns_incom_inhom_2d_512-0.h5",
                  {"velocity": _rand(3, 5, 8, 8, 2), "particles": _rand(3, 5, 8, 8, 1), "force": _rand(3, 8, 8, 2),
                   "t": np.tile(np.linspace(0, 5, 5), (3, 1))})


def _by_hand(path, variant: str, row: int) -> tuple[np.ndarray, np.ndarray | None]:
    """([T, C, *S], [C, *S] or None) of sample `row`, read with h5py alone."""
    with h5py.File(path, "r") as f:
        if variant == "scalar":
            return f["tensor"][row][:, None], None
        if variant == "darcy":
            return f["tensor"][row][None], f["nu"][row][None]
        if variant == "cfd":
            keys = [k for k in ("density", "pressure", "Vx", "Vy", "Vz") if k in f]
            return np.stack([f[k][row] for k in keys], axis=1), None
        if variant == "groups":
            return np.moveaxis(f[f"{row:04d}"]["data"][()], -1, 1), None
        vel = np.moveaxis(f["velocity"][row], -1, 1)
        return np.concatenate([vel, np.moveaxis(f["particles"][row], -1, 1)], 1), np.moveaxis(f["force"][row], -1, 0)


CASES = {
    "scalar": (scalar_1d, ("u",), 1, ()),
    "darcy": (darcy, ("u",), 2, ("nu",)),
    "cfd": (cfd, ("density", "pressure", "velocity_x", "velocity_y"), 2, ()),
    "groups": (groups, ("u", "v"), 2, ()),
    "ns_incompressible": (ns_incompressible, ("velocity_x", "velocity_y", "particles"), 2, ("force_x", "force_y")),
}


@pytest.mark.parametrize("variant", list(CASES))
def test_every_value_of_every_sample_is_what_h5py_reads(tmp_path, variant):
    make, channels, dims, constants = CASES[variant]
    path = make(tmp_path)
    (desc,) = describe(path)  # auto: recognised from the keys
    assert desc.layout == "pdebench" and desc.channels == channels and desc.dims == dims
    assert desc.constant_channels == constants
    for row in range(desc.trajectories):
        u, c = _by_hand(path, variant, row)
        assert np.array_equal(read_window(desc, row), u)
        got = read_constants(desc, row)
        assert (got is None and c is None) or np.array_equal(got, c)


def test_the_description_says_what_the_file_holds(tmp_path):
    (adv,) = describe(scalar_1d(tmp_path))
    assert adv.parameters == {"beta": 0.4} and adv.grid.periodic == (True,) and adv.steps == 7
    np.testing.assert_array_equal(adv.times, np.arange(7) * 0.01)  # t-coordinate holds T + 1 values
    (flow,) = describe(cfd(tmp_path))
    assert flow.parameters == {"M": 0.1, "Eta": 0.01, "Zeta": 0.01} and flow.grid.periodic == (True, True)
    assert [f.kind for f in flow.fields] == ["scalar", "scalar", "vector"]
    (darcy_desc,) = describe(darcy(tmp_path))
    assert darcy_desc.steady and darcy_desc.times is None
    (ns,) = describe(ns_incompressible(tmp_path))
    assert ns.grid.shape == (8, 8) and np.allclose(ns.grid.coords[0], (np.arange(8) + 0.5) / 8)


@pytest.mark.parametrize("dims", [1, 3])
def test_compressible_flow_in_one_and_three_dimensions(tmp_path, dims):
    path = cfd(tmp_path, dims)
    (desc,) = describe(path)
    assert desc.dims == dims and len(desc.channels) == 2 + dims
    u, _ = _by_hand(path, "cfd", 2)
    assert np.array_equal(read_window(desc, 2), u)


@settings(max_examples=25, deadline=None)
@given(t_start=st.integers(0, 5), t_len=st.integers(0, 6), t_step=st.integers(1, 3), x_step=st.integers(1, 4),
       row=st.integers(0, 3))
def test_a_window_is_the_slice_of_the_whole_sample(tmp_path_factory, t_start, t_len, t_step, x_step, row):
    path = groups(tmp_path_factory.mktemp("g"))
    (desc,) = describe(path)
    whole = read_window(desc, row)
    got = read_window(desc, row, t_start=t_start, t_stop=t_start + t_len, t_step=t_step, x_step=x_step)
    assert np.array_equal(got, whole[t_start:t_start + t_len:t_step, :, ::x_step, ::x_step])


def test_channel_names_attribute_names_the_fields_of_a_groups_file(tmp_path):
    path = groups(tmp_path, channels=3)
    with h5py.File(path, "a") as f:
        f.attrs["channel_names"] = ["height", "velocity_x", "velocity_y"]
    (desc,) = describe(path)
    assert [(f.name, f.kind) for f in desc.fields] == [("height", "scalar"), ("velocity", "vector")]


def _message(path, **kw) -> str:
    with pytest.raises(DataError) as err:
        describe(path, **kw)
    text = str(err.value)
    assert "\n" not in text and str(path) in text
    return text


def test_bad_files_are_refused_naming_the_file_and_the_key(tmp_path):
    ragged = groups(tmp_path)
    with h5py.File(ragged, "a") as f:
        del f["0002/data"]
        f["0002"].create_dataset("data", data=_rand(5, 8, 8, 2))
    assert "ragged" in _message(ragged) and "0002/data" in _message(ragged)

    path = cfd(tmp_path)
    with h5py.File(path, "a") as f:
        del f["pressure"]
        f.create_dataset("pressure", data=_rand(3, 6, 8, 4))
    assert "'pressure'" in _message(path)

    ints = _write(tmp_path / "ints.hdf5", {"tensor": np.zeros((2, 3, 4), np.int32)})
    assert "dtype" in _message(ints) and "'tensor'" in _message(ints)

    other = _write(tmp_path / "other.hdf5", {"fields": _rand(2, 3)})
    assert "keys present" in _message(other) and "fields" in _message(other)

    coords = _write(tmp_path / "c.hdf5", {"tensor": _rand(2, 3, 8), "x-coordinate": np.arange(7.0)})
    assert "'x-coordinate'" in _message(coords)

    assert "unknown layout" in _message(coords, layout="netcdf")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no HDF5 file" in _message(empty)
