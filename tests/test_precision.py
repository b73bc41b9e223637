"""The precision contract's pieces and the `auto` recipe (entry/distributed/precision.py), on one process.

The layouts themselves (autocast, DDP, FSDP2, compiled) are tests/test_recipe_matrix.py.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from entry.config.load import ConfigError, config_hash, load_config
from entry.config.recipe import AUTO, resolve_config, resolve_training
from entry.distributed.precision import fsdp_policies
from tests import tiny_run as tr

QUICKSTART = tr.ROOT / "configs" / "quickstart.yaml"


def _tree() -> dict:
    return yaml.safe_load(QUICKSTART.read_text())


@pytest.mark.parametrize("precision", [AUTO, "fp32", "bf16"])
@pytest.mark.parametrize("compile_", [AUTO, True, False])
@pytest.mark.parametrize("cuda", [False, True])
def test_auto_resolves_per_device_and_explicit_values_stay(precision, compile_, cuda):
    t = load_config(tree=_tree(), overrides=[f"training.precision={precision}",
                                             f"training.compile={str(compile_).lower()}"]).training
    got = resolve_training(t, cuda=cuda)
    assert got.precision == (("bf16" if cuda else "fp32") if precision == AUTO else precision)
    assert got.compile is (cuda if compile_ == AUTO else compile_)
    assert resolve_training(got, cuda=not cuda) == got  # resolving twice changes nothing


def test_auto_on_cpu_is_todays_fp32_eager_config():
    """Same hash as the explicit fp32 eager config: run folders, done files and caches made before
    `auto` existed still match on CPU."""
    auto = resolve_config(load_config(tree=_tree()), cuda=False)
    explicit = load_config(tree=_tree(), overrides=["training.precision=fp32", "training.compile=false"])
    assert auto.training.precision == "fp32" and auto.training.compile is False
    assert config_hash(auto) == config_hash(explicit)


def test_commands_see_the_resolved_recipe(monkeypatch):
    from entry.config.cli import parse_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg, _ = parse_config(["--config", str(QUICKSTART)], "test")
    assert (cfg.training.precision, cfg.training.compile) == ("bf16", True)
    raw, _ = parse_config(["--config", str(QUICKSTART)], "test", resolve=False)
    assert (raw.training.precision, raw.training.compile) == (AUTO, AUTO)


def test_wrong_compile_value_names_every_allowed_value():
    with pytest.raises(ConfigError, match=r"training.compile must be true or false or 'auto', got 3"):
        load_config(tree=_tree(), overrides=["training.compile=3"])


def test_check_config_prints_the_recipe_here_and_on_the_other_device(capsys, tmp_path):
    from entry.check_config import main

    config = tmp_path / "burgers.yaml"
    tree = yaml.safe_load((tr.ROOT / "configs" / "burgers.yaml").read_text())
    tree["data"]["root"] = str(tmp_path / "data")
    config.write_text(yaml.safe_dump(tree))
    assert main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    cpu, cuda = "precision fp32, compile off", "precision bf16, compile on"
    if torch.cuda.is_available():
        assert f"recipe on this machine (CUDA): {cuda}" in out and f"recipe on CPU: {cpu}" in out
    else:
        assert f"recipe on this machine (CPU): {cpu}" in out and f"recipe on CUDA: {cuda}" in out
    assert "training.precision: auto, training.compile: auto" in out


@pytest.mark.parametrize("capability, fixes", [((9, 0), []), ((8, 0), []), ((7, 5), ["training.precision=fp32"]),
                                                ((7, 0), ["training.precision=fp32"]),
                                                ((6, 0), ["training.precision=fp32", "training.compile=false"])])
def test_a_gpu_the_recipe_does_not_suit_is_named_with_the_keys_that_fix_it(capability, fixes, capsys):
    """`auto` resolves by CUDA alone: a V100 or T4 gets bf16, which it emulates (native from compute
    capability 8.0), a P100 also torch.compile, which Triton refuses (7.0). The stage's log warns and
    the doctor fails its recipe line, each naming the key; the fixed recipe suits every GPU."""
    from entry.config.recipe import recipe_problems
    from entry.doctor import _recipe_line

    auto = resolve_training(load_config(tree=_tree()).training, cuda=True)
    problems = recipe_problems(auto, capability)
    assert len(problems) == len(fixes) and all(fix in p for fix, p in zip(fixes, problems)), problems
    assert all(f"compute capability is {capability[0]}.{capability[1]}" in p for p in problems)
    fixed = load_config(tree=_tree(), overrides=["training.precision=fp32", "training.compile=false"]).training
    assert recipe_problems(resolve_training(fixed, cuda=True), capability) == []
    assert _recipe_line(None, capability) is (not fixes)  # the doctor without a config: the default recipe
    line = capsys.readouterr().out.strip()
    assert line.startswith("[pass] recipe: " if not fixes else "[FAIL] recipe: ") and all(f in line for f in fixes)


def test_fsdp_policies_keep_the_root_in_fp32():
    block, root = fsdp_policies("bf16")
    assert (block.param_dtype, block.reduce_dtype, block.cast_forward_inputs) == (torch.bfloat16, torch.float32, True)
    assert (root.param_dtype, root.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert root.cast_forward_inputs is False and root.output_dtype == torch.float32
    for policy in fsdp_policies("fp32"):
        assert policy.param_dtype is None and policy.reduce_dtype is None and policy.output_dtype is None
    with pytest.raises(AssertionError, match="unresolved"):
        fsdp_policies(AUTO)


def _pdet(**kwargs):
    from core.models.pdet import PDETUNet

    torch.manual_seed(0)
    return PDETUNet(8, hidden_dim=16, depths=(1, 1), num_heads=2, group_size=2, num_tasks=2, **kwargs)


def _inputs(batch: int = 3):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, 8, 8, generator=g), torch.rand(batch, generator=g),
            torch.randint(0, 2, (batch,), generator=g))


def test_bf16_weights_keep_the_latent_state_fp32():
    """What FSDP2's bf16 root sees (bf16 weights, the fp32 latent uncast): the skip stays fp32, so a
    fresh operator is exactly the identity, and a trained one adds a bf16 delta to the fp32 state."""
    z, dt, task = _inputs()
    fresh = _pdet().to(torch.bfloat16)
    out = fresh(z, dt, task)
    assert out.dtype == torch.float32 and torch.equal(out, z)
    with torch.no_grad():
        for p in fresh.parameters():
            p.normal_(0, 0.05)
    out = fresh(z, dt, task)
    assert out.dtype == torch.float32 and not torch.equal(out, z)


def test_autocast_keeps_the_latent_state_fp32():
    z, dt, task = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _pdet()(z, dt, task)
    assert out.dtype == torch.float32 and torch.equal(out, z)


def test_denoiser_skip_is_fp32_with_bf16_weights():
    from core.models.denoiser import Denoiser

    z, dt, task = _inputs()
    den = Denoiser(8, hidden_dim=16, depths=(1,), num_heads=2, group_size=2, num_tasks=2, sigma_data=0.5)
    den = den.to(torch.bfloat16)
    out = den(z, z, torch.full((3,), 0.1), dt, task)
    assert out.dtype == torch.float32


def test_compile_blocks_wraps_each_block_and_keeps_checkpoint_keys():
    """Each shard unit becomes a compiled wrapper in its own slot; the state dicts the checkpoints
    and exported weights use (torch.distributed.checkpoint) keep the plain model's keys."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from entry.distributed.sharding import compile_blocks, shard_units

    plain = _pdet()
    compiled = compile_blocks(_pdet())
    units = shard_units(compiled)
    assert len(units) == len(shard_units(plain)) == 3
    assert all(isinstance(u, OptimizedModule) and not isinstance(u._orig_mod, OptimizedModule) for u in units)
    assert sum(isinstance(m, OptimizedModule) for m in compiled.modules()) == 3  # nothing wrapped twice
    keys = get_model_state_dict(compiled).keys()
    assert sorted(keys) == sorted(plain.state_dict().keys())
    fresh = _pdet()
    fresh.load_state_dict(get_model_state_dict(compiled))
