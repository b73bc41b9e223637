"""A layout is one module: a toy layout of .npz files (not HDF5), written to a temporary folder and
imported there, registers itself and is read by `describe`, `read_window(s)`, ``auto``, a folder
search, the config's ``layout:`` and the training's field datasets, with no other file of the repo
touched. Its registration is removed afterwards."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import numpy as np
import orjson
import pytest
import yaml

from entry.config.load import ConfigError, load_config
from pipelines.fields import FieldSnapshots, FieldTrajectoryPairs
from pipelines.inspect import _parser as inspect_parser
from pipelines.layouts import describe, layout_names, read_window, read_windows
from pipelines.layouts.registry import unregister_layout
from pipelines.task_data import read_task

# The whole layout a user would add as pipelines/layouts/toy.py: it opens its own files (np.load),
# so nothing of it is HDF5. Legend: N trajectories, T steps, C channels, X points.
TOY = textwrap.dedent('''
    """A toy layout: one .npz file of ``u`` [N, T, C, X], ``t`` [T] and ``x`` [X]."""
    import numpy as np

    from pipelines.layouts.description import DataError, DatasetDescription, FieldSpec, GridSpec, Source
    from pipelines.layouts.registry import Layout, register_layout


    def open_npz(path):
        try:
            return np.load(path)  # an NpzFile: a context manager that closes the file
        except (OSError, ValueError) as err:
            raise DataError(f"{path}: not an .npz file: {err}") from None


    def recognises(path):
        with open_npz(path) as z:
            return sorted(z.files) == ["t", "u", "x"]


    def describe_files(paths, options):
        out = []
        for p in paths:
            with open_npz(p) as z:
                n, _, c, _ = z["u"].shape
                t, x = np.asarray(z["t"], np.float64), np.asarray(z["x"], np.float64)
            out.append(DatasetDescription(
                name=p.stem, layout="toy", fields=tuple(FieldSpec.scalar(f"c{i}") for i in range(c)), constants=(),
                grid=GridSpec(axes=("x",), coords=(x,), periodic=(True,)), times=t, parameters={},
                sources=(Source(path=p, split=None, trajectories=n, size_bytes=p.stat().st_size),)))
        return out


    def read_window(desc, z, row, t, x_step):
        return np.asarray(z["u"][row, t, :, ::x_step], dtype=np.float32)


    register_layout(Layout(name="toy", open=open_npz, recognises=recognises, suffixes=(".npz",),
                           describe_files=describe_files, read_window=read_window))
''')

N, T, C, X = 6, 9, 2, 16


@pytest.fixture
def toy(tmp_path):
    """The toy layout's module imported from `tmp_path`; unregistered afterwards."""
    (tmp_path / "toy_layout.py").write_text(TOY)
    spec = importlib.util.spec_from_file_location("toy_layout", tmp_path / "toy_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        yield module
    finally:
        unregister_layout("toy")
        sys.modules.pop("toy_layout", None)
    assert "toy" not in layout_names()


def _data(folder, name="waves.npz", seed=0):
    """A [N, T, C, X] file of independent values (so any mixed-up index shows) and its arrays."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((N, T, C, X)).astype(np.float32)
    t, x = np.linspace(0.0, 0.8, T), (np.arange(X) + 0.5) / X
    np.savez(folder / name, u=u, t=t, x=x)
    return folder / name, u, t


def test_the_toy_layout_is_described_and_read_window_by_window(tmp_path, toy):
    path, u, t = _data(tmp_path / "data")
    assert "toy" in layout_names() and "toy" in inspect_parser()._option_string_actions["--layout"].choices
    (desc,) = describe(path, "toy")
    assert (desc.layout, desc.trajectories, desc.steps, desc.channels, desc.grid.shape) == ("toy", N, T, ("c0", "c1"), (X,))
    np.testing.assert_array_equal(desc.times, t)
    np.testing.assert_array_equal(read_window(desc, 4), u[4])
    np.testing.assert_array_equal(read_window(desc, 1, t_start=2, t_stop=8, t_step=3, x_step=2), u[1, 2:8:3, :, ::2])
    for got, row in zip(read_windows(desc, [5, 0, 5], t_step=2), [5, 0, 5], strict=True):
        np.testing.assert_array_equal(got, u[row, ::2])
    # auto finds it among the layouts that cannot open an .npz (HDF5's), and a folder is searched for .npz files
    assert describe(path)[0].layout == "toy"
    (other, _, _) = _data(tmp_path / "data" / "more", "more.npz", seed=1)
    assert [d.sources[0].path for d in describe(tmp_path / "data", "toy")] == [other, path]


def test_a_config_declares_toy_data_and_the_training_datasets_read_it(tmp_path, toy):
    path, u, t = _data(tmp_path / "data")
    tree = {"data": {"root": str(tmp_path / "data"), "tasks": [{"path": str(path), "layout": "toy", "reduce_t": 2}]},
            "logging": {"run_dir": str(tmp_path / "runs")}, "training": {"cache_dir": str(tmp_path / "cache")}}
    cfg = load_config(tree=tree)
    task = cfg.data.tasks[0]
    assert (task.spec.storage, task.spec.source_layout, task.spec.channels, task.spec.grid) == \
        ("declared", "toy", ("c0", "c1"), (X,))
    np.testing.assert_array_equal(read_task(path, [3, 1], task=task.spec, reduce_t=2).u, u[[3, 1], ::2])
    snapshots = FieldSnapshots(path, [0, 2], reduce_t=2, task=task.spec)  # the autoencoder's samples
    kept = len(range(0, T, 2))
    np.testing.assert_array_equal(snapshots.gather([kept + 1])["u"].numpy()[0], u[2, 2])  # row 2, kept step 1
    pairs = FieldTrajectoryPairs(path, [0, 2], reduce_t=2, task=task.spec)
    batch = pairs.gather([0, kept - 1])
    np.testing.assert_array_equal(batch["u_next"].numpy(), u[[0, 2], 2])
    np.testing.assert_allclose(batch["dt"].numpy(), 2 * (t[1] - t[0]), rtol=1e-6)


def test_a_layout_no_one_registered_is_a_config_error_naming_the_known_ones(tmp_path):
    path, _, _ = _data(tmp_path / "data")
    tree = {"data": {"root": str(tmp_path / "data"), "tasks": [{"path": str(path), "layout": "toy"}]}}
    with pytest.raises(ConfigError, match=r"layout must be one of \['auto', 'pdebench', 'the_well', 'hdf5'\]"):
        load_config(tree=tree)


@pytest.mark.timeout(600)
def test_the_whole_pipeline_trains_and_scores_on_toy_data(tmp_path, toy):
    """The stages in this process (the toy layout is registered here only): autoencoder, latent
    cache, operator and evaluation read the .npz file through the layout."""
    from entry.pipeline import main

    rng = np.random.default_rng(0)
    x = (np.arange(X) + 0.5) / X
    t = np.linspace(0.0, 1.0, T)
    phase = rng.uniform(0, 2 * np.pi, (24, 1, 1, 1))
    u = np.sin(2 * np.pi * (x - 0.2 * t[:, None, None]) + phase).repeat(C, axis=2).astype(np.float32)
    (tmp_path / "data").mkdir()
    np.savez(tmp_path / "data" / "waves.npz", u=u, t=t, x=x)
    tree = {"data": {"root": str(tmp_path / "data"),
                     "tasks": [{"path": str(tmp_path / "data" / "waves.npz"), "layout": "toy", "initial_step": 1}]},
            "latent": {"tokens": 4, "dim": 8, "hidden": 16},
            "autoencoder": {"steps": 2, "batch_size": 8},
            "operator": {"steps": 4, "batch_size": 8,
                         "pdet": {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2, "group_size": 2}},
            "training": {"num_workers": 0, "cache_dir": str(tmp_path / "cache"), "parallel": "none"},
            "evaluation": {"val_every": 2, "val_samples": 2},
            "logging": {"run_dir": str(tmp_path / "runs"), "run_name": "toy", "progress": False, "plots": False,
                        "wandb": {"mode": "disabled"}},
            "stages": ["autoencoder", "cache", "operator", "evaluate"]}
    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(tree))
    assert main(["--config", str(tmp_path / "toy.yaml")]) == 0
    (task,) = orjson.loads((tmp_path / "runs" / "toy" / "eval.json").read_bytes())["tasks"].values()
    assert task["channels"] == ["c0", "c1"]
    op = task["variants"]["operator"]
    assert set(op["per_field"]) == {"c0", "c1"} and np.isfinite(op["nrmse"])
