"""Lead-time windows, correlation time, spectrum error and ensemble scores in the evaluation.

The sums must combine over batches and ranks into the scores of one batch of all samples
(``core.long_rollout`` on the whole set); eval.json carries them per variant; K = 1 samples nothing
beyond the single rollout. The command's fixtures (tiny generated data, seeded untrained weights)
are those of tests/test_evaluate.py.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.long_rollout import (
    correlation_per_step,
    correlation_time,
    radial_energy_spectrum,
    spectra_log_error,
    crps_ensemble,
    lead_time_windows,
    spectrum_error,
    spread_skill_ratio,
    windowed,
)
from core.metrics import nrmse_per_step, vrmse_per_step
from entry.evaluation import scoring
from entry.evaluation.long_rollout import RolloutSums, member_seed, rollout_step_cost
from entry.evaluation.table import codec_line, lead_time_lines
from tests.test_evaluate import _copy_weights, run_root  # noqa: F401  (a fixture)

GIVEN, EDGES = 2, (3, 5)


def _ensemble(k: int = 3, b: int = 5, t: int = 9, x: int = 16, seed: int = 0):
    """members [K, B, C, T, X] near a smooth truth [B, C, T, X], given steps equal to the truth."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.linspace(0, 2 * math.pi, x + 1)[:-1]
    phase = torch.rand(b, 2, 1, 1, generator=g) * 6
    steps = torch.arange(t).view(1, 1, t, 1)
    true = torch.sin(grid + phase + 0.3 * steps) + 0.5
    members = true + 0.12 * steps * torch.randn(k, *true.shape, generator=g)
    members[:, :, :, :GIVEN] = true[:, :, :GIVEN]
    return members, true


def _summed(members, true, cuts):
    sums = RolloutSums.zeros(true.shape[1], true.shape[2], GIVEN, members.shape[0], "cpu")
    for a, b in itertools.pairwise(cuts):
        sums.add(members[:, a:b], true[a:b])
    return sums


