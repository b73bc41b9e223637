"""Model registry (core.models.registry): every registered model round-trips through its description;
`operator.arch` picks the operator; exported weights with their `.model.json` rebuild the trained model
whatever the config says later (entry.evaluate reads the description, falling back to the config)."""

from __future__ import annotations

import orjson
import pytest
import torch
import yaml

from core.models.registry import FORMAT, KINDS, build, describe, names, rebuild, register
from entry.config.load import ConfigError, load_config
from entry.models.build import build_operator
from tests import tiny_run as tr

PDET = dict(dim=8, hidden_dim=16, depths=[1, 1], num_heads=2, group_size=2, num_tasks=2)

# One small example per registered model: a model registered without one fails the round trip below.
EXAMPLES = {
    ("operator", "pdet_unet"): PDET,
    ("operator", "transformer"): dict(dim=8, tokens=8, hidden_dim=16, depth=2, num_heads=2, num_tasks=2),
    ("codec", "grid"): dict(channels=1, dim=8, tokens={"1": 8, "2": 16}, modes={"1": 2, "2": 2}, hidden=8),
    ("codec", "conv"): dict(channels=2, ndim=2, patch=4, latent_channels=4, hidden=8),
    ("codec", "fields"): dict(datasets=[["line", ["u"]], ["flow", ["u", "Vx"]]], dim=8, tokens={"1": 4, "2": 4},
                              modes={"1": 2, "2": 2}, hidden=8, depth=1, heads=2),
    ("denoiser", "pdet_unet"): dict(PDET, sigma_data=0.5),
    ("peer", "fno1d"): dict(in_steps=2, modes=4, width=8, layers=2),
    ("peer", "fno2d"): dict(in_steps=2, modes=3, width=8, layers=2),
    ("peer", "unet1d"): dict(in_channels=2, out_channels=1, init_features=4),
    ("peer", "unet2d"): dict(in_channels=2, out_channels=1, init_features=4),
    ("peer", "plain_transformer"): dict(in_channels=2, out_channels=1, grid=[16, 16], patch=4, width=16, depth=1,
                                        heads=2),
}


def _registered() -> set[tuple[str, str]]:
    return {(kind, name) for kind in KINDS for name in names(kind)}


def test_every_registered_model_has_an_example():
    assert set(EXAMPLES) == _registered()


@pytest.mark.parametrize("kind,name", sorted(EXAMPLES))
def test_description_round_trips(kind, name):
    torch.manual_seed(0)
    model = build(kind, name, **EXAMPLES[kind, name])
    description = describe(model)
    assert description == {"format": FORMAT, "kind": kind, "arch": name,
                           "args": orjson.loads(orjson.dumps(EXAMPLES[kind, name]))}
    # Through JSON text, as the file beside the weights holds it; and as runs exported before the
    # description had a format wrote it (format 1: no `format` key), which rebuilds the same model.
    for text in (orjson.dumps(description), orjson.dumps({k: v for k, v in description.items() if k != "format"})):
        again = rebuild(orjson.loads(text))
        assert describe(again) == description and type(again) is type(model)
        again.load_state_dict(model.state_dict())  # strict: the same parameters and buffers, shape for shape


def test_the_registry_refuses_what_it_cannot_rebuild():
    with pytest.raises(ValueError, match=r"unknown operator arch 'nope'; registered: \['pdet_unet', 'transformer'\]"):
        build("operator", "nope")
    with pytest.raises(ValueError, match="plain JSON"):
        build("operator", "pdet_unet", **dict(PDET, hidden_dim=torch.tensor(16)))
    with pytest.raises(ValueError, match="unknown model kind"):
        register("optimizer", "adam")
    with pytest.raises(ValueError, match="registered twice"):
        register("operator", "pdet_unet")(lambda: None)
    with pytest.raises(ValueError, match="keys"):
        rebuild({"kind": "operator", "arch": "pdet_unet"})
    with pytest.raises(ValueError, match="format 3; this code reads formats 1 and 2"):
        rebuild({"format": 3, "kind": "operator", "arch": "pdet_unet", "args": PDET})
    assert describe(torch.nn.Linear(2, 2)) is None


def test_operator_arch_is_chosen_by_config_and_validated(tmp_path):
    from core.models.pdet import PDETUNet
    from core.models.transformer import TransformerOperator
    from entry.models.build import build_operator

    tree = tr.tiny_tree(tmp_path)
    assert isinstance(build_operator(load_config(tree=tree)), PDETUNet)
    tree["operator"]["arch"] = "transformer"
    tree["operator"]["transformer"] = {"hidden_dim": 16, "depth": 1, "num_heads": 2}
    op = build_operator(load_config(tree=tree))
    assert isinstance(op, TransformerOperator) and describe(op)["args"]["tokens"] == 8
    tree["operator"]["arch"] = "fno"
    with pytest.raises(ConfigError) as e:
        load_config(tree=tree)
    assert str(e.value) == "operator.arch must be one of 'pdet_unet', 'transformer', got 'fno'"
    tree["operator"]["arch"] = "transformer"
    tree["operator"]["transformer"] = {"hidden_dim": 16, "num_heads": 3}
    with pytest.raises(ConfigError, match="operator.transformer.hidden_dim .16. must be divisible by num_heads"):
        load_config(tree=tree)
    tree["operator"]["transformer"] = {"width": 16}
    with pytest.raises(ConfigError, match="unknown key 'operator.transformer.width'"):
        load_config(tree=tree)


