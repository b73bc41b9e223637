"""One cosine and one average ramp (core.schedule): the stages' learning-rate factor and the
race's learning rate are the same half cosine with their own floors, and the average's ramp is
the same function for both."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import bench.budget as bb
from core.schedule import cosine_decay, ema_decay_at
from entry.stages.stage_build import cosine_schedule


@given(st.floats(0.0, 1.0), st.floats(0.0, 0.9))
def test_the_cosine_runs_from_the_peak_to_the_floor(progress, floor):
    value = cosine_decay(progress, floor=floor)
    assert floor - 1e-12 <= value <= 1.0 + 1e-12
    assert value == pytest.approx(floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)
    assert cosine_decay(0.0, floor=floor) == 1.0 and cosine_decay(1.0, floor=floor) == floor
    assert cosine_decay(2.0, floor=floor) == floor and cosine_decay(-1.0, floor=floor) == 1.0


def test_the_stage_schedule_and_the_race_follow_the_same_cosine_to_their_floors():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    schedule = cosine_schedule(opt, steps=10, warmup=0)
    factors = []
    for _ in range(11):
        factors.append(opt.param_groups[0]["lr"] / 2.0)
        opt.step()
        schedule.step()
    assert factors == pytest.approx([cosine_decay(i / 10, floor=0.1) for i in range(11)])
    assert factors[-1] == pytest.approx(0.1)
    # The race decays the rate itself to final_ratio of the peak; 0 by default.
    assert [bb.cosine_lr(2.0, i / 10) for i in range(11)] == [cosine_decay(i / 10, peak=2.0, floor=0.0)
                                                               for i in range(11)]
    assert bb.cosine_lr(2.0, 0.5, final_ratio=0.1) == cosine_decay(0.5, peak=2.0, floor=0.2)


def test_the_average_ramp_is_shared_and_reaches_the_decay():
    assert bb.ema_decay_at is ema_decay_at
    assert ema_decay_at(0.999, 0) == 0.1 and ema_decay_at(0.999, 10**6) == 0.999
    assert [ema_decay_at(0.5, n) for n in range(3)] == [0.1, 2 / 11, 0.25]
