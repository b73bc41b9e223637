"""The latent cache refuses bad data and bad content and survives a killed or starved build
(issue 17, items 3, 4 and 6)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from entry.config.load import load_config
from entry.distributed.process_group import DistInfo
from pipelines.latent_cache import CacheError, check_cache, load_cache, sampled_sha256, write_cache
from tests import tiny_run as tr
from tests.faults import fault_env
from tests.test_user_errors import tree_digest

pytestmark = [pytest.mark.slow]
INFO = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache_safety")
    tr.prepare(root)
    return root


def _cache_main(root, *args: str) -> int:
    from entry.cache import main

    return main(["--config", str(root / "tiny.yaml"), "--no-deps", *args])  # the prepared encoder is the input


@pytest.mark.timeout(200)
def test_nan_data_is_refused_before_the_good_cache_is_touched(root, capfd):
    cfg = load_config(root / "tiny.yaml")
    from entry.data.files import task_path

    bad = root / "nan_data" / task_path(cfg, cfg.data.tasks[0]).name
    bad.parent.mkdir()
    shutil.copy(task_path(cfg, cfg.data.tasks[0]), bad)
    with h5py.File(bad, "r+") as f:
        f["tensor"][3, 2, 5] = np.nan
    before = tree_digest(root / "cache")
    assert _cache_main(root, "--set", f"data.tasks.0.path={bad}") == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith("data error: ") and str(bad) in err[-1] and "NaN" in err[-1], err
    assert tree_digest(root / "cache") == before


@pytest.mark.timeout(300)
def test_a_killed_build_is_followed_by_a_successful_rebuild(root):
    from entry.data.cache_plan import cache_plan, open_cache

    cfg = load_config(root / "tiny.yaml")
    env = fault_env(tr.env(), "kill@rank=0,step=0,stage=cache")
    killed = subprocess.run([sys.executable, "-m", "entry.cache", "--config", str(root / "tiny.yaml")], cwd=root,
                            env=env, capture_output=True, text=True, timeout=200)
    assert killed.returncode == -9, killed.stderr[-2000:]
    out = cache_plan(cfg, "dynamic", "train").folder  # keyed by the encoder the command trained first
    leftovers = list(out.parent.glob(f"{out.name}.tmp-*"))
    assert leftovers, "the kill came after the temporary folder was allocated"
    assert _cache_main(root) == 0
    assert not list(out.parent.glob(f"{out.name}.tmp-*")) and not list(out.parent.glob(f"{out.name}.old-*"))
    assert open_cache(cache_plan(cfg, "dynamic", "train"), verify="sha256")["z"].shape[0] > 0


@pytest.mark.timeout(200)
def test_a_full_disk_is_a_message_not_a_sigbus(root, monkeypatch):
    from entry.data.cache_plan import cache_plan
    from entry.data.latent_cache import build_cache

    cfg = load_config(root / "tiny.yaml")
    out = cache_plan(cfg, "dynamic", "train").folder
    before = tree_digest(out)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(CacheError, match="no space for the latent cache") as err:
        build_cache(cfg, INFO, logging.getLogger("test"), "dynamic", "train")
    assert "training.cache_dir" in str(err.value) and "GiB" in str(err.value)
    assert tree_digest(out) == before
    assert not list(out.parent.glob(f"{out.name}.tmp-*"))


@pytest.mark.timeout(300)
def test_a_same_size_overwrite_of_z_is_refused(root, capfd):
    from entry.data.cache_plan import cache_plan, open_cache
    from entry.operator import main as operator_main

    cfg = load_config(root / "tiny.yaml")
    z = cache_plan(cfg, "dynamic", "train").folder / "z.memmap"
    good = z.read_bytes()
    try:
        z.write_bytes(np.random.default_rng(0).standard_normal(len(good) // 4).astype(np.float32).tobytes())
        with pytest.raises(CacheError, match="z.memmap has the manifest's size but other content"):
            open_cache(cache_plan(cfg, "dynamic", "train"))
        args = ["--config", str(root / "tiny.yaml"), *tr.new_run(root, "overwritten")]
        assert operator_main(args) == 2
        last = capfd.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("cache error: ") and "z.memmap" in last and "python -m entry.cache" in last
        assert _cache_main(root, "--verify") == 2
    finally:
        z.write_bytes(good)
    assert _cache_main(root, "--verify") == 0


def test_sampled_hash_reads_little_and_sees_a_replaced_file(tmp_path):
    big = tmp_path / "big.bin"
    data = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)
    big.write_bytes(data.tobytes())
    first = sampled_sha256(big)
    assert sampled_sha256(big) == first  # deterministic
    big.write_bytes(np.roll(data, 1).tobytes())  # same size, other content
    assert sampled_sha256(big) != first
    small = tmp_path / "small.bin"
    small.write_bytes(b"abc")
    before = sampled_sha256(small)
    small.write_bytes(b"abd")  # small files are hashed whole: any change shows
    assert sampled_sha256(small) != before


def test_deep_check_finds_non_finite_values(tmp_path):
    z = torch.zeros(4, 3)
    z[2, 1] = float("nan")
    specs = {"z": ((4, 3), torch.float32)}
    out = write_cache(tmp_path / "c", [{"z": z}], {"config_hash": "x"}, specs=specs)
    assert "sampled" in check_cache(out, deep=False)  # content is what was written
    with pytest.raises(CacheError, match="1 non-finite"):
        check_cache(out, deep=True)
    load_cache(out, {"config_hash": "x"}, "hint", verify="sampled")
    from pipelines.validate import main as validate_main

    assert validate_main([str(out)]) == 0
    assert validate_main(["--deep", str(out)]) == 2
    assert validate_main([str(tmp_path)]) == 2  # a folder that is neither a cache nor an HDF5 file


@pytest.mark.timeout(200)
def test_non_finite_latents_are_refused_naming_the_encoder(root, capfd):
    run = root / "runs" / "nan_encoder"
    run.mkdir(parents=True)
    weights = torch.load(root / "runs" / "base" / "autoencoder.pt", weights_only=True)
    torch.save({k: v * float("nan") if v.is_floating_point() else v for k, v in weights.items()},
               run / "autoencoder.pt")
    cache_dir = root / "nan_cache"
    assert _cache_main(root, "--set", "logging.run_name=nan_encoder", "--set", f"training.cache_dir={cache_dir}") == 2
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("cache error: ") and str(run / "autoencoder.pt") in last and "non-finite" in last
    assert not [p for p in cache_dir.glob("*_train*") if p.is_dir()]  # no cache, no temporary folder


_BUILDER = """
import os, sys, time
from entry.storage.folder_lock import acquire
acquire(sys.argv[1], create=True, what="x")
print("held", flush=True)
time.sleep(float(sys.argv[4]))
os.rename(sys.argv[2], sys.argv[3])  # its build done: the cache in place
"""


@pytest.mark.timeout(300)
def test_a_second_build_of_the_same_cache_waits_for_the_first_and_reuses_it(root, capfd):
    """Two runs of a sweep whose codecs came out bitwise equal need one cache folder (keyed by its encoder
    and data): the second waits for the first's build and reuses it; a builder that outlasts half of
    training.timeout_s is a one-line exit 2 naming it."""
    from entry.data.cache_plan import cache_plan, open_cache
    from entry.data.cache_lock import cache_lock_file

    cfg = load_config(root / "tiny.yaml")
    out = cache_plan(cfg, "dynamic", "train").folder
    assert _cache_main(root) == 0
    built = out.with_name(out.name + ".built")
    out.rename(built)
    inode = built.stat().st_ino
    builder = subprocess.Popen([sys.executable, "-c", _BUILDER, str(cache_lock_file(out)), str(built), str(out), "1"],
                               env=tr.env(), stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "held"
        assert _cache_main(root) == 0  # waited (the folder was not there when it started), then found it
    finally:
        builder.wait(timeout=60)
    assert out.stat().st_ino == inode, "the other job's cache was replaced, not reused"
    assert open_cache(cache_plan(cfg, "dynamic", "train"), verify="sha256")["z"].shape[0] > 0
    assert not list(out.parent.glob(f"{out.name}.tmp-*"))

    stuck = subprocess.Popen([sys.executable, "-c", _BUILDER, str(cache_lock_file(out)), str(built), str(out), "120"],
                             env=tr.env(), stdout=subprocess.PIPE, text=True)
    try:
        assert stuck.stdout.readline().strip() == "held"
        capfd.readouterr()
        assert _cache_main(root, "--set", "training.timeout_s=2") == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert err[-1].startswith("folder in use: latent cache") and "waited 1 s" in err[-1], err
    finally:
        stuck.kill()
        stuck.wait(timeout=30)
    assert out.stat().st_ino == inode
