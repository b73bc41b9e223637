"""`bench.subgrid_floor`: what a reaction-diffusion file's stored frame leaves undetermined. It must score the file's
own trajectories (their block means are the stored frames) and refuse a flow whose frames are not block means."""

from __future__ import annotations

import numpy as np
import pytest

from bench import subgrid_floor
from entry.config.schema import TaskConfig
from pipelines.flows import generate_flow
from pipelines.layouts import describe, read_window
from tests import tiny_run as tr


def test_the_fine_trajectories_block_means_are_the_files_frames(tmp_path):
    task = TaskConfig(name="dr2d", param=0.005, samples=6, nx=8, resolution=16, nt=3, t_end=0.05)
    path = generate_flow("dr2d", 6, tmp_path, resolution=16, stored=8, steps=3, t_end=0.05, seed=7,
                         params={"k": 0.005})
    (desc,) = describe(path)
    stored_BTCXY = np.stack([read_window(desc, i) for i in range(4)])
    fine_BTXYC = subgrid_floor.fine_trajectories(task, 4, seed=7).numpy()
    means_BTXYC = fine_BTXYC.reshape(4, 3, 8, 2, 8, 2, 2).mean(axis=(3, 5))
    np.testing.assert_allclose(means_BTXYC.transpose(0, 1, 4, 2, 3), stored_BTCXY, rtol=0, atol=1e-6)
    # another seed draws other trajectories: the seed is the file's, not a default
    assert not np.allclose(subgrid_floor.fine_trajectories(task, 4, seed=8).numpy(), fine_BTXYC)


def test_the_oracles_mean_is_no_worse_than_its_members_and_the_rollout_starts_as_one_step(tmp_path):
    task = TaskConfig(name="dr2d", param=0.005, samples=6, nx=8, resolution=16, nt=4, t_end=0.75)
    fine = subgrid_floor.fine_trajectories(task, 6, seed=7)
    one = subgrid_floor.frame_scores(task, fine, frames=4, members=4)
    roll = subgrid_floor.frame_scores(task, fine, frames=4, members=4, rollout=True)
    assert [r["frame"] for r in one] == [r["frame"] for r in roll] == [1, 2, 3]
    for r in one + roll:  # the triangle inequality, trajectory by trajectory and field by field
        assert r["oracle_limit"] <= r["oracle_mean"] <= r["oracle_member"]
        assert all(np.isfinite(v) and v > 0 for v in r.values())
    # frame 1 is one step from frame 0 either way: the same persistence and the same coarse solve
    assert roll[0]["persistence"] == one[0]["persistence"] and roll[0]["coarse_solver"] == one[0]["coarse_solver"]
    # from the start alone, the later frames are harder than from the frame before them
    assert roll[2]["persistence"] > one[2]["persistence"] and roll[2]["oracle_limit"] > one[2]["oracle_limit"]


@pytest.mark.parametrize("sets, says", [
    (["data.tasks=[{name: ns2d, param: 0.001, nx: 16, nt: 3}]"], "is not a reaction-diffusion flow"),
    (["data.tasks=[{name: dr2d, param: 0.005, samples: 60, nx: 8, nt: 3}]", "--members", "6"],
     "the oracle needs 2 to 5"),
])
def test_a_task_it_cannot_score_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, sets, says):
    out = tmp_path / "floor.json"
    argv = ["--config", "configs/reduced/transfer_dr2d_held_out.yaml", "--set", sets[0], *sets[1:], "--out", str(out)]
    done = tr.run_here(subgrid_floor.main, argv, capsys)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not out.exists()
