"""operator.task_weighting: "step_size" weighs each task's loss by 1 / its mean square latent step,
measured over the training pairs; the step multiplies each sample's loss by its task's weight."""

import logging

import pytest
import torch

from entry.config.load import ConfigError, load_config
from entry.data.cache_plan import cache_plan, open_cache
from entry.distributed.process_group import DistInfo
from entry.stages.operator import build, step_size_weights
from entry.storage.run_folder import run_dir_for
from tests import tiny_run as tr

INFO = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)


@pytest.fixture(scope="module")
def two_tasks(tmp_path_factory):
    """tiny_run's config with Burgers beside advection, data, a seeded encoder and the cache."""
    root = tmp_path_factory.mktemp("weights")
    tree = tr.tiny_tree(root)
    tree["data"]["tasks"].append({"name": "burgers1d", "param": 0.01, "samples": 20, "nx": 32, "nt": 11})
    tree["operator"]["task_weighting"] = "step_size"
    return load_config(tr.prepare(root, tree))


def test_step_size_weights_are_the_inverse_mean_square_steps(two_tasks):
    cfg = two_tasks
    cache = open_cache(cache_plan(cfg, "dynamic", "train"))
    z, task = cache["z"].double(), cache["task_id"]
    squares = [(z[task == t, 1:] - z[task == t, :-1]).square().mean() for t in range(2)]
    weight = step_size_weights(cfg, INFO)
    expected = torch.stack([1 / s for s in squares])
    expected = expected / expected.mean()
    assert weight.shape == (2,) and torch.allclose(weight.double(), expected, rtol=1e-5)
    assert weight.mean().item() == pytest.approx(1.0, rel=1e-6)
    parts = build(cfg, INFO, run_dir_for(cfg), logging.getLogger("weights"))
    assert torch.equal(parts.frozen["task_weight"], weight)


def test_a_task_that_never_changes_is_refused(two_tasks, monkeypatch):
    from entry.stages import operator as entry_operator

    def still(cfg, info, kind, value, *, horizon=1):
        return torch.tensor([0.0, 1e-3]), torch.tensor([5, 5])

    monkeypatch.setattr(entry_operator, "per_task_mean", still)
    with pytest.raises(ConfigError, match="task_weighting"):
        step_size_weights(two_tasks, INFO)
