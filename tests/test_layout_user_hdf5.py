"""A user's own HDF5 file, read through the field keys and axis orders the config names.

Legend: N trajectories, T time steps, C channels, X/Y grid points.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from pipelines.layouts import DataError, describe, read_constants, read_window

RNG = np.random.default_rng(1)


def _file(tmp_path):
    """vel [C, N, T, X, Y] (channels first), p [N, X, Y, T] (time last), nu [N, X, Y] (an input)."""
    path = tmp_path / "my_sim.h5"
    with h5py.File(path, "w") as f:
        f["vel"] = RNG.standard_normal((2, 3, 5, 6, 4)).astype(np.float32)
        f["p"] = RNG.standard_normal((3, 6, 4, 5))
        f["nu"] = RNG.standard_normal((3, 6, 4)).astype(np.float32)
        f["time"] = np.linspace(0, 1, 5)
        f["xs"] = np.linspace(0, 2, 6)
        f["labels"] = np.zeros((3, 6, 4, 5), np.int64)
    return path


OPTIONS = {"name": "my_flow", "fields": [{"key": "p", "axes": "n x y t", "name": "pressure"},
                                         {"key": "vel", "axes": "c n t x y", "name": "velocity"},
                                         {"key": "nu", "axes": "n x y", "input": True}],
           "coords": {"x": "xs"}, "times": "time", "periodic": [True, False], "parameters": {"Re": 100}}


def test_fields_in_any_axis_order_read_as_the_arrays_say(tmp_path):
    path = _file(tmp_path)
    (desc,) = describe(path, "hdf5", options=OPTIONS)
    assert desc.channels == ("pressure", "velocity_x", "velocity_y") and desc.constant_channels == ("nu",)
    assert desc.identity == "my_flow_Re100" and desc.grid.periodic == (True, False)
    np.testing.assert_array_equal(desc.grid.coords[0], np.linspace(0, 2, 6))
    np.testing.assert_array_equal(desc.times, np.linspace(0, 1, 5))
    with h5py.File(path) as f:
        p, vel, nu = f["p"][()], f["vel"][()], f["nu"][()]
    for row in range(3):
        want = np.concatenate([np.transpose(p[row], (2, 0, 1))[:, None], np.transpose(vel[:, row], (1, 0, 2, 3))], 1)
        assert np.array_equal(read_window(desc, row), want.astype(np.float32))
        assert np.array_equal(read_window(desc, row, t_start=1, t_stop=4, t_step=2, x_step=2),
                              want[1:4:2, :, ::2, ::2].astype(np.float32))
        assert np.array_equal(read_constants(desc, row), nu[row][None])


def test_a_steady_user_file_has_one_step(tmp_path):
    path = _file(tmp_path)
    (desc,) = describe(path, "hdf5", options={"fields": [{"key": "nu", "axes": "n x y"}]})
    assert desc.steady and read_window(desc, 2).shape == (1, 1, 6, 4)


@pytest.mark.parametrize("fields, words", [
    ([{"key": "pp", "axes": "n x y t"}], ["'pp'", "datasets present"]),
    ([{"key": "p", "axes": "n x y"}], ["'p'", "4 axes", "n x y"]),
    ([{"key": "p", "axes": "n t y x"}], ["'p'", "in order x, y, z"]),
    ([{"key": "labels", "axes": "n x y t"}], ["'labels'", "int64"]),
    ([{"key": "p", "axes": "n x y t"}, {"key": "vel", "axes": "n c t x y"}], ["'vel'", "sizes"]),
    ([{"key": "nu", "axes": "n x y", "input": True}], ["every field is an input"]),
    ([{"key": "p", "axes": "n x y t", "unit": "Pa"}], ["unknown keys", "'unit'"]),
])
def test_a_wrong_option_is_one_line_naming_the_file_and_the_key(tmp_path, fields, words):
    path = _file(tmp_path)
    with pytest.raises(DataError) as err:
        describe(path, "hdf5", options={"fields": fields})
    text = str(err.value)
    assert "\n" not in text and str(path) in text
    for word in words:
        assert word in text, text
