"""entry.cache: a cache is refused, with the rebuild command, once the encoder, the data or a
relevant config key changes; it is byte-identical when built twice."""

import logging

import h5py
import pytest
import torch

from entry.config.load import load_config
from entry.data.cache_plan import cache_plan, open_cache
from entry.data.latent_cache import build_cache
from entry.distributed.process_group import DistInfo
from entry.storage.run_folder import run_dir_for
from entry.training.stage_record import weights_file
from pipelines.latent_cache import CacheError
from tests import tiny_run as tr

INFO = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)


@pytest.fixture()
def prepared(tmp_path):
    cfg_path = tr.prepare(tmp_path)
    return load_config(cfg_path), cfg_path


def _bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_loads_when_nothing_changed_and_rebuild_is_identical(prepared):
    cfg, _ = prepared
    td = open_cache(cache_plan(cfg, "dynamic", "train"), verify="sha256")
    assert td["z"].device.type == "cpu" and td["z"].shape[2:] == (cfg.latent.tokens, cfg.latent.dim)
    before = _bytes(cache_plan(cfg, "dynamic", "train").folder)
    build_cache(cfg, INFO, logging.getLogger("t"), "dynamic", "train")
    assert _bytes(cache_plan(cfg, "dynamic", "train").folder) == before


def test_changed_encoder_weights_are_refused(prepared):
    cfg, _ = prepared
    path = weights_file(run_dir_for(cfg), "autoencoder")
    state = torch.load(path, weights_only=True)
    first = next(iter(state))
    state[first] = state[first] + 1e-3
    torch.save(state, path)
    with pytest.raises(CacheError, match="encoder_hash.*python -m entry.cache"):
        open_cache(cache_plan(cfg, "dynamic", "train"))


def test_changed_data_file_is_refused(prepared):
    cfg, _ = prepared
    from entry.data.files import task_path

    with h5py.File(task_path(cfg, cfg.data.tasks[0]), "r+") as f:
        f["tensor"][0, 0, 0] += 1.0
    with pytest.raises(CacheError, match="data_fingerprints.*python -m entry.cache"):
        open_cache(cache_plan(cfg, "dynamic", "train"))


def test_changed_relevant_config_key_is_refused(prepared):
    _, cfg_path = prepared
    changed = load_config(cfg_path, ["data.tasks.0.reduce_x=2"])
    with pytest.raises(CacheError, match="config_hash.*python -m entry.cache"):
        open_cache(cache_plan(changed, "dynamic", "train"))
    # A key the cache does not depend on leaves it valid.
    assert open_cache(cache_plan(load_config(cfg_path, ["operator.lr=0.5"]), "dynamic", "train")) is not None


def test_the_built_cache_holds_exactly_the_planned_rows(prepared):
    """The plan resolved from the config is what the build encodes: every planned row of every
    task, in order, under its task id (sample ids = row + task id * 1e9), in the planned folder."""
    import numpy as np

    from entry.data.files import task_split

    cfg, _ = prepared
    plan = cache_plan(cfg, "dynamic", "train")
    assert plan.tasks and plan.needed and plan.folder.name.startswith("dynamic_train-")
    for t in plan.tasks:
        assert np.array_equal(t.rows, task_split(cfg, t.index, "train")[0])
    td = open_cache(plan)
    expected_ids = np.concatenate([t.rows + t.index * 10**9 for t in plan.tasks])
    assert np.array_equal(td["sample_id"].numpy(), expected_ids)
    assert td["z"].shape[0] == plan.trajectories
    assert not cache_plan(cfg, "steady", "train").needed  # no steady task in this config


def test_configs_sharing_a_cache_dir_keep_their_own_caches(prepared):
    """Issue 29: two configs with different encoders under one `training.cache_dir` each get a
    folder keyed by what it holds, so building the second leaves the first's cache (manifest and
    files) untouched and loadable; a config with the same content shares the first's folder."""
    from entry.models.build import build_autoencoder

    cfg, cfg_path = prepared
    first = cache_plan(cfg, "dynamic", "train")
    before = _bytes(first.folder)
    other = load_config(cfg_path, ["logging.run_name=other_encoder"])
    torch.manual_seed(1)  # another encoder: another seed
    weights = weights_file(run_dir_for(other), "autoencoder")
    weights.parent.mkdir(parents=True)
    torch.save(build_autoencoder(other).state_dict(), weights)
    with pytest.raises(CacheError, match="has not been built.*differs in manifest field encoder_hash.*entry.cache"):
        open_cache(cache_plan(other, "dynamic", "train"))
    build_cache(other, INFO, logging.getLogger("t"), "dynamic", "train")
    second = cache_plan(other, "dynamic", "train")
    assert second.folder != first.folder and second.folder.parent == first.folder.parent
    assert open_cache(second, verify="sha256")["z"].shape == open_cache(first)["z"].shape
    assert _bytes(first.folder) == before and open_cache(first, verify="sha256") is not None
    tr.new_run(cfg_path.parent, "same_encoder")  # a copy of the first run's encoder
    same = load_config(cfg_path, ["logging.run_name=same_encoder"])
    assert cache_plan(same, "dynamic", "train").folder == first.folder  # same content: one folder
