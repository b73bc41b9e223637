"""What commands leave on disk when the disk is full, under a umask, after a killed writer, and
when a data file declares more than it holds (issue 29)."""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections import namedtuple

import h5py
import numpy as np
import orjson
import pytest
import torch
import yaml

from entry.storage.atomic import PART_SUFFIX, atomic_write, atomic_write_bytes
from pipelines.pdebench_io import DataError
from tests import tiny_run as tr
from tests.test_user_errors import _one_line_error

BURGERS = "1D_Burgers_Sols_Nu0.01.hdf5"
Usage = namedtuple("Usage", "total used free")


def _half_then_full(path, data):
    """A `Path.write_bytes` on a disk that fills halfway through."""
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _no_part_files(folder: pathlib.Path) -> bool:
    return not [p for p in folder.rglob("*") if p.name.endswith(PART_SUFFIX)]


# --- item 1: eval.json and the plots are written atomically ---------------------------------

def test_a_full_disk_while_evaluate_writes_keeps_the_old_eval_json(tmp_path, monkeypatch, capsys):
    from entry.config.load import load_config
    from entry.distributed.process_group import DistInfo
    from entry.evaluation import scoring

    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(tr.tiny_tree(tmp_path)))
    cfg = load_config(cfg_path)
    run_dir = tmp_path / "runs" / "base"
    run_dir.mkdir(parents=True)
    old = orjson.dumps({"tasks": {}, "previous": "results"})
    (run_dir / "eval.json").write_bytes(old)
    monkeypatch.setattr(pathlib.Path, "write_bytes", _half_then_full)
    info = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)
    with pytest.raises(OSError) as err:
        scoring._write_evaluation(cfg, info, run_dir, {"tasks": {}, "new": 1}, {}, {}, small=False)
    assert err.value.errno == errno.ENOSPC and "eval.json" in str(err.value)
    monkeypatch.undo()
    assert (run_dir / "eval.json").read_bytes() == old
    assert _no_part_files(run_dir)


def test_a_full_disk_while_a_plot_is_saved_keeps_the_old_plot(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from entry.evaluation.plots import plot_curves

    path = plot_curves(tmp_path / "curve.png", {"ours": [0.1, 0.2, 0.3]}, "first")
    old = path.read_bytes()
    assert old.startswith(b"\x89PNG")
    real = Figure.savefig

    def full(fig, fname, **kw):
        real(fig, fname, **kw)
        with open(fname, "r+b") as f:
            f.truncate(os.path.getsize(fname) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", full)
    with pytest.raises(OSError, match="no space left"):
        plot_curves(path, {"ours": [0.5, 0.4, 0.3]}, "second")
    assert path.read_bytes() == old and _no_part_files(tmp_path)


# --- item 2: a full disk is reported as one, whatever the writer says -------------------------

def test_a_writer_that_fails_on_a_nearly_full_disk_is_reported_as_no_space(tmp_path, monkeypatch):
    target = tmp_path / "operator.pt"
    target.write_bytes(b"old weights")

    def zip_writer(tmp):  # what torch.save's zip writer raises when the disk fills
        tmp.write_bytes(b"PK" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4736 vs 4630")

    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 << 30, (10 << 30) - 4096, 4096))
    with pytest.raises(OSError) as err:
        atomic_write(target, zip_writer)
    assert err.value.errno == errno.ENOSPC
    message = str(err.value)
    assert "no space left on " in message and f"while writing {target}" in message and "(4096 bytes free" in message
    assert isinstance(err.value.__cause__, RuntimeError)
    assert target.read_bytes() == b"old weights" and _no_part_files(tmp_path)
    # With room to spare, the writer's own error is not disguised as a full disk.
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 << 30, 0, 10 << 30))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        atomic_write(target, zip_writer)
    assert target.read_bytes() == b"old weights" and _no_part_files(tmp_path)


