"""The Well's HDF5 layout: our writer, our reader, and the_well's own WellDataset on the same files.

Legend: N trajectories, T time steps, C channels, X/Y/Z grid points.
"""

import re
from pathlib import Path

import h5py
import numpy as np
import pytest

pytest.importorskip("the_well")

from the_well.data import WellDataset  # noqa: E402
from the_well.data.utils import flatten_field_names  # noqa: E402

from pipelines.layouts import DataError, describe, detect_layout, read_constants, read_window  # noqa: E402
from pipelines.layouts.the_well import describe_files  # noqa: E402
from pipelines.layouts.the_well_write import write_well  # noqa: E402

N, T, X = 3, 6, 8
SPLITS = ("train", "valid", "test")


def _flow(seed: int, n: int = N, x: int = X) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"pressure": rng.standard_normal((n, T, x, x)), "velocity": rng.standard_normal((n, T, x, x, 2))}


def _write_2d(path: Path, *, seed: int = 0, reynolds: float = 100.0, fields=None) -> dict[str, np.ndarray]:
    fields = fields or _flow(seed)
    x = fields["pressure"].shape[-1]
    c = np.arange(x) / x
    write_well(path, dataset_name="shear", fields=fields, axes=("x", "y"), coords=(c, c + 0.5 / x),
               times=np.arange(T) * 0.25, periodic=(True, False), parameters={"Reynolds": reynolds})
    return fields


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    """A 2D dataset in The Well's folders: (its root, the fields written per split)."""
    root = tmp_path_factory.mktemp("well") / "shear"
    data = {s: _write_2d(root / "data" / s / "shear_Reynolds_100.hdf5", seed=i) for i, s in enumerate(SPLITS)}
    return root, data


def test_describe_2d(flow):
    root, _ = flow
    (desc,) = describe(root)
    assert detect_layout(next(root.rglob("*.hdf5"))) == "the_well"
    assert (desc.name, desc.layout, desc.constants) == ("shear", "the_well", ())
    assert [(f.name, f.kind) for f in desc.fields] == [("pressure", "scalar"), ("velocity", "vector")]
    assert desc.channels == ("pressure", "velocity_x", "velocity_y")
    assert desc.grid.axes == ("x", "y") and desc.grid.shape == (X, X) and desc.grid.periodic == (True, False)
    assert np.array_equal(desc.grid.coords[1], np.arange(X) / X + 0.5 / X)
    assert np.array_equal(desc.times, np.arange(T) * 0.25)
    assert dict(desc.parameters) == {"Reynolds": 100.0} and desc.per_trajectory == ()
    assert [s.split for s in desc.sources] == list(SPLITS) and desc.trajectories == 3 * N
    assert desc.split_rows("valid") == [3, 4, 5]
    assert desc.identity == "shear_Reynolds100"


@pytest.mark.parametrize("n_in, n_out, stride", [(2, 3, 1), (1, 2, 2)])
def test_same_values_as_well_dataset(flow, n_in, n_out, stride):
    """the_well's own reader and ours give the same float32 bits, window by window."""
    root, data = flow
    (desc,) = describe(root)
    ds = WellDataset(path=str(root), well_split_name="train", n_steps_input=n_in, n_steps_output=n_out,
                     min_dt_stride=stride, max_dt_stride=stride, use_normalization=False)
    assert flatten_field_names(ds.metadata, include_constants=False) == list(desc.channels)
    windows = len(ds) // N
    for index in range(len(ds)):
        row, start = divmod(index, windows)
        sample = ds[index]
        theirs = np.concatenate([sample["input_fields"].numpy(), sample["output_fields"].numpy()])  # [T, X, Y, C]
        ours = read_window(desc, desc.split_rows("train")[row], t_start=start,
                           t_stop=start + (n_in + n_out) * stride, t_step=stride)  # [T, C, X, Y]
        assert ours.dtype == np.float32 and theirs.dtype == np.float32
        assert np.array_equal(theirs, ours.transpose(0, 2, 3, 1))
    # the boundaries as the_well reads them: x periodic (2) at both ends, y wall (0)
    assert sample["boundary_conditions"].tolist() == [[2.0, 2.0], [0.0, 0.0]]
    assert sample["constant_scalars"].tolist() == [100.0]
    assert np.array_equal(ours[:, 0], data["train"]["pressure"][row, start::stride].astype(np.float32))


