"""`latent.codec: fields` through the stack (issue 50, step 1): one run trains tasks of other channel
counts, dimensions and trajectory lengths (advection1d: 1 field on a line, 6 frames; dr2d: 2 fields
on a square, 6 frames; swe2d: 3 fields, 8 frames) in one codec and one operator, caches them in one
latent of one token count, and scores every field of each.

Legend: N trajectories, T stored steps, L tokens, D latent width.
"""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import orjson
import pytest
import torch
import yaml

from entry.config.load import ConfigError, load_config
from entry.data.cache_plan import cache_plan, open_cache
from entry.data.files import task_split
from entry.inference import load_run
from core.models.field_codec import dataset_buffer_key
from entry.models.build import build_autoencoder
from entry.stages.source import new_datasets
from entry.stages.stage_build import from_source
from entry.training.finetune import check_source
from tests.tiny_run import ROOT, env

pytestmark = pytest.mark.slow


def fields_tree(root) -> dict:
    """advection1d (u, 32 points), dr2d (activator, inhibitor; 16 x 16) and swe2d (height and velocity;
    16 x 16, 8 frames): 16 tokens per frame each (16 cells of 2 points; 4 x 4 cells of 4 x 4 points)."""
    return {
        "data": {"root": str(root / "data"), "generate_if_missing": True,
                 "tasks": [{"name": "advection1d", "param": 0.1, "samples": 12, "nx": 32, "nt": 6},
                           {"name": "dr2d", "param": 0.005, "samples": 12, "nx": 16, "resolution": 32, "nt": 6},
                           {"name": "swe2d", "param": 1.0, "samples": 12, "nx": 16, "resolution": 32, "nt": 8}]},
        "latent": {"codec": "fields", "tokens": 16, "dim": 8, "hidden": 16},
        "autoencoder": {"steps": 4, "batch_size": 4},
        "operator": {"steps": 4, "batch_size": 4,
                     "pdet": {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2, "group_size": 4}},
        "training": {"num_workers": 0, "cache_dir": str(root / "cache"), "parallel": "none", "compile": False},
        "evaluation": {"time_rollout": False},
        "logging": {"run_dir": str(root / "runs"), "run_name": "fields", "progress": False, "plots": False,
                    "wandb": {"mode": "disabled"}},
        "stages": ["autoencoder", "cache", "operator", "evaluate"],
    }


def run_pipeline(cfg_path, timeout: int = 170, ranks: int = 1) -> subprocess.CompletedProcess:
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    return subprocess.run([sys.executable, *launch, "-m", "entry.pipeline", "--config", str(cfg_path)], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=timeout)