def test_a_write_into_a_file_system_of_no_size_keeps_its_own_error(tmp_path, monkeypatch):
    # /proc and /sys report 0 bytes of 0 free: a refused write there is not a full disk.
    def refused(tmp):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(0, 0, 0))
    with pytest.raises(PermissionError, match="Permission denied"):
        atomic_write(tmp_path / "x.h5", refused)
    assert _no_part_files(tmp_path)
    # A real ENOSPC from such a folder is still one.
    with pytest.raises(OSError, match="no space left") as err:
        atomic_write(tmp_path / "x.h5", lambda tmp: _half_then_full(tmp, b"x" * 100))
    assert err.value.errno == errno.ENOSPC and "unknown bytes free" in str(err.value)


def test_enospc_names_the_file_system_and_the_bytes_free(tmp_path):
    with pytest.raises(OSError) as err:
        atomic_write(tmp_path / "eval.json", lambda tmp: _half_then_full(tmp, b"x" * 100))
    assert err.value.errno == errno.ENOSPC and "bytes free" in str(err.value) and str(tmp_path) in str(err.value)


# --- item 3: published files and folders follow the umask -----------------------------------

@pytest.mark.parametrize("umask,file_mode,folder_mode", [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775)])
def test_published_files_and_cache_folders_follow_the_umask(tmp_path, umask, file_mode, folder_mode):
    from pipelines.latent_cache import write_cache
    from pipelines.layouts.the_well_write import write_well

    previous = os.umask(umask)
    try:
        well = write_well(tmp_path / "data" / "train" / "d.hdf5", dataset_name="d",
                          fields={"u": np.zeros((1, 2, 4), np.float32)}, axes=("x",), coords=(np.arange(4.0),),
                          times=np.arange(2.0), periodic=(True,), parameters={})
        written = atomic_write_bytes(tmp_path / "config.json", b"{}")
        weights = atomic_write(tmp_path / "operator.pt", lambda p: torch.save({"w": torch.zeros(2)}, p))
        cache = write_cache(tmp_path / "cache" / "dynamic_train-0", [{"z": torch.zeros(2, 3)}], {"config_hash": "x"},
                            specs={"z": ((2, 3), torch.float32)})
    finally:
        os.umask(previous)
    assert oct(written.stat().st_mode & 0o777) == oct(file_mode)
    assert oct(well.stat().st_mode & 0o777) == oct(file_mode)  # data in The Well's layout too
    assert oct(weights.stat().st_mode & 0o777) == oct(file_mode)
    assert oct(cache.stat().st_mode & 0o777) == oct(folder_mode)
    for f in cache.iterdir():
        assert oct(f.stat().st_mode & 0o777) == oct(file_mode), f


# --- item 4: what a killed data writer left is removed by the next one ----------------------

