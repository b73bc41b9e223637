"""The stages' optimiser (`entry.stages.stage_build.optimizer_for`): its second-moment decay
bounds the step a gradient spike takes after a long run of small gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from entry.config.schema import OperatorConfig
from entry.distributed.process_group import DistInfo
from entry.stages.stage_build import optimizer_for

CPU = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)


def _spike_step(beta2: float, lr: float = 1e-2) -> float:
    """|update| / lr of one parameter given 200 gradients of 1e-6, then one of 1."""
    p = nn.Parameter(torch.zeros(1))
    model = nn.Module()
    model.p = p
    opt, _ = optimizer_for(model, OperatorConfig(lr=lr, weight_decay=0.0, adam_beta2=beta2), CPU)
    for g in [1e-6] * 200 + [1.0]:
        before = p.detach().clone()
        p.grad = torch.full_like(p, g)
        opt.step()
    return float((p.detach() - before).abs()) / lr


def test_a_lower_beta2_bounds_the_spike_step():
    # Adam's spike step is m / sqrt(v) with bias correction: (1 - beta1) / sqrt(1 - beta2) over the
    # v correction 1 - beta2 ** 201; 0.1 / sqrt(0.001 / 0.182) = 1.35 at 0.999, 0.1 / sqrt(0.05) = 0.447 at 0.95.
    assert _spike_step(0.999) == pytest.approx(1.35, rel=0.02)
    assert _spike_step(0.95) == pytest.approx(0.447, rel=0.02)


@pytest.mark.parametrize("bad", [0.0, 1.0, float("nan")])
def test_beta2_outside_the_open_unit_interval_is_refused(bad):
    with pytest.raises(ValueError, match="adam_beta2 must lie in"):
        OperatorConfig(adam_beta2=bad)
