"""A dataset declared by its path and layout trains end to end: PDEBench's per-sample groups, The
Well's format and a user's HDF5, each a 2D two-channel time-dependent file; every metric per field.

Legend: N trajectories, T stored steps, C channels, X/Y grid points.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import h5py
import numpy as np
import orjson
import pytest
import yaml

from pipelines.flows import generate_flow
from pipelines.layouts import describe, read_window
from tests.tiny_run import ROOT, env, run_here

pytestmark = pytest.mark.slow

SIZES = dict(resolution=32, stored=16, steps=11, t_end=5.0, chunk=16)
"""Diffusion-reaction at 16 x 16, dt = 0.5 between stored steps: persistence is a poor guess."""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Diffusion-reaction's 48 trajectories in PDEBench's groups and in a user's layout; shallow water
    (a scalar and a vector field) in The Well's (its train split: 38 trajectories)."""
    root = tmp_path_factory.mktemp("declared")
    groups = generate_flow("dr2d", 48, root / "pdebench", **SIZES)
    well = generate_flow("swe2d", 48, root / "well", layout="the_well", resolution=32, stored=16, steps=11,
                         t_end=1.0, chunk=16) / "data" / "train" / "swe2d.hdf5"
    (desc,) = describe(groups)
    user = root / "mine.h5"
    with h5py.File(user, "w") as f:  # a user's own axis order: [N, C, T, X, Y]
        f["uv"] = np.stack([read_window(desc, i) for i in range(48)]).transpose(0, 2, 1, 3, 4)
        f["time"] = desc.times
    return {"pdebench": groups, "the_well": well, "hdf5": user}


def _config(root, path, layout: str) -> dict:
    task = {"path": str(path), "layout": layout, "initial_step": 2}
    if layout == "hdf5":
        task["hdf5"] = {"fields": [{"key": "uv", "axes": "n c t x y", "name": "uv", "kind": "vector"}],
                        "times": "time"}
    return {
        "data": {"root": str(root / "data"), "tasks": [task]},
        "latent": {"tokens": 16, "dim": 32, "hidden": 0},
        "autoencoder": {"steps": 0},
        "operator": {"steps": 150, "batch_size": 16, "lr": 2e-3, "warmup_steps": 10,
                     "pdet": {"hidden_dim": 32, "depths": [1, 1], "num_heads": 4, "group_size": 4, "token_conv": True}},
        "training": {"num_workers": 0, "cache_dir": str(root / "cache"), "parallel": "none"},
        "evaluation": {"val_every": 50, "val_samples": 4, "time_rollout": False},
        "logging": {"run_dir": str(root / "runs"), "run_name": layout, "progress": False, "plots": False,
                    "wandb": {"mode": "disabled"}},
        "stages": ["autoencoder", "cache", "operator", "evaluate"],
    }