def test_window_edges_and_x_step(flow):
    root, data = flow
    (desc,) = describe(root)
    v = data["test"]["velocity"].astype(np.float32)  # test split: global rows 6..8
    sub = read_window(desc, 7, t_start=1, t_stop=3, x_step=2)
    assert sub.shape == (2, 3, X // 2, X // 2)
    assert np.array_equal(sub[:, 1:], np.moveaxis(v[1, 1:3, ::2, ::2], -1, 1))
    assert read_window(desc, 0, t_start=T - 1).shape == (1, 3, X, X)
    assert read_window(desc, 0, t_start=T).shape == (0, 3, X, X)
    assert read_constants(desc, 0) is None


def test_tensor_constant_and_partial_fields_match_well_dataset(tmp_path):
    """A t2 field, a constant field, a field constant in y (``dim_varying``) and a per-trajectory
    scalar: named, read and broadcast as the_well does."""
    rng = np.random.default_rng(3)
    path = tmp_path / "visco" / "data" / "train" / "a.hdf5"
    c = np.arange(4) / 4.0
    write_well(path, dataset_name="visco", axes=("x", "y"), coords=(c, c), times=np.arange(T, dtype=float),
               periodic=(True, True), parameters={"Wi": 2.5},
               fields={"c": rng.standard_normal((2, T, 4, 4)), "stress": rng.standard_normal((2, T, 4, 4, 2, 2))},
               constants={"nu": rng.standard_normal((2, 4, 4))})
    h = rng.standard_normal((2, T, 4, 1)).astype(np.float32)
    with h5py.File(path, "r+") as f:  # extras our writer does not make: a field constant in y, an [N] scalar
        _add_field(f, "h", h, dim_varying=[True, False])  # y kept with size 1: the form WellDataset tiles
        amp = f["scalars"].create_dataset("amp", data=np.array([0.5, 0.7]))
        amp.attrs.update(sample_varying=True, time_varying=False)
        f["scalars"].attrs["field_names"] = ["Wi", "amp"]
    (desc,) = describe(tmp_path / "visco")
    assert desc.channels == ("c", "h", "stress_xx", "stress_xy", "stress_yx", "stress_yy")
    assert desc.fields[2].kind == "tensor" and desc.constant_channels == ("nu",)
    assert dict(desc.parameters) == {"Wi": 2.5} and desc.per_trajectory == ("amp",)
    ds = WellDataset(path=str(tmp_path / "visco"), well_split_name="train", n_steps_input=1,
                     n_steps_output=T - 1, use_normalization=False)
    assert flatten_field_names(ds.metadata) == [*desc.channels, *desc.constant_channels]
    sample = ds[1]
    theirs = np.concatenate([sample["input_fields"].numpy(), sample["output_fields"].numpy()])
    ours = read_window(desc, 1)
    assert np.array_equal(theirs, ours.transpose(0, 2, 3, 1))
    assert np.array_equal(sample["constant_fields"].numpy(), read_constants(desc, 1).transpose(1, 2, 0))
    assert np.array_equal(ours[:, 1], np.broadcast_to(h[1], (T, 4, 4)))

    # the spec's own form omits the y axis; the_well 1.2.0's tiling cannot read it, we broadcast it
    with h5py.File(path, "r+") as f:
        del f["t0_fields/h"]
        _add_field(f, "h", h[..., 0], dim_varying=[True, False])
    (desc,) = describe(tmp_path / "visco")
    assert np.array_equal(read_window(desc, 1, x_step=2)[:, 1], np.broadcast_to(h[1, :, ::2], (T, 2, 2)))


def _add_field(f: h5py.File, name: str, data: np.ndarray, *, dim_varying: list[bool]) -> None:
    node = f["t0_fields"].create_dataset(name, data=data)
    node.attrs.update(dim_varying=np.array(dim_varying), sample_varying=True, time_varying=True)
    names = [n for n in f["t0_fields"].attrs["field_names"] if n != name]
    f["t0_fields"].attrs["field_names"] = [names[0], name, *names[1:]]


def test_3d_reads_with_the_right_shape(tmp_path):
    rng = np.random.default_rng(1)
    rho, mom = rng.standard_normal((2, 3, 4, 4, 4)), rng.standard_normal((2, 3, 4, 4, 4, 3))
    c = np.linspace(0.0, 1.0, 4)
    write_well(tmp_path / "tiny3d.hdf5", dataset_name="tiny3d", fields={"density": rho, "momentum": mom},
               axes=("x", "y", "z"), coords=(c, c, c), times=np.arange(3.0), periodic=(True, True, False),
               parameters={})
    (desc,) = describe(tmp_path / "tiny3d.hdf5")
    assert desc.channels == ("density", "momentum_x", "momentum_y", "momentum_z")
    assert desc.sources[0].split is None and desc.grid.periodic == (True, True, False)
    window = read_window(desc, 1)
    assert window.shape == (3, 4, 4, 4, 4) and window.dtype == np.float32
    assert np.array_equal(window[:, 3], mom[1, ..., 2].astype(np.float32))
    assert read_window(desc, 0, t_stop=2, x_step=2).shape == (2, 4, 2, 2, 2)


def test_one_task_per_parameter_set(tmp_path):
    for reynolds in (100.0, 200.0):
        for split in ("train", "test"):
            _write_2d(tmp_path / "shear" / "data" / split / f"shear_Re{reynolds:g}.hdf5", reynolds=reynolds)
    descs = describe(tmp_path / "shear")
    assert sorted(d.identity for d in descs) == ["shear_Reynolds100", "shear_Reynolds200"]
    for d in descs:
        assert [s.split for s in d.sources] == ["train", "test"]
        assert all(f"{d.parameters['Reynolds']:g}" in s.path.name for s in d.sources)


def test_the_wells_own_dummy_file(tmp_path):
    """the_well's test file (``the_well/utils/dummy_data.py``): a constant field, a time-varying
    scalar (skipped, with a warning), ``associated_dims`` as a bare string, masks all false."""
    from the_well.utils.dummy_data import write_dummy_data

    path = tmp_path / "dummy" / "data" / "train" / "dummy.hdf5"
    path.parent.mkdir(parents=True)
    write_dummy_data(str(path))
    with pytest.warns(UserWarning, match="time_varying_scalar"):
        (desc,) = describe(tmp_path / "dummy")
    assert desc.channels == ("field_x", "field_y") and desc.constant_channels == ("constant_field",)
    assert dict(desc.parameters) == {"a": 0.25, "b": 0.75} and desc.grid.periodic == (False, False)
    ds = WellDataset(path=str(tmp_path / "dummy"), well_split_name="train", n_steps_input=4, n_steps_output=2,
                     use_normalization=False)
    sample = ds[len(ds) - 1]  # trajectory 1, its last window: steps 4..9
    theirs = np.concatenate([sample["input_fields"].numpy(), sample["output_fields"].numpy()])
    assert np.array_equal(theirs, read_window(desc, 1, t_start=4).transpose(0, 2, 3, 1))
    assert np.array_equal(sample["constant_fields"].numpy(), read_constants(desc, 1).transpose(1, 2, 0))


def test_files_of_one_task_must_agree(tmp_path):
    _write_2d(tmp_path / "shear" / "data" / "train" / "a.hdf5")
    small = tmp_path / "shear" / "data" / "test" / "a.hdf5"
    _write_2d(small, fields=_flow(1, x=4))
    with pytest.raises(DataError, match="dimensions") as err:
        describe(tmp_path / "shear")
    assert str(small) in str(err.value) and str(tmp_path / "shear" / "data" / "train" / "a.hdf5") in str(err.value)


def _bad(tmp_path: Path, edit) -> Path:
    path = tmp_path / "bad" / "data" / "train" / "bad.hdf5"
    _write_2d(path)
    with h5py.File(path, "r+") as f:
        edit(f)
    return path


def _replace(f, key: str, data: np.ndarray) -> None:
    attrs = dict(f[key].attrs)
    del f[key]
    f.create_dataset(key, data=data).attrs.update(attrs)


@pytest.mark.parametrize("edit, key, detail", [
    (lambda f: f["t0_fields"].attrs.__setitem__("field_names", ["pressure", "temperature"]), "t0_fields",
     "temperature"),
    (lambda f: _replace(f, "t0_fields/pressure", np.zeros((N, T, X, X), dtype=np.int32)), "t0_fields/pressure",
     "int32"),
    (lambda f: _replace(f, "t1_fields/velocity", np.zeros((N, T, X, 4, 2), dtype=np.float32)), "t1_fields/velocity",
     "[3, 6, 8, 4, 2]"),
    (lambda f: f["dimensions"].attrs.__setitem__("spatial_dims", ["x"]), "dimensions", "spatial_dims"),
], ids=["field_names", "not_float", "shape", "spatial_dims"])
def test_bad_files_name_the_file_and_the_key(tmp_path, edit, key, detail):
    path = _bad(tmp_path, edit)
    with pytest.raises(DataError) as err:
        describe(path.parent)
    message = str(err.value)
    assert str(path) in message and key in message and detail in message, message


def test_shape_mismatch_names_both_shapes(tmp_path):
    path = _bad(tmp_path, lambda f: _replace(f, "t1_fields/velocity", np.zeros((N, T, X, 4, 2), np.float32)))
    with pytest.raises(DataError, match=re.escape("[3, 6, 8, 8, 2]")) as err:
        describe(path)
    assert "t0_fields/pressure" in str(err.value) and "[3, 6, 8, 8]" in str(err.value)


def test_empty_split_folder_and_no_files(tmp_path):
    _write_2d(tmp_path / "shear" / "data" / "train" / "a.hdf5")
    (tmp_path / "shear" / "data" / "valid").mkdir()
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "shear" / "data" / "valid"))):
        describe(tmp_path / "shear" / "data" / "valid")
    with pytest.raises(DataError, match="no HDF5 file"):
        describe_files([], {})


