"""bench.pdebench_unet: PDEBench's U-Net code is scored by the race's metric on PDEBench's batches.

PDEBench itself is not installed here (a checkout is passed by hand), so these check our side: the
rollout over its tensor layout and the refusal of a missing checkout."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.pdebench_unet import GIVEN_STEPS, main, rollout_nrmse


class LastFrame(torch.nn.Module):
    """Persistence in PDEBench's U-Net interface: [B, 10, X] -> [B, 1, X], the last given frame."""

    def forward(self, inp):
        return inp[:, -1:]


def pdebench_batches(u: np.ndarray, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """PDEBench's (xx, yy) batches of trajectories ``u`` [N, T, X]: xx [B, X, 10, 1], yy [B, X, T, 1]."""
    yy = torch.from_numpy(u).permute(0, 2, 1).unsqueeze(-1)
    return [(yy[i:i + batch, :, :GIVEN_STEPS], yy[i:i + batch]) for i in range(0, len(u), batch)]


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 5), st.integers(GIVEN_STEPS + 1, GIVEN_STEPS + 6), st.integers(4, 24), st.integers(1, 3),
       st.integers(0, 2**31 - 1))
def test_rollout_scores_persistence_as_computed_by_hand(n, steps, x, batch, seed):
    u = np.random.default_rng(seed).normal(size=(n, steps, x)).astype(np.float32) + 0.5
    # By hand: every predicted step is the last given frame; nRMSE per trajectory and step, then the mean.
    err = np.sqrt(((u[:, GIVEN_STEPS:] - u[:, GIVEN_STEPS - 1:GIVEN_STEPS]) ** 2).mean(-1))
    norm = np.sqrt((u[:, GIVEN_STEPS:] ** 2).mean(-1))
    expected = (err / norm).mean()
    got = rollout_nrmse(LastFrame(), pdebench_batches(u, batch))
    assert abs(got - expected) <= 1e-4 * expected


def test_rollout_feeds_predictions_back():
    """A model adding one to the last frame drifts by k at the k-th predicted step: the rollout uses its
    own output, not the reference, as the next input."""

    class AddOne(torch.nn.Module):
        def forward(self, inp):
            return inp[:, -1:] + 1

    u = np.full((1, GIVEN_STEPS + 3, 8), 2.0, dtype=np.float32)  # constant in time: persistence is exact
    got = rollout_nrmse(AddOne(), pdebench_batches(u, 1))
    assert abs(got - (1 + 2 + 3) / 3 / 2.0) < 1e-5


def test_missing_checkout_exits_2(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["--pdebench", str(tmp_path / "nowhere"), "--config", "configs/reduced/burgers.yaml",
                 "--epochs", "1", "--out", str(out)])
    assert code == 2 and not out.exists()
    assert "pdebench/models/unet/train.py" in capsys.readouterr().err