def _run(tmp_path, path, layout: str) -> dict:
    cfg = tmp_path / f"{layout}.yaml"
    cfg.write_text(yaml.safe_dump(_config(tmp_path, path, layout)))
    done = subprocess.run([sys.executable, "-m", "entry.pipeline", "--config", str(cfg)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (task,) = orjson.loads((tmp_path / "runs" / layout / "eval.json").read_bytes())["tasks"].values()
    return task


@pytest.mark.timeout(900)
def test_each_layout_trains_end_to_end_and_beats_persistence_on_every_field(tmp_path, files):
    results = {layout: _run(tmp_path, path, layout) for layout, path in files.items()}
    assert results["the_well"]["channels"] == ["height", "velocity_x", "velocity_y"]
    for layout, task in results.items():
        assert len(task["channels"]) >= 2, layout
        op, ref = task["variants"]["operator"]["per_field"], task["references"]["persistence"]["per_field"]
        assert set(op) == set(task["channels"])
        for field in task["channels"]:
            print(f"{layout:9s} {field:11s} nRMSE {op[field]['nrmse']:.4f} (persistence {ref[field]['nrmse']:.4f}) "
                  f"VRMSE {op[field]['vrmse']:.4f} (persistence {ref[field]['vrmse']:.4f})")
            assert np.isfinite([op[field]["nrmse"], op[field]["vrmse"]]).all()
            # 150 steps take the one-step error of dt = 0.5 far below the frame's change.
            assert op[field]["nrmse"] < 0.9 * ref[field]["nrmse"], (layout, field, op, ref)
    # The same values read through two layouts train the same model (same machine, same math).
    a, b = results["pdebench"]["variants"]["operator"], results["hdf5"]["variants"]["operator"]
    assert a["nrmse"] == b["nrmse"]


def _tree(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _bad_groups(path):
    """PDEBench's per-sample groups, one sample shorter than the others."""
    with h5py.File(path, "w") as f:
        for i, steps in enumerate((6, 6, 5)):
            f[f"{i:04d}/data"] = np.zeros((steps, 8, 8, 2), np.float32)
    return {"layout": "pdebench"}


def _user_file(path, **datasets):
    with h5py.File(path, "w") as f:
        for key, value in datasets.items():
            f[key] = value


def _hdf5(key: str, axes: str) -> dict:
    return {"layout": "hdf5", "hdf5": {"fields": [{"key": key, "axes": axes}]}}


def _well_names_disagree(path):
    from pipelines.layouts.the_well_write import write_well

    x = np.linspace(0, 1, 8)
    write_well(path, dataset_name="mine", fields={"p": np.zeros((3, 4, 8, 8), np.float32)}, axes=("x", "y"),
               coords=(x, x), times=np.arange(4.0), periodic=(True, True), parameters={})
    with h5py.File(path, "a") as f:
        f["t0_fields"].attrs["field_names"] = ["pressure"]
    return {"layout": "the_well"}


def _empty_folder(path):
    path.mkdir()
    return {"layout": "the_well"}


RNG = np.random.default_rng(0)
BAD = {
    "well field_names": (_well_names_disagree, ["field_names", "'pressure'"]),
    "empty folder": (_empty_folder, ["no HDF5 file"]),
    # case: (write the file, the task's extra keys, words the one line must hold)
    "ragged groups": (_bad_groups, ["ragged", "'0002/data'"]),
    "misspelt key": (lambda p: (_user_file(p, u=RNG.random((3, 4, 8, 8))), _hdf5("uu", "n t x y"))[1],
                     ["'uu'", "datasets present", "'u'"]),
    "axes against shape": (lambda p: (_user_file(p, u=RNG.random((3, 4, 8, 8))), _hdf5("u", "n t x"))[1],
                           ["'u'", "n t x"]),
    "not float": (lambda p: (_user_file(p, u=np.ones((3, 4, 8, 8), np.int32)), _hdf5("u", "n t x y"))[1],
                  ["'u'", "int32"]),
    "fields of two shapes": (lambda p: (_user_file(p, u=RNG.random((3, 4, 8, 8)), v=RNG.random((3, 4, 8, 6))),
                                        {"layout": "hdf5", "hdf5": {"fields": [{"key": "u", "axes": "n t x y"},
                                                                               {"key": "v", "axes": "n t x y"}]}})[1],
                             ["'v'", "sizes"]),
    "NaN": (lambda p: (_user_file(p, u=np.where(RNG.random((3, 4, 8, 8)) > 0.99, np.nan, 1.0)),
                       _hdf5("u", "n t x y"))[1], ["'u'", "NaN"]),
    "unknown layout": (lambda p: (_user_file(p, u=RNG.random((3, 4, 8, 8))), {"layout": "netcdf"})[1],
                       ["layout", "netcdf"]),
}


IN_A_PROCESS_OF_ITS_OWN = "misspelt key"
"""The case run as a user runs it; the others call the same `main` in the test's process (a
process start costs ~3 CPU-seconds, and the refusal's path is one for every case)."""


def _pipeline_refusal(cfg, case: str, capfd) -> subprocess.CompletedProcess:
    """entry.pipeline on `cfg`, in a process of its own for `IN_A_PROCESS_OF_ITS_OWN`."""
    if case == IN_A_PROCESS_OF_ITS_OWN:
        return subprocess.run([sys.executable, "-m", "entry.pipeline", "--config", str(cfg)], cwd=ROOT, env=env(),
                              capture_output=True, text=True, timeout=300)
    from entry.pipeline import main

    return run_here(main, ["--config", str(cfg)], capfd)


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_declared_file_is_one_line_exit_2_and_writes_nothing(tmp_path, case, capfd):
    make, words = BAD[case]
    path = tmp_path / "data.h5"
    extra = make(path)
    tree = _config(tmp_path, path, "auto")
    tree["data"]["tasks"][0] = {"path": str(path), **extra}
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    before = _tree(tmp_path)
    done = _pipeline_refusal(cfg, case, capfd)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    for word in [*words, *([] if case == "unknown layout" else [str(path)])]:
        assert word in line, (case, line)
    assert _tree(tmp_path) == before


@pytest.mark.timeout(600)
def test_a_well_dataset_folder_of_several_files_trains_on_its_own_split(tmp_path):
    # The Well's layout: <dataset>/data/{train,valid,test}/*.hdf5. A second training file (the same
    # parameters, other trajectories' bytes) joins the first: one task of 64 + 4 + 4 trajectories,
    # trained on the train folder, selected on valid, scored on test, as The Well splits it.
    dataset = generate_flow("swe2d", 40, tmp_path / "well", layout="the_well", resolution=32, stored=16, steps=11,
                            t_end=1.0, chunk=16)
    train = dataset / "data" / "train"
    shutil.copy(train / "swe2d.hdf5", train / "swe2d_more.hdf5")
    (desc,) = describe(dataset)
    assert sorted((s.split, s.path.name, s.trajectories) for s in desc.sources) == [
        ("test", "swe2d.hdf5", 4), ("train", "swe2d.hdf5", 32), ("train", "swe2d_more.hdf5", 32),
        ("valid", "swe2d.hdf5", 4)]
    tree = _config(tmp_path, dataset, "the_well")
    tree["operator"]["steps"] = 30
    (tmp_path / "well.yaml").write_text(yaml.safe_dump(tree))
    done = subprocess.run([sys.executable, "-m", "entry.pipeline", "--config", str(tmp_path / "well.yaml")], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (tmp_path / "runs" / "the_well" / "rank0.log").read_text()
    assert "cache dynamic/train: 64 trajectories" in log and "cache dynamic/val: 4 trajectories" in log
    (task,) = orjson.loads((tmp_path / "runs" / "the_well" / "eval.json").read_bytes())["tasks"].values()
    assert task["n_test_samples"] == 4
    assert task["channels"] == ["height", "velocity_x", "velocity_y"]
