"""A new operator is one module: a toy operator and its settings, registered by this test alone (and
removed after it), is chosen by `operator.arch: toy`, configured by `operator.toy: {...}` and
validated as strictly as the stack's own operators (a bad value exits 2 with one line naming
`operator.toy.<key>`), and the operator stage trains and exports it, its weights rebuilding from
their description; registering it changes no other config's hash. No other file of the repository
knows the toy."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import pytest
import torch
import yaml
from torch import Tensor, nn

from core.models.registry import register, rebuild, unregister
from core.models.settings import SETTINGS, positive
from entry.config.load import ConfigError, config_hash, load_config
from tests import tiny_run as tr


@dataclass(**SETTINGS)
class ToySettings:
    """The toy operator's settings."""

    width: int = 8
    """Hidden width."""
    gain: float = 1.0
    """Scale of the hidden activation."""

    def __post_init__(self):
        positive(self, "width", "gain")


class ToyOperator(nn.Module):
    """``z_next = z + out(tanh(gain * (in(z) + task + position + dt)))``, ``out`` starting at zero
    (a fresh toy is persistence, as the stack's operators are)."""

    def __init__(self, dim: int, num_tasks: int, residual: bool, tokens: int, width: int, gain: float) -> None:
        super().__init__()
        self.residual, self.gain = residual, gain
        self.inp, self.task = nn.Linear(dim, width), nn.Embedding(num_tasks, width)
        self.pos = nn.Parameter(torch.zeros(tokens, width))
        self.out = nn.Linear(width, dim)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, z_BLD: Tensor, dt_B: Tensor, task_id_B: Tensor) -> Tensor:
        h = self.inp(z_BLD) + self.task(task_id_B)[:, None] + self.pos[: z_BLD.shape[1]] + dt_B[:, None, None]
        delta = self.out(torch.tanh(self.gain * h))
        return z_BLD + delta if self.residual else delta


@pytest.fixture
def toy():
    """The toy registered as operator "toy" (taking the stack's token count) while a test uses it."""
    register("operator", "toy", settings=ToySettings, stack_args=("tokens",))(ToyOperator)
    yield
    unregister("operator", "toy")


def _toy_tree(root, **settings) -> dict:
    tree = tr.tiny_tree(root)
    tree["operator"] = {**tree["operator"], "arch": "toy", "toy": {"width": 12, **settings}}
    return tree


def test_a_registered_operator_is_configured_by_its_own_section(tmp_path, toy):
    from entry.models.build import build_operator

    cfg = load_config(tree=_toy_tree(tmp_path))
    assert cfg.operator.settings == ToySettings(width=12)
    op = build_operator(cfg)
    assert isinstance(op, ToyOperator) and op.pos.shape == (8, 12)  # the tiny run's 8 tokens
    z = torch.randn(2, 8, cfg.latent.dim)
    assert torch.equal(op(z, torch.full((2,), 0.1), torch.zeros(2, dtype=torch.long)), z)  # identity start


def test_the_toy_section_is_validated_strictly(tmp_path, toy):
    with pytest.raises(ConfigError) as e:
        load_config(tree=_toy_tree(tmp_path, width=0))
    assert str(e.value) == "operator.toy.width must be > 0, got 0"
    with pytest.raises(ConfigError, match=r"unknown key 'operator.toy.widht' \(did you mean 'operator.toy.width'"):
        load_config(tree=_toy_tree(tmp_path, widht=3))
    with pytest.raises(ConfigError, match="operator.toy.gain must be a number"):
        load_config(tree=_toy_tree(tmp_path, gain="big"))


def test_a_bad_toy_value_exits_2_with_one_line(tmp_path, toy, capfd):
    from entry.check_config import main

    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(_toy_tree(tmp_path)))
    assert main(["--config", str(path), "--set", "operator.toy.gain=-1"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "operator.toy.gain must be > 0, got -1" in err


def test_registering_a_model_changes_no_other_config_hash(tmp_path):
    tree = tr.tiny_tree(tmp_path)
    before = config_hash(load_config(tree=tree))
    register("operator", "toy", settings=ToySettings, stack_args=("tokens",))(ToyOperator)
    try:
        assert config_hash(load_config(tree=tree)) == before
        # The toy's section counts where it says something: set away from its defaults, or chosen.
        assert config_hash(load_config(tree=tree, overrides=["operator.toy.width=3"])) != before
    finally:
        unregister("operator", "toy")
    with pytest.raises(ConfigError, match="operator.arch must be one of 'pdet_unet', 'transformer', got 'toy'"):
        load_config(tree=_toy_tree(tmp_path))


@pytest.mark.timeout(600)
def test_the_operator_stage_trains_and_exports_the_toy(tmp_path, toy):
    from entry.models.files import description_file
    from entry.operator import main

    tree = _toy_tree(tmp_path)
    tree["stages"] = ["autoencoder", "cache", "operator"]
    tr.prepare(tmp_path, tree)
    args = ["--config", str(tmp_path / "tiny.yaml"), *tr.new_run(tmp_path, "toy"), "--set", "operator.steps=3"]
    assert main(args) == 0
    weights = tmp_path / "runs" / "toy" / "operator.pt"
    description = orjson.loads(description_file(weights).read_bytes())
    assert description["arch"] == "toy" and description["args"] == {
        "dim": 8, "num_tasks": 1, "residual": True, "tokens": 8, "width": 12, "gain": 1.0}
    model = rebuild(description)
    model.load_state_dict(torch.load(weights, weights_only=True))  # strict: the trained toy, rebuilt
    assert model.out.weight.abs().sum() > 0  # trained 3 steps away from its zero start
