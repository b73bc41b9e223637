"""``python -m pipelines.inspect``: the description a user sees, streamed statistics, and one line
with exit 2 for a file that cannot be used.

Legend: N trajectories, T time steps, C channels, X/Y grid points.
"""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

from pipelines.inspect import main
from pipelines.layouts import describe
from pipelines.layouts.statistics import channel_statistics


def _groups_file(path, data_NTXYC: np.ndarray):
    with h5py.File(path, "w") as f:
        for i, sample in enumerate(data_NTXYC):
            g = f.create_group(f"{i:04d}")
            g["data"] = sample
            g["grid/x"] = np.linspace(-1, 1, sample.shape[1])
            g["grid/y"] = np.linspace(-1, 1, sample.shape[2])
            g["grid/t"] = np.linspace(0, 5, sample.shape[0])
        f.attrs["channel_names"] = ["activator", "inhibitor"]
    return path


def test_streamed_statistics_equal_numpy_over_the_whole_array(tmp_path):
    rng = np.random.default_rng(3)
    data = (rng.standard_normal((5, 4, 6, 6, 2)) * [1.0, 30.0] + [2.0, -500.0]).astype(np.float32)
    (desc,) = describe(_groups_file(tmp_path / "2D_diff-react_NA_NA.h5", data))
    stats = channel_statistics(desc)
    for c, s in enumerate(stats):
        values = data[..., c].astype(np.float64)
        # float64 accumulation of float32 values: agreement to ~1e-12 relative, far above rounding.
        assert s.count == values.size and s.nonfinite == 0
        np.testing.assert_allclose([s.mean, s.std, s.min, s.max],
                                   [values.mean(), values.std(), values.min(), values.max()], rtol=1e-10)
    sub = channel_statistics(desc, [1, 3])
    np.testing.assert_allclose(sub[1].mean, data[[1, 3], ..., 1].astype(np.float64).mean(), rtol=1e-10)


def test_inspect_prints_fields_grid_steps_and_statistics(tmp_path, capsys):
    data = np.ones((3, 4, 8, 8, 2), np.float32)
    path = _groups_file(tmp_path / "2D_diff-react_NA_NA.h5", data)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    for text in ("2D, 8 x 8", "4 steps", "trajectories 3", "activator (scalar", "inhibitor", "layout pdebench"):
        assert text in out, out


@pytest.mark.parametrize("problem", ["nan", "inf"])
def test_a_file_with_nan_or_inf_is_refused_in_one_line(tmp_path, capsys, problem):
    data = np.zeros((3, 4, 8, 8, 2), np.float32)
    data[1, 2, 3, 4, 1] = np.nan if problem == "nan" else np.inf
    path = _groups_file(tmp_path / "2D_diff-react_NA_NA.h5", data)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(path) in err and "'inhibitor'" in err and "1 NaN/Inf" in err


def test_the_command_exits_2_in_one_line_for_an_unknown_file(tmp_path):
    path = tmp_path / "x.h5"
    with h5py.File(path, "w") as f:
        f["stuff"] = np.zeros(3)
    before = sorted(p.name for p in tmp_path.iterdir())
    done = subprocess.run([sys.executable, "-m", "pipelines.inspect", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "keys present" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
