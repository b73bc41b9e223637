"""`bench.machine_speed`: the reference workload a race times before each trained run, and the
report's verdict on whether the records shared one clock."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from bench.machine_speed import DRIFT, reference_seconds, speed_note


def test_the_reference_is_a_positive_time_of_one_pass():
    seconds = reference_seconds(repeats=2, iterations=2)
    assert math.isfinite(seconds) and 0 < seconds < 10


@given(st.dictionaries(st.sampled_from(["ours", "fno", "unet"]),
                       st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=6), min_size=1))
def test_the_note_says_the_clock_drifted_exactly_when_the_slowest_exceeds_drift_times_the_fastest(references):
    every = [s for seconds in references.values() for s in seconds]
    note = speed_note(references)
    drifted = max(every) > DRIFT * min(every)
    assert ("did not all train on the same clock" in note) == drifted
    assert ("one clock" in note) == (not drifted)
    assert f"the {len(every)} records" in note
    if drifted:  # each model's median is named, so a referee sees which model ran slow
        assert all(f"{model} " in note for model in references)


def test_no_record_measured_it_says_nothing():
    assert speed_note({}) == "" and speed_note({"fno": []}) == ""
