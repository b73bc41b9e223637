"""`latent.codec: conv` through the stack (issue 30, step 1): the pipeline fits, trains and caches
the convolutional codec, the operator steps its compressed latent, the evaluation scores every
field; its config mistakes exit 2 with one line; a config without the new keys keeps its hash.

Legend: N trajectories, T stored steps, L tokens, D latent channels, C channels.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import orjson
import pytest
import torch
import yaml

from entry.config.identity import math_hash
from entry.config.load import config_hash, load_config
from entry.data.cache_plan import cache_plan, open_cache
from entry.models.build import build_autoencoder, build_operator, field_channels, latent_tokens, training_grid
from entry.models.codec_fit import fit_codec
from tests.tiny_run import ROOT, env

pytestmark = pytest.mark.slow


def conv_tree(root) -> dict:
    """Diffusion-reaction (2 channels) on 16 x 16; patch 4, 2 latent channels: 2 * 4^2 / 2 = 16x
    fewer numbers, a 4 x 4 latent grid (L = 16, Morton order for the pdet_unet operator)."""
    return {
        "data": {"root": str(root / "data"), "generate_if_missing": True,
                 "tasks": [{"name": "dr2d", "param": 0.005, "samples": 16, "nx": 16, "resolution": 32, "nt": 6}]},
        "latent": {"codec": "conv", "patch": 4, "dim": 2, "hidden": 8},
        "autoencoder": {"steps": 2, "batch_size": 8},
        "operator": {"steps": 5, "batch_size": 8,
                     "pdet": {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2, "group_size": 4}},
        "training": {"num_workers": 0, "cache_dir": str(root / "cache"), "parallel": "none", "compile": False},
        "evaluation": {"time_rollout": False},
        "logging": {"run_dir": str(root / "runs"), "run_name": "conv", "progress": False, "plots": False,
                    "wandb": {"mode": "disabled"}},
        "stages": ["autoencoder", "cache", "operator", "evaluate"],
    }


@pytest.mark.timeout(120)
def test_the_pipeline_steps_a_16x_conv_latent_and_scores_every_field(tmp_path):
    cfg_path = tmp_path / "conv.yaml"
    cfg_path.write_text(yaml.safe_dump(conv_tree(tmp_path)))
    done = subprocess.run([sys.executable, "-m", "entry.pipeline", "--config", str(cfg_path)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (tmp_path / "runs" / "conv" / "rank0.log").read_text()
    assert "autoencoder: linear path fitted (energy captured per spatial dimension: 2D " in log

    (task,) = orjson.loads((tmp_path / "runs" / "conv" / "eval.json").read_bytes())["tasks"].values()
    assert task["channels"] == ["activator", "inhibitor"]
    for scored in (task["codec"], task["variants"]["operator"]):
        assert set(scored["per_field"]) == set(task["channels"])
        assert np.isfinite([f["nrmse"] for f in scored["per_field"].values()]).all(), scored["per_field"]

    cfg = load_config(cfg_path)
    plan = cache_plan(cfg, "dynamic", "train")
    z = open_cache(plan)["z"]  # [N, T, L, D]
    frame = field_channels(cfg) * math.prod(training_grid(cfg.data.tasks[0]))
    assert z.shape[1:] == (6, latent_tokens(cfg, 2), 2) == (6, 16, 2)
    assert z[0, 0].numel() * 16 == frame and torch.isfinite(z).all()
    # On disk: the cache's latent file (a raw memmap, no header) is 16x smaller than the training
    # trajectories' fields in float32; the other files are per-trajectory ids and the manifest.
    field_bytes = plan.trajectories * 6 * frame * 4
    assert (plan.folder / "z.memmap").stat().st_size * 16 == field_bytes
    rest = sum(f.stat().st_size for f in plan.folder.iterdir() if f.name != "z.memmap")
    assert rest < 4096 + 24 * plan.trajectories, sorted(f.name for f in plan.folder.iterdir())


def test_fit_codec_fits_the_conv_codec_a_config_builds(tmp_path):
    """Rate 1 (dim = C * patch^2): the fitted linear path is exact, whatever the fields."""
    tree = conv_tree(tmp_path)
    tree["latent"] = {"codec": "conv", "patch": 2, "dim": 8, "hidden": 0}
    cfg = load_config(tree=tree)
    model = build_autoencoder(cfg)
    assert latent_tokens(cfg, 2) == 64
    u = torch.randn(12, 2, 16, 16, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 100.0])[:, None, None]
    assert fit_codec(model, [u[:6], u[6:]]) == "energy captured per spatial dimension: 2D 1.000000"
    z, u_hat = model(u)
    assert z.shape == (12, 64, 8)
    torch.testing.assert_close(u_hat, u, rtol=0, atol=1e-3)
    with pytest.raises(ValueError, match="codec built by core.models.registry"):
        fit_codec(torch.nn.Linear(2, 2), [u])


def test_fit_codec_of_a_field_codec_names_each_dataset_s_tables_and_refits_only_those_asked():
    """The field codec has no linear path: its whole fit says so and lists every dataset's mean/scale;
    a fine-tuned codec's fit of its new datasets (`only`) lists theirs alone and leaves the others'."""
    from core.models.registry import build
    from tensordict import TensorDict

    model = build("codec", "fields", datasets=[["a", ["u"]], ["b", ["u"]]], dim=8, tokens={"1": 8},
                  modes={"1": 2}, hidden=8, depth=1, heads=2, tasks=["a", "b"])
    g = torch.Generator().manual_seed(0)
    batches = [TensorDict({"u": 3.0 + torch.randn(4, 1, 16, generator=g), "task_id": torch.full((4,), i)},
                          batch_size=[4]) for i in (0, 1)]
    whole = fit_codec(model, batches)
    assert whole.startswith("none: codec fields learns its whole map; fields normalised per dataset")
    assert "a: u " in whole and "b: u " in whole
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches[1]["u"] = 10 * batches[1]["u"]
    refit = fit_codec(model, batches, only=["b"])
    assert refit.startswith("fields normalised per dataset (mean/scale): b: u ") and "a: u" not in refit
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.endswith(".d_b") for k in changed), changed


@pytest.mark.parametrize("sets, names", [
    (["latent.patch=3"], ["latent.patch (3)", "(16, 16)", "[2, 4, 8, 16]"]),
    (["latent.codec=wavelet"], ["latent.codec", "'grid', 'conv'"]),
    (["latent.patch=0"], ["latent.patch", "codec conv needs"]),
    (["latent.tokens=16"], ["latent.tokens", "codec grid only", "latent.tokens=0"]),
    (["latent.codec=grid"], ["latent.tokens", "codec grid needs"]),
    (["latent.linear=global", "latent.dim=40"], ["latent.linear", "512 numbers", "latent.linear=local"]),
    (["data.tasks.0.nx=24", "data.tasks.0.resolution=48"], ["latent.patch", "pdet_unet", "(6, 6)",
                                                              "operator.arch=transformer"]),
])
def test_conv_codec_mistakes_exit_2_with_one_line(tmp_path, capfd, sets, names):
    from entry.pipeline import main

    cfg_path = tmp_path / "conv.yaml"
    cfg_path.write_text(yaml.safe_dump(conv_tree(tmp_path)))
    args = ["--config", str(cfg_path)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("config error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for name in names:
        assert name in lines[0], lines[0]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()


def test_a_non_square_latent_grid_steps_with_the_transformer_operator(tmp_path):
    tree = conv_tree(tmp_path)
    tree["data"]["tasks"][0].update(nx=24, resolution=48)
    tree["operator"]["arch"] = "transformer"
    cfg = load_config(tree=tree)
    assert latent_tokens(cfg, 2) == 36  # 6 x 6 cells, row-major
    z = build_autoencoder(cfg).encode(torch.randn(3, 2, 24, 24))
    assert z.shape == (3, 36, 2)
    assert build_operator(cfg)(z, torch.full((3,), 0.1), torch.zeros(3, dtype=torch.long)).shape == z.shape


def test_a_config_without_the_codec_keys_keeps_its_hash():
    """Hashes computed before `latent.codec` existed (commit 9f6d896): a key added to the config
    changes every recorded run's hash (its folder, done files and caches) unless it is listed in
    `entry.config.load.HASHED_WHEN_SET`."""
    tree = {"data": {"root": "/data", "tasks": [{"name": "advection1d", "param": 0.1, "nx": 64, "nt": 11}]},
            "latent": {"tokens": 8, "dim": 8}}
    cfg = load_config(tree=tree)
    assert (config_hash(cfg), math_hash(cfg, ("data", "latent", "autoencoder"))) == (
        "af219b9b2f41af1c", "5c89594348675256")
    explicit = load_config(tree=tree, overrides=["latent.codec=grid", "latent.blocks=1"])
    assert config_hash(explicit) == config_hash(cfg)
    conv = load_config(tree={**tree, "latent": {"codec": "conv", "patch": 4, "dim": 8}})
    assert config_hash(conv) != config_hash(cfg)
    assert config_hash(load_config(tree={**tree, "latent": {"codec": "conv", "patch": 8, "dim": 8}})) != \
        config_hash(conv)


def test_the_codec_benchmark_measures_a_conv_codec_config_against_pca(tmp_path):
    """The reduced 2D configs step the conv codec: `bench.codec` on such a config (README's command)
    gives PCA and the conv codec at every rate; the grid codec's rows are skipped with the reason,
    for a one-channel task too (their layout comes from a grid-codec config)."""
    from bench import codec

    out = tmp_path / "out"
    for name, channels in (("conv", 2), ("conv1", 1)):
        tree = conv_tree(tmp_path)
        if channels == 1:
            tree["data"]["tasks"] = [{"name": "burgers1d", "param": 0.01, "samples": 24, "nx": 32, "nt": 6}]
        tree["logging"]["run_name"] = name
        cfg_path = tmp_path / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(tree))
        assert codec.main(["--config", str(cfg_path), "--ratios", "1,4", "--out", str(out)]) == 0
        [path] = out.glob(f"*-codec-{name}.json")
        (task,) = orjson.loads(path.read_bytes())["tasks"].values()
        for r, row in task["ratios"].items():
            assert row["conv"]["nrmse_fields"] <= (1e-5 if r == "1" else 1.0) and "nrmse_fields" in row["pca"], r
            why = row["ours"]["skipped"]
            assert ("latent.codec: conv" in why) if channels == 1 else ("this task has 2" in why), why