def test_a_fresh_transformer_operator_is_persistence():
    torch.manual_seed(0)
    op = build("operator", "transformer", **EXAMPLES["operator", "transformer"])
    z = torch.randn(3, 8, 8)
    out = op(z, torch.full((3,), 0.1), torch.tensor([0, 1, 0]))
    assert torch.equal(out, z)
    with pytest.raises(ValueError, match="at most 8"):
        op(torch.randn(1, 9, 8), torch.ones(1), torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("arch", ["pdet_unet", "transformer"])
def test_operator_identity_start_false_predicts_the_next_latent_itself(tmp_path, arch):
    """The ablation key: the default operator starts as persistence (z + 0); without the identity
    start the same zero output layer makes a fresh operator predict the zero latent."""
    tree = tr.tiny_tree(tmp_path)
    tree["operator"]["arch"] = arch
    tree["operator"]["transformer"] = {"hidden_dim": 16, "depth": 1, "num_heads": 2}
    z = torch.randn(2, 8, load_config(tree=tree).latent.dim)  # the tiny run's 8 tokens
    outputs = {}
    for identity_start in (True, False):
        tree["operator"]["identity_start"] = identity_start
        op = build_operator(load_config(tree=tree))
        outputs[identity_start] = op(z, torch.full((2,), 0.1), torch.zeros(2, dtype=torch.long))
    assert torch.equal(outputs[True], z)
    assert torch.equal(outputs[False], torch.zeros_like(z))


ARCH_SETTINGS = {
    "pdet_unet": ["operator.pdet.hidden_dim=8"],  # the tiny run trained hidden_dim 16
    "transformer": ["operator.arch=pdet_unet"],  # a pdet_unet cannot hold a transformer's weights
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A prepared tiny run and, per operator arch, a run folder whose operator trained 3 steps."""
    root = tmp_path_factory.mktemp("registry")
    tree = tr.tiny_tree(root)
    tree["operator"]["transformer"] = {"hidden_dim": 16, "depth": 1, "num_heads": 2}
    tree["evaluation"].update(plot_samples=0)
    tree["stages"] = ["autoencoder", "cache", "operator", "evaluate"]
    tr.prepare(root, tree)
    from entry.operator import main

    for arch in ARCH_SETTINGS:
        extra = ["--set", "evaluation.val_every=2", "--set", "evaluation.select=best"] if arch == "transformer" else []
        args = ["--config", str(root / "tiny.yaml"), *tr.new_run(root, arch), "--set", f"operator.arch={arch}",
                "--set", "operator.steps=3", *extra]
        assert main(args) == 0
    return root


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", sorted(ARCH_SETTINGS))
def test_exported_weights_rebuild_the_trained_operator(trained, arch):
    from entry.models.weights import load_weights
    from entry.models.files import description_file, maker_for
    from entry.models.build import build_operator

    weights = trained / "runs" / arch / "operator.pt"
    description = orjson.loads(description_file(weights).read_bytes())
    assert description["kind"] == "operator" and description["arch"] == arch
    best = weights.parent / "weights"  # select=best (transformer run): each kept file has its description
    assert sorted(p.stem for p in best.glob("*.pt")) == sorted(p.name.removesuffix(".model.json")
                                                           for p in best.glob("*.model.json"))
    assert sorted(torch.load(weights, weights_only=True)) == sorted(build_operator(_cfg(trained, arch)).state_dict())
    from_config = load_weights(build_operator(_cfg(trained, arch)), weights, made_by="test").eval()
    # The config changed so that its operator no longer fits: the description still rebuilds it.
    changed = _cfg(trained, arch, *ARCH_SETTINGS[arch])
    from_file = load_weights(maker_for(weights, lambda: build_operator(changed))(), weights, made_by="test").eval()
    g = torch.Generator().manual_seed(1)
    z, dt, tid = torch.randn(4, 8, 8, generator=g), torch.full((4,), 0.05), torch.zeros(4, dtype=torch.long)
    with torch.no_grad():
        assert torch.equal(from_config(z, dt, tid), from_file(z, dt, tid))
        assert not torch.equal(from_file(z, dt, tid), z)  # trained: not the fresh persistence operator


@pytest.mark.timeout(600)
def test_evaluate_rebuilds_from_the_description_and_falls_back_to_the_config(trained, capfd):
    from entry.evaluate import main
    from entry.models.files import description_file

    arch = "transformer"
    args = ["--config", str(trained / "tiny.yaml"), "--no-deps", "--set", f"logging.run_name={arch}",
            *[a for s in ARCH_SETTINGS[arch] for a in ("--set", s)]]
    assert main(args) == 0, capfd.readouterr().err
    scores = orjson.loads((trained / "runs" / arch / "eval.json").read_bytes())["tasks"]["advection1d"]
    assert "operator" in scores["variants"]
    # A run exported before descriptions had a format (format 1: no `format` key) evaluates the same.
    for desc in (trained / "runs" / arch).rglob("*.model.json"):
        old = {k: v for k, v in orjson.loads(desc.read_bytes()).items() if k != "format"}
        desc.write_bytes(orjson.dumps(old, option=orjson.OPT_INDENT_2))
    (trained / "runs" / arch / "eval.json").unlink()
    assert main(args) == 0, capfd.readouterr().err
    again = orjson.loads((trained / "runs" / arch / "eval.json").read_bytes())["tasks"]["advection1d"]
    assert again["variants"]["operator"]["nrmse"] == scores["variants"]["operator"]["nrmse"]  # the same model
    # Without its description the weights are built from the (changed) config, which they do not fit.
    description_file(trained / "runs" / arch / "operator.pt").unlink()
    assert main(args) == 2
    assert "does not fit this config's model" in capfd.readouterr().err


def _cfg(root, arch: str, *overrides: str):
    tree = yaml.safe_load((root / "tiny.yaml").read_text())
    return load_config(tree=tree, overrides=[f"operator.arch={arch}", f"logging.run_name={arch}", *overrides])