def _hold_lock(target: pathlib.Path) -> subprocess.Popen:
    """A live writer of `target`: holds its writer lock and has a temporary file beside it."""
    code = ("import sys, time; from pipelines.writer_lock import try_lock, record_holder, temp_file_for\n"
            f"fd = try_lock({str(target)!r}); record_holder(fd)\n"
            f"temp_file_for({str(target)!r}).write_bytes(b'half'); print('held', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=tr.env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_generate_removes_dead_writers_temporaries_but_not_a_live_ones(tmp_path, capsys):
    from pipelines.generate import generate_task, main

    dead = tmp_path / f".{BURGERS}.tmp-99999"
    dead.write_bytes(b"x" * 4096)  # a writer killed with SIGKILL: no lock held on its target
    foreign = tmp_path / f".{BURGERS}.facts.json.tmp-99999-123"  # pipelines.file_facts' own protocol
    foreign.write_bytes(b"{}")
    small = dict(nx=32, nt=5, workers=1)
    generate_task("advection1d", 4, tmp_path, param=0.1, **small)
    assert not dead.exists() and foreign.exists()
    foreign.unlink()
    writer = _hold_lock(tmp_path / BURGERS)
    try:
        live = tmp_path / f".{BURGERS}.tmp-{writer.pid}"
        generate_task("advection1d", 4, tmp_path, param=0.1, **small)
        assert live.exists()  # its writer holds the lock: not garbage
        with pytest.raises(DataError, match=f"being written by pid {writer.pid}"):
            generate_task("burgers1d", 4, tmp_path, param=0.01, **small)
        assert main(["--task", "burgers1d", "--samples", "4", "--nx", "32", "--nt", "5", "--nu", "0.01",
                     "--out", str(tmp_path), "--device", "cpu", "--no-progress"]) == 2
        assert f"pid {writer.pid}" in capsys.readouterr().err and live.exists()
    finally:
        writer.kill()
        writer.wait()
    assert generate_task("burgers1d", 4, tmp_path, param=0.01, **small).is_file()
    assert not live.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no lock file left


def test_prepare_data_removes_a_killed_generators_leftover(tmp_path):
    from entry.prepare_data import main

    tree = tr.tiny_tree(tmp_path)
    tree["data"]["tasks"] = [{"name": "burgers1d", "param": 0.01, "samples": 8, "nx": 32, "nt": 5}]
    cfg = tmp_path / "burgers.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    folder = tmp_path / "data"
    folder.mkdir()
    dead = folder / f".{BURGERS}.tmp-99999"
    dead.write_bytes(b"x" * 4096)
    assert main(["--config", str(cfg)]) == 0
    assert (folder / BURGERS).is_file() and not dead.exists()


# --- item 5: a file that declares more than memory or disk holds is refused at once ----------

def _declared_only(path: pathlib.Path, n: int, nt: int, nx: int) -> pathlib.Path:
    """A 1D PDEBench-layout file whose datasets are declared (chunked) but never written: tiny on disk."""
    with h5py.File(path, "w") as f:
        f.create_dataset("tensor", shape=(n, nt, nx), dtype=np.float32, chunks=(1, min(nt, 256), min(nx, 1024)))
        f.create_dataset("x-coordinate", shape=(nx,), dtype=np.float32, chunks=(min(nx, 1024),))
        f.create_dataset("t-coordinate", shape=(nt + 1,), dtype=np.float32, chunks=(min(nt + 1, 1024),))
    return path


def test_a_sample_larger_than_memory_is_refused_with_one_line(tmp_path, capfd):
    from entry.prepare_data import main

    huge = _declared_only(tmp_path / BURGERS, 10, 2_000_000, 50_000)  # 372.5 GiB per sample
    assert huge.stat().st_size < 1 << 20
    tree = tr.tiny_tree(tmp_path)
    tree["data"]["tasks"] = [{"name": "burgers1d", "param": 0.01, "samples": 10, "path": str(huge)}]
    cfg = tmp_path / "huge.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    t0 = time.perf_counter()
    assert main(["--config", str(cfg)]) == 2
    assert time.perf_counter() - t0 < 5
    line = _one_line_error(capfd, "data error", str(huge), "dataset 'tensor' declares [10, 2000000, 50000] float32",
                           "372.5 GiB per sample")
    assert "US_MAX_SAMPLE_BYTES" in line


def test_a_file_declaring_more_than_it_stores_is_refused_before_the_scan(tmp_path, monkeypatch):
    from pipelines.validate import main, validate_file

    big = _declared_only(tmp_path / "1D_Advection_Sols_beta0.1.hdf5", 300_000, 201, 1024)  # 230 GiB declared
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"declares \[300000, 201, 1024\] float32 = 230.0 GiB, but the file stores 0"):
        validate_file(big)
    assert main([str(big)]) == 2
    assert time.perf_counter() - t0 < 5
    monkeypatch.setenv("US_MAX_SAMPLE_BYTES", "1000")  # the bound is configurable
    with pytest.raises(DataError, match="0.0 GiB per sample, more than 0.0 GiB .US_MAX_SAMPLE_BYTES=1000"):
        validate_file(big)
