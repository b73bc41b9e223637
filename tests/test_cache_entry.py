"""entry.data.latent_cache: a cache is refused, with the rebuild command, once the encoder, the data or a
relevant config key changes; it is byte-identical when built twice."""

import logging

import h5py
import pytest
import torch

from entry.config.load import load_config
from entry.data.latent_cache import build_cache, cache_folder, load_latent_cache
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
    td = load_latent_cache(cfg, "dynamic", "train", verify="sha256")
    assert td["z"].device.type == "cpu" and td["z"].shape[2:] == (cfg.latent.tokens, cfg.latent.dim)
    before = _bytes(cache_folder(cfg, "dynamic", "train"))
    build_cache(cfg, INFO, logging.getLogger("t"), "dynamic", "train")
    assert _bytes(cache_folder(cfg, "dynamic", "train")) == before


def test_changed_encoder_weights_are_refused(prepared):
    cfg, _ = prepared
    path = weights_file(run_dir_for(cfg), "autoencoder")
    state = torch.load(path, weights_only=True)
    first = next(iter(state))
    state[first] = state[first] + 1e-3
    torch.save(state, path)
    with pytest.raises(CacheError, match="encoder_hash.*python -m entry.cache"):
        load_latent_cache(cfg, "dynamic", "train")


def test_changed_data_file_is_refused(prepared):
    cfg, _ = prepared
    from entry.data.files import task_path

    with h5py.File(task_path(cfg, cfg.data.tasks[0]), "r+") as f:
        f["tensor"][0, 0, 0] += 1.0
    with pytest.raises(CacheError, match="data_fingerprints.*python -m entry.cache"):
        load_latent_cache(cfg, "dynamic", "train")


def test_changed_relevant_config_key_is_refused(prepared):
    _, cfg_path = prepared
    changed = load_config(cfg_path, ["data.tasks.0.reduce_x=2"])
    with pytest.raises(CacheError, match="config_hash.*python -m entry.cache"):
        load_latent_cache(changed, "dynamic", "train")
    # A key the cache does not depend on leaves it valid.
    assert load_latent_cache(load_config(cfg_path, ["operator.lr=0.5"]), "dynamic", "train") is not None