def _flat(tree: dict, prefix: str = "") -> dict:
    """Nested scores as one level, so pytest.approx compares them."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, list):
            v = dict(enumerate(v))
        out |= _flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def _window_means(value_CT, t):
    return {k: v.mean().item() for k, v in windowed(value_CT, lead_time_windows(t - GIVEN, EDGES),
                                                     given_steps=GIVEN).items()}


def test_two_batches_score_as_one_batch_of_both():
    """Windows, correlation time, spectrum and ensemble scores of batches 0:2 and 2:5 added are
    those of core.long_rollout on all 5 samples at once."""
    members, true = _ensemble()
    got = _summed(members, true, [0, 2, 5]).summary(EDGES)
    assert _flat(got) == pytest.approx(_flat(_summed(members, true, [0, 5]).summary(EDGES)), rel=1e-6)
    t = true.shape[2]
    assert list(got["windows"]) == ["1-3", "4-5", "6-7"]
    want = {"nrmse": _window_means(nrmse_per_step(members[0], true), t),
            "vrmse": _window_means(vrmse_per_step(members[0], true), t),
            "crps": _window_means(crps_ensemble(members, true), t),
            "spread_skill": _window_means(spread_skill_ratio(members, true), t),
            "ensemble_mean_nrmse": _window_means(nrmse_per_step(members.mean(0), true), t)}
    for key, per_window in want.items():
        for name, value in per_window.items():
            assert got["windows"][name][key] == pytest.approx(value, rel=1e-5), (key, name)
    member_windows = [_window_means(nrmse_per_step(m, true), t)["6-7"] for m in members]
    assert got["windows"]["6-7"]["nrmse_member_std"] == pytest.approx(np.std(member_windows, ddof=1), rel=1e-5)
    assert got["correlation_time"] == pytest.approx(
        correlation_time(members[0], true, given_steps=GIVEN).mean().item())
    assert got["spectrum_error"] == pytest.approx(spectrum_error(members[0], true).mean().item(), rel=1e-5)
    assert 0 < got["correlation_time"] < t - GIVEN  # the noise grows: some samples decorrelate
    want_corr = correlation_per_step(members[0].double(), true.double())[:, :, GIVEN:].mean(dim=(0, 1))
    assert got["correlation_per_step"] == pytest.approx(want_corr.tolist(), rel=1e-6)
    k_max = min(true.shape[3:]) // 2
    for name, u in (("prediction", members[0]), ("truth", true)):
        spectrum = radial_energy_spectrum(u[:, :, -1:])[:, :, 0].mean(dim=(0, 1))[1:k_max + 1]
        assert got["spectrum_last_step"][name] == pytest.approx(spectrum.tolist(), rel=1e-5), name


def test_one_member_is_a_point_forecast():
    """K = 1 (the deterministic operator): CRPS is the MAE, spread-skill and member std are null."""
    members, true = _ensemble(k=1)
    got = _summed(members, true, [0, 5]).summary(EDGES)
    mae = (members[0] - true).abs().mean(dim=(0, 3))[:, GIVEN:].mean().item()
    assert got["crps"] == pytest.approx(mae, rel=1e-5) and got["ensemble_members"] == 1
    assert got["spread_skill"] is None
    assert all(w["spread_skill"] is None and w["nrmse_member_std"] is None for w in got["windows"].values())
    assert got["ensemble_mean_nrmse"] == pytest.approx(nrmse_per_step(members[0], true)[:, GIVEN:].mean().item())


@pytest.mark.parametrize("shape", [(3, 2, 4, 32), (3, 1, 2, 16, 16)])
def test_spectrum_error_from_summed_spectra_matches_core(shape):
    g = torch.Generator().manual_seed(1)
    pred, true = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    sums = RolloutSums.zeros(shape[1], shape[2], 1, 1, "cpu")
    sums.add(pred[None, :1], true[:1])
    sums.add(pred[None, 1:], true[1:])
    e = sums.spectra_2CR / sums.count
    np.testing.assert_allclose(spectra_log_error(e[0], e[1], sums.k_max), spectrum_error(pred, true), rtol=1e-5)


def test_member_seeds_are_distinct_and_member_zero_is_the_seed():
    assert member_seed(7, 0) == 7
    assert len({member_seed(s, k) for s in (0, 1, 2**31) for k in range(4)}) == 12


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    members, true = _ensemble()
    shards = {"split": ([0, 2], [2, 5]), "empty": ([0, 5], [5, 5])}
    results = {}
    for case, cuts in shards.items():
        a, b = cuts[rank]
        sums = RolloutSums.zeros(true.shape[1], true.shape[2], GIVEN, members.shape[0], "cpu")
        if b > a:
            sums.add(members[:, a:b], true[a:b])
        sums.all_reduce()
        results[case] = sums.summary(EDGES)
    if rank == 1:
        torch.save(results, out)
    dist.destroy_process_group()


def test_ranks_combine_like_one_process(tmp_path):
    """Two gloo ranks, the samples split or all on rank 0 (rank 1 empty: it has seen no grid)."""
    from tests.tiny_run import free_port

    port = free_port()
    # fork: a spawned child would import this module (and the evaluation) again, seconds per rank.
    mp.start_processes(_rank, args=(port, str(tmp_path / "r.pt")), nprocs=2, start_method="fork")
    members, true = _ensemble()
    want = _summed(members, true, [0, 5]).summary(EDGES)
    for case, got in torch.load(tmp_path / "r.pt").items():
        assert _flat(got) == pytest.approx(_flat(want), rel=1e-6), case


# ------------------------------------------------------------------------------ the command


def _evaluate(root, name: str, k: int, monkeypatch, *sets: str) -> tuple[dict, int]:
    """In-process evaluation (2 test samples per task) with ``k`` members and the overrides ``sets``;
    the eval.json tree and how many extra member rollouts it made."""
    from entry.config.load import load_config
    from entry.distributed.process_group import DistInfo

    calls = []
    real = scoring.rollout_member
    monkeypatch.setattr(scoring, "rollout_member", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    _copy_weights(root, name)
    cfg = load_config(root / "cfg.yaml", [f"logging.run_name={name}", "evaluation.plot_samples=0",
                                          "evaluation.max_test_samples=2", f"evaluation.ensemble_members={k}",
                                          "evaluation.lead_windows=[2,4]", *sets])
    tree = scoring.evaluate_config(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None, 0), small=True)
    return tree, len(calls)


def test_eval_json_has_lead_time_and_ensemble_scores(run_root, monkeypatch, capsys):  # noqa: F811
    one, extra_one = _evaluate(run_root, "k1", 1, monkeypatch, "evaluation.time_rollout=false")
    two, extra_two = _evaluate(run_root, "k2", 2, monkeypatch, "evaluation.time_rollout=true")
    assert extra_one == 0  # K = 1: the single rollout is member 0, nothing more is sampled
    assert extra_two == 2 * 2  # one more member per refiner and time-dependent task (one batch each)
    out = capsys.readouterr().out
    for task in ("advection1d", "burgers1d"):
        for name, s in two["tasks"][task]["variants"].items():
            assert math.isfinite(s["correlation_time"]) and math.isfinite(s["spectrum_error"])
            windows = s["windows"]
            # advection: 9 predicted steps; burgers: 5
            assert list(windows) == (["1-2", "3-4", "5-9"] if task == "advection1d" else ["1-2", "3-4", "5-5"])
            stochastic = name != "operator"
            assert s["ensemble_members"] == (2 if stochastic else 1)
            assert s["rollout_step_ms"] > 0  # timed on the first batch (a record, machine-dependent)
            # What a step costs whatever the machine: the operator once, then the refiner's network:
            # PDE-Refiner's levels call the denoiser once a level (2 here), the student once a step.
            refiner = {"operator+diffusion": {"diffusion": 2}, "operator+consistency": {"consistency": 1}}
            assert s["network_calls_per_step"] == {"operator": 1, **refiner.get(name, {})}
            # Untimed, the calls are recorded all the same.
            untimed = one["tasks"][task]["variants"][name]
            assert "rollout_step_ms" not in untimed
            assert untimed["network_calls_per_step"] == s["network_calls_per_step"]
            fan = s["ensemble_fan"]  # the first test sample at the centre point, every member
            assert len(fan["members"]) == s["ensemble_members"] and len(fan["truth"]) == len(fan["members"][0])
            assert len(s["correlation_per_step"]) == len(fan["truth"])  # the predicted steps
            for w in windows.values():
                assert math.isfinite(w["nrmse"]) and math.isfinite(w["vrmse"]) and math.isfinite(w["crps"])
                assert (w["spread_skill"] is not None) == stochastic
            # member 0 is the single-sample rollout of K = 1
            same = one["tasks"][task]["variants"][name]
            assert s["nrmse"] == pytest.approx(same["nrmse"], rel=1e-6)
            assert s["correlation_time"] == same["correlation_time"]
            for w in windows:
                assert windows[w]["nrmse"] == pytest.approx(same["windows"][w]["nrmse"], rel=1e-6)
        lines = [x for x in out.splitlines() if task in x and "correlation time" in x]
        assert len(lines) == 2 * 3, lines  # one per variant, in each of the two evaluations
        for refiner in ("operator+diffusion", "operator+consistency"):
            verdict = [x for x in lines if refiner in x]
            assert all(x.startswith(f"refinement does not pay on {task}:") or "below the operator's" in x
                       for x in verdict), verdict
    assert "windows" not in two["tasks"]["darcy2d"]["variants"]["steady"]


def test_rollout_step_time_counts_every_call_of_a_step_per_trajectory():
    """A step that sleeps 20 ms per call, on a batch of 4: at least 5 ms a step per trajectory
    (a lower bound, whatever the machine's speed), and the batch's sample ids reach the step."""
    seen = []

    def step_for(ids, t):
        seen.append(ids.tolist())

        def step(z, dt, tid):
            time.sleep(0.02)
            return z
        return step

    s, _ = rollout_step_cost(step_for, {}, torch.zeros(4, 3, 2), dt=0.1, task_id=0, sample_id_B=torch.arange(4),
                             steps=2, rounds=1)
    assert s >= 0.02 / 4 and seen[0] == [0, 1, 2, 3]


def test_an_untimed_cost_runs_the_warm_up_step_alone_and_counts_its_calls():
    """`evaluation.time_rollout: false`: one step, no seconds, every call counted."""
    net, seen = torch.nn.Identity(), []

    def step_for(ids, t):
        return lambda z, dt, tid: (seen.append(1), net(z))[1]

    seconds, calls = rollout_step_cost(step_for, {"operator": net}, torch.zeros(2, 3, 2), dt=0.1, task_id=0,
                                       sample_id_B=torch.arange(2), timed=False)
    assert seconds is None and calls == {"operator": 1} and len(seen) == 1


def test_the_cost_takes_its_minimum_rounds_past_its_budget_and_all_within_it():
    """A warm-up step, then at least MIN_COST_ROUNDS timed rounds; more only while the budget lasts:
    a budget of 0 s stops at the minimum, an endless one takes every round asked for."""
    from entry.evaluation.long_rollout import MIN_COST_ROUNDS

    def rounds_taken(budget_s: float) -> int:
        seen: list[int] = []  # one entry a rollout step

        def step_for(ids, t):
            return lambda z, dt, tid: (seen.append(1), z)[1]

        rollout_step_cost(step_for, {}, torch.zeros(2, 3, 2), dt=0.1, task_id=0, sample_id_B=torch.arange(2),
                          steps=3, rounds=5, budget_s=budget_s)
        warm_up, timed = 1, len(seen) - 1
        assert timed % 3 == 0, len(seen)  # one warm-up step, then whole rounds of 3
        return warm_up + timed // 3

    assert rounds_taken(0.0) == 1 + MIN_COST_ROUNDS
    assert rounds_taken(float("inf")) == 1 + 5


def test_a_refiner_that_does_not_beat_the_operator_says_so():
    def scores(last: float, std=None, k=1):
        return {"ensemble_members": k, "correlation_time": 3.0,
                "windows": {"1-10": {"nrmse": 0.1}, "11-20": {"nrmse": last, "nrmse_member_std": std,
                                                              "ensemble_mean_nrmse": last, "crps": 0.1,
                                                              "spread_skill": 1.0}}}

    lines = lead_time_lines("ks", {"operator": scores(0.30), "operator+diffusion": scores(0.29, 0.02, 4),
                                   "operator+consistency": scores(0.20, 0.02, 4)})
    assert lines[0] == "ks: operator: correlation time 3 steps, last window (11-20) nRMSE 0.3"
    assert lines[1].startswith("refinement does not pay on ks: operator+diffusion:")  # within its spread
    assert lines[2].startswith("ks: operator+consistency:") and "below the operator's 0.3" in lines[2]
    assert lead_time_lines("darcy", {"steady": {"nrmse": 0.1}}) == []


def test_the_summary_says_when_the_codec_is_the_largest_error_term():
    variants = {"operator": {"nrmse": 0.10}, "operator+diffusion": {"nrmse": 0.08}}
    [line] = codec_line("ns2d", {"nrmse": 0.05}, variants)  # 0.05 of the best 0.08: the latent's share wins
    assert line.startswith("the codec is the largest error term on ns2d: its reconstruction nRMSE 0.05 is 62%")
    assert "(operator+diffusion)" in line
    assert codec_line("ns2d", {"nrmse": 0.03}, variants) == []  # 0.03 of 0.08: the models' own error is larger
    assert codec_line("darcy", {"nrmse": 1e-6}, {"steady": {"nrmse": 0.1}}) == []
