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


# --- issue 47, bugs 2 and 3: --options text longer than a file name, and alias bombs in it ----------------

def _quickstart_burgers(folder):
    """The quickstart's Burgers file (nx 128, nt 41), fewer samples, made by the project's generator."""
    from pipelines.generate import generate_task

    return generate_task("burgers1d", 4, folder, nx=128, nt=41, param=0.01, device="cpu")


def test_inline_options_longer_than_a_file_name_are_read_as_yaml(tmp_path, capsys):
    """The issue's command: a 250-character field name made the text too long to stat as a path
    (OSError: File name too long, exit 1)."""
    path = _quickstart_burgers(tmp_path)
    name = "v" * 250
    options = f"{{fields: [{{key: tensor, axes: n t x, name: {name}}}]}}"
    assert len(options) > 255
    assert main([str(path), "--layout", "hdf5", "--options", options]) == 0
    out = capsys.readouterr().out
    assert f"fields      {name} (scalar: {name})" in out and "trajectories 4" in out, out[:2000]


def _laughs(levels: int) -> str:
    """`levels` levels of nine aliases each, as one inline list (9**levels ones unfolded)."""
    names = "abcdefghijkl"[:levels]
    anchors = ["&a [1,1,1,1,1,1,1,1,1]"] + [f"&{n} [" + ",".join([f"*{p}"] * 9) + "]"
                                            for p, n in zip(names, names[1:])]
    return "[" + ", ".join(anchors) + "]"


@pytest.mark.parametrize("levels", [6, 9])
@pytest.mark.parametrize("given", ["inline", "file"])
def test_an_alias_bomb_in_options_is_one_line_exit_2(tmp_path, levels, given):
    """The issue's bombs: 9 levels grew to 3.9 GB in a MemoryError, 6 levels exited 0 printing a 3.6 MB
    line. In a child whose address space is capped, so a regression fails fast instead of filling
    the machine; it must answer within seconds (it takes a fraction of one)."""
    import resource
    import time

    path = _quickstart_burgers(tmp_path)
    options = f"{{fields: [{{key: tensor, axes: n t x}}], name: {_laughs(levels)}}}"
    if given == "file":
        (tmp_path / "bomb.yaml").write_text(options)
        options = str(tmp_path / "bomb.yaml")
    cap = 3 << 30

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipelines.inspect", str(path), "--layout", "hdf5", "--options",
                           options], capture_output=True, text=True, preexec_fn=limit, timeout=120)
    seconds = time.perf_counter() - start
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout[:500], done.stderr[-2000:])
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --options: not valid YAML: aliases") and len(lines[0]) < 500, \
        done.stderr[-2000:]
    assert seconds < 60, seconds