def fine_tune(source, tmp_path, task: dict, name: str, ranks: int = 1, **sections):
    """Fine-tune the run `source` on the generated `task` alone, by a config of its data, `finetune.from`
    and logging (plus `sections`, e.g. a frozen codec), on `ranks` processes; -> (the run folder, the
    config file)."""
    tree = {"data": {"root": str(tmp_path / "data"), "generate_if_missing": True, "tasks": [task]},
            "finetune": {"from": str(source)},
            "logging": {"run_dir": str(tmp_path / "runs"), "run_name": name, "progress": False, "plots": False,
                        "wandb": {"mode": "disabled"}}}
    for key, value in sections.items():
        tree[key] = {**tree.get(key, {}), **value}
    cfg_path = tmp_path / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(tree))
    done = run_pipeline(cfg_path, timeout=230, ranks=ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "runs" / name, cfg_path


@pytest.fixture(scope="module")
def fields_run(tmp_path_factory):
    """The run of `fields_tree` (codec, cache, operator, evaluation): (its root, its config file)."""
    return train_fields_run(tmp_path_factory.mktemp("fields"))


def train_fields_run(root):
    """Train `fields_tree` under `root`; -> (root, its config file)."""
    cfg_path = root / "fields.yaml"
    cfg_path.write_text(yaml.safe_dump(fields_tree(root)))
    done = run_pipeline(cfg_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return root, cfg_path


@pytest.mark.timeout(180)
def test_one_run_trains_1d_and_2d_tasks_of_1_2_and_3_fields_and_other_lengths_in_one_codec_and_operator(fields_run):
    tmp_path, cfg_path = fields_run
    tasks = orjson.loads((tmp_path / "runs" / "fields" / "eval.json").read_bytes())["tasks"]
    assert {name: t["channels"] for name, t in tasks.items()} == {
        "advection1d": ["u"], "dr2d": ["activator", "inhibitor"], "swe2d": ["height", "velocity_x", "velocity_y"]}
    for task in tasks.values():
        for scored in (task["codec"], task["variants"]["operator"]):
            assert set(scored["per_field"]) == set(task["channels"])
            assert np.isfinite([f["nrmse"] for f in scored["per_field"].values()]).all(), scored["per_field"]

    cfg = load_config(cfg_path)
    cache = open_cache(cache_plan(cfg, "dynamic", "train"))  # z [N, T, L, D]: every task, one latent shape
    assert cache["z"].shape[1:] == (8, 16, 8) and torch.isfinite(cache["z"]).all()
    # the 6-frame tasks are padded to 8 frames; each trajectory keeps its own length
    assert sorted(set(cache["steps"].tolist())) == [6, 8]
    assert torch.equal(cache["steps"] == 8, cache["task_id"] == 2)
    weights = torch.load(tmp_path / "runs" / "fields" / "autoencoder.pt", weights_only=True)
    model = build_autoencoder(cfg)
    model.load_state_dict(weights)
    assert model.fields == ["u", "activator", "inhibitor", "height", "velocity_x", "velocity_y"]
    assert {"encoder.embed.f_u", "encoder.embed.f_activator", "decoder.embed.f_inhibitor"} <= set(weights)

    # The trained run rolls each task out with that task's own fields (entry.inference binds them).
    surrogate = load_run(tmp_path / "runs" / "fields")
    for name, shape in (("advection1d", (1, 32)), ("dr2d", (2, 16, 16)), ("swe2d", (3, 16, 16))):
        frames = torch.randn(2, 1, *shape, generator=torch.Generator().manual_seed(0))
        out = surrogate.rollout(frames, steps=2, task=name)
        assert out.shape == (2, 3, *shape) and torch.isfinite(out).all()


def test_other_codecs_still_refuse_tasks_of_other_channel_counts_and_name_the_fix(tmp_path):
    tree = fields_tree(tmp_path)
    tree["latent"] = {"codec": "grid", "tokens": 16, "dim": 8, "hidden": 16}
    with pytest.raises(ConfigError, match="different channel counts .*set latent.codec: fields"):
        load_config(tree=tree)
    tree["latent"] = {"codec": "fields", "tokens": 16, "dim": 8, "hidden": 0}
    with pytest.raises(ConfigError, match="codec fields is learned"):
        load_config(tree=tree)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_the_field_codec_on_tasks_of_other_fields(tmp_path, parallel):
    """A step's batch uses one task's fields: DDP must not stop at the other task's unused
    embeddings (`partial_graph`), and FSDP2 shards the codec as any model; the two ranks cache
    tasks of other lengths into one latent and the operator trains on every task's pairs."""
    tree = fields_tree(tmp_path)
    tree["stages"], tree["training"]["parallel"] = ["autoencoder", "cache", "operator"], parallel
    cfg_path = tmp_path / "fields.yaml"
    cfg_path.write_text(yaml.safe_dump(tree))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "entry.pipeline", "--config", str(cfg_path)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=190)
    assert done.returncode == 0, done.stderr[-3000:]
    for stage in ("autoencoder", "operator"):
        weights = torch.load(tmp_path / "runs" / "fields" / f"{stage}.pt", weights_only=True)
        assert all(torch.isfinite(w).all() for w in weights.values()), stage


@pytest.mark.timeout(240)
def test_three_keys_fine_tune_the_run_on_new_fields_at_another_resolution(fields_run, tmp_path):
    """ns2d at 32 x 32 (the source saw 16 x 16 frames): vorticity is a field the source's codec never
    read, velocity_x and velocity_y are swe2d's. The codec grows one field; the normalisation of all
    three is fitted on the new data (a velocity of another flow has another scale), unless a source
    task the config keeps has the field; at step 0 the codec encodes and decodes the source's tasks
    bitwise as the source."""
    root, _ = fields_run
    source = root / "runs" / "fields"
    run, cfg_path = fine_tune(source, tmp_path, {"name": "ns2d", "param": 0.001, "samples": 12, "nx": 32,
                                                 "resolution": 32, "nt": 6}, "ft")
    tree = yaml.safe_load(cfg_path.read_text())
    log = (run / "rank0.log").read_text()
    assert "new fields (new codec embeddings, lr x 1): vorticity (finetune.new_lr_scale=10" in log

    task = orjson.loads((run / "eval.json").read_bytes())["tasks"]["ns2d"]
    assert task["channels"] == ["vorticity", "velocity_x", "velocity_y"]
    assert np.isfinite([f["nrmse"] for f in task["variants"]["operator"]["per_field"].values()]).all()

    theirs = torch.load(source / "autoencoder.pt", weights_only=True)
    mine = torch.load(run / "autoencoder.pt", weights_only=True)
    ns2d, swe2d = dataset_buffer_key("ns2d@0.001"), dataset_buffer_key("swe2d@1.0")
    assert set(mine) - set(theirs) == {f"{half}.{key}" for half in ("encoder", "decoder")
                                       for key in ("embed.f_vorticity", f"scales.{ns2d}")}
    cfg = load_config(cfg_path)
    rows, _ = task_split(cfg, 0, "train")
    with h5py.File(tmp_path / "data" / "ns_incom_inhom_2d_nu0.001.h5") as f:  # ns2d's training split, read anew
        values = [f["vorticity"][sorted(rows)], f["velocity"][sorted(rows)][..., 0]]
    for half in ("encoder", "decoder"):
        for (mean, scale), v in zip(mine[f"{half}.scales.{ns2d}"].tolist(), values):  # fitted on the new data
            assert mean == pytest.approx(v.mean(dtype=np.float64), abs=1e-6 * float(v.std(dtype=np.float64)))
            assert scale == pytest.approx(v.std(dtype=np.float64), rel=1e-4)
        # the shallow-water velocity keeps its own (the source's) normalisation
        assert torch.equal(mine[f"{half}.scales.{swe2d}"], theirs[f"{half}.scales.{swe2d}"])
        assert mine[f"{half}.scales.{ns2d}"][1, 1] != mine[f"{half}.scales.{swe2d}"][1, 1]
    assert new_datasets(cfg) == ["ns2d@0.001"]
    kept = load_config(tree={**tree, "data": {**tree["data"], "tasks": [
        *tree["data"]["tasks"], {"name": "swe2d", "param": 1.0, "samples": 12, "nx": 16, "resolution": 32, "nt": 8}]}})
    assert new_datasets(kept) == ["ns2d@0.001"]  # swe2d, a source task, keeps its normalisation

    # Step 0: the source's codec grown by one field; the source's tasks read none of it.
    start = from_source(lambda: build_autoencoder(cfg), cfg, "autoencoder")()
    assert start.fields == ["u", "activator", "inhibitor", "height", "velocity_x", "velocity_y", "vorticity"]
    src = build_autoencoder(load_config(root / "fields.yaml"))
    src.load_state_dict(theirs)
    frames = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        z = src.encode(frames, "swe2d@1.0")
        assert torch.equal(start.encode(frames, "swe2d@1.0"), z)
        assert torch.equal(start.decode(z, "swe2d@1.0", (16, 16)), src.decode(z, "swe2d@1.0", (16, 16)))


def test_a_source_whose_codec_normalises_by_field_name_is_refused_with_one_line(fields_run, tmp_path):
    """A run exported before the codec normalised per dataset (its description lists fields, not
    datasets) cannot start a fine-tuning: one line saying why, before anything is written."""
    import shutil

    root, _ = fields_run
    source = tmp_path / "old"
    shutil.copytree(root / "runs" / "fields", source, ignore=shutil.ignore_patterns("checkpoints"))
    description = source / "autoencoder.model.json"
    old = orjson.loads(description.read_bytes())
    old["args"]["fields"] = list(dict.fromkeys(n for _, names in old["args"].pop("datasets") for n in names))
    description.write_bytes(orjson.dumps(old))
    cfg = load_config(tree={"data": {"root": str(tmp_path / "data"), "tasks": [
        {"name": "ns2d", "param": 0.001, "samples": 12, "nx": 32, "resolution": 32, "nt": 6}]},
        "finetune": {"from": str(source)}, "logging": {"run_dir": str(tmp_path / "runs"), "run_name": "ft"}})
    with pytest.raises(ConfigError, match="normalises by field name.*train the source again"):
        check_source(cfg)
    assert not (tmp_path / "runs").exists()


def test_data_of_a_dimension_the_source_codec_lacks_are_refused_with_one_line(fields_run, tmp_path):
    """A source whose field codec serves 2D fields alone (its description's per-dimension tables
    without 1D), fine-tuned on a 1D task: one line naming both sides' dimensions, nothing written."""
    import shutil

    root, _ = fields_run
    source = tmp_path / "flat"
    shutil.copytree(root / "runs" / "fields", source, ignore=shutil.ignore_patterns("checkpoints"))
    description = source / "autoencoder.model.json"
    flat = orjson.loads(description.read_bytes())
    for table in ("tokens", "modes"):
        del flat["args"][table]["1"]
    description.write_bytes(orjson.dumps(flat))
    cfg = load_config(tree={"data": {"root": str(tmp_path / "data"), "tasks": [
        {"name": "advection1d", "param": 0.4, "samples": 12, "nx": 32, "nt": 6}]},
        "finetune": {"from": str(source)}, "logging": {"run_dir": str(tmp_path / "runs"), "run_name": "ft"}})
    with pytest.raises(ConfigError, match=r"incompatible model: the source's codec serves \[2\]D fields, the new "
                                          r"data have \[1\]D ones; fine-tune on fields of the source's dimensions"):
        check_source(cfg)
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("parallel", ["none", "ddp", "fsdp"])
def test_a_frozen_codec_meeting_new_fields_trains_their_embeddings_alone(fields_run, tmp_path, parallel):
    """The codec frozen (`finetune.freeze: [autoencoder]`) and a task of a field the source never read
    (ns2d's vorticity): the codec trains the new field's embeddings alone; every weight the source
    trained is published bit for bit, so its tasks encode as before and the new field is read into
    the latent the source's operator knows. Two ranks under DDP (the frozen weights left out of its
    reduction) and FSDP2 (frozen and trained parameters in one shard unit) alike."""
    root, _ = fields_run
    source = root / "runs" / "fields"
    run, cfg_path = fine_tune(source, tmp_path, {"name": "ns2d", "param": 0.001, "samples": 12, "nx": 16,
                                                 "resolution": 32, "nt": 6}, "grown",
                              ranks=1 if parallel == "none" else 2, training={"parallel": parallel},
                              operator={"steps": 2}, finetune={"freeze": ["autoencoder"], "new_lr_scale": 10})
    assert "frozen, copied from it: autoencoder (but the new fields' embeddings, trained alone)" in (
        run / "rank0.log").read_text()
    theirs = torch.load(source / "autoencoder.pt", weights_only=True)
    mine = torch.load(run / "autoencoder.pt", weights_only=True)
    assert all(torch.equal(mine[k], v) for k, v in theirs.items())
    cfg = load_config(cfg_path)
    start = from_source(lambda: build_autoencoder(cfg), cfg, "autoencoder")().state_dict()
    grown = [f"{half}.embed.f_vorticity" for half in ("encoder", "decoder")]
    assert {k for k in mine if k not in theirs and "scales" not in k} == set(grown)
    assert all(not torch.equal(mine[k], start[k]) for k in grown)  # trained: moved from the source's mean
    task = orjson.loads((run / "eval.json").read_bytes())["tasks"]["ns2d"]
    assert np.isfinite([f["nrmse"] for f in task["codec"]["per_field"].values()]).all()


@pytest.mark.timeout(240)
def test_a_frozen_codec_meeting_a_new_dataset_of_known_fields_gets_its_normalisation_fitted(fields_run, tmp_path):
    """Diffusion-reaction at another k (a dataset the source never read, of fields it knows), the codec
    frozen: the published codec is the source's, bit for bit, plus the new dataset's normalisation
    fitted on its training split (nothing trained), and the run trains and scores on it."""
    root, _ = fields_run
    source = root / "runs" / "fields"
    run, cfg_path = fine_tune(source, tmp_path, {"name": "dr2d", "param": 0.02, "samples": 12, "nx": 16,
                                                 "resolution": 32, "nt": 6}, "frozen",
                              operator={"steps": 2}, finetune={"freeze": ["autoencoder"]})
    theirs = torch.load(source / "autoencoder.pt", weights_only=True)
    mine = torch.load(run / "autoencoder.pt", weights_only=True)
    new = dataset_buffer_key("dr2d@0.02")
    assert set(mine) - set(theirs) == {f"encoder.scales.{new}", f"decoder.scales.{new}"}
    assert all(torch.equal(mine[k], v) for k, v in theirs.items())
    rows, _ = task_split(load_config(cfg_path), 0, "train")
    with h5py.File(tmp_path / "data" / "2D_diff-react_k0.02_NA.h5") as f:  # PDEBench's groups: data [T, X, Y, C]
        data = np.stack([f[f"{row:04d}"]["data"][...] for row in sorted(rows)])
    for half in ("encoder", "decoder"):  # fitted on the training split: its mean and RMS about it per field
        for c, (mean, scale) in enumerate(mine[f"{half}.scales.{new}"].tolist()):
            v = data[..., c]
            assert mean == pytest.approx(v.mean(dtype=np.float64), abs=1e-6 * float(v.std(dtype=np.float64)))
            assert scale == pytest.approx(v.std(dtype=np.float64), rel=1e-4)
    assert yaml.safe_load((run / "autoencoder.done.json").read_text())["frozen"]
    task = orjson.loads((run / "eval.json").read_bytes())["tasks"]["dr2d"]
    assert np.isfinite([f["nrmse"] for f in task["codec"]["per_field"].values()]).all()