def test_read_window_reads_only_the_window(flow, monkeypatch):
    """Every h5py read that `read_window` makes, counted: the elements returned sum to the window."""
    root, _ = flow
    (desc,) = describe(root)
    reads = []
    original = h5py.Dataset.__getitem__

    def counting(self, index, *args, **kwargs):
        out = original(self, index, *args, **kwargs)
        reads.append((self.name, index, np.size(out)))
        return out

    monkeypatch.setattr(h5py.Dataset, "__getitem__", counting)
    window = read_window(desc, 4, t_start=2, t_stop=4, x_step=2)
    assert {name for name, _, _ in reads} == {"/t0_fields/pressure", "/t1_fields/velocity"}
    assert all(index[0] == 1 for _, index, _ in reads)  # global row 4 is the valid file's row 1
    assert sum(size for _, _, size in reads) == window.size == 2 * 3 * (X // 2) ** 2


def test_writer_is_atomic_and_checks_arguments(tmp_path):
    folder = tmp_path / "out"
    with pytest.raises(TypeError):  # h5py cannot store the attribute: the half-written file goes
        write_well(folder / "a.hdf5", dataset_name="d", fields=_flow(0), axes=("x", "y"),
                   coords=(np.arange(X), np.arange(X)), times=np.arange(T), periodic=(True, True), parameters={},
                   attrs={"bad": object()})
    assert list(folder.iterdir()) == []
    with pytest.raises(ValueError, match="velocity"):
        write_well(folder / "a.hdf5", dataset_name="d", fields={**_flow(0), "velocity": np.zeros((N, T, X, X, 3))},
                   axes=("x", "y"), coords=(np.arange(X), np.arange(X)), times=np.arange(T), periodic=(True, True),
                   parameters={})
