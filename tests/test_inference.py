"""The inference API and `entry.predict`: a run loaded from its folder rolls out what the evaluation
scored, bit for bit (1D, and a 2-channel 2D flow); the command's file reproduces eval.json's nRMSE;
input that does not fit the run is one typed error (API) or one line and exit 2, nothing written
(command).

The runs are seeded and untrained (tests/inference_runs.py): the tests are about the plumbing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import orjson
import pytest
import torch

import entry.evaluation.scoring as scoring
from entry.config.load import load_config
from entry.distributed.process_group import DistInfo
from entry.inference import InputError, load_run
from pipelines.generate import generate_task
from pipelines.layouts import describe, read_windows
from pipelines.task_data import read_task
from tests.inference_runs import finished_run, tree_1d, tree_2d, tree_steady
from tests.tiny_run import ROOT, env, run_here

CPU = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)


class _Evaluated:
    """A finished run, evaluated once: its eval.json tree and every variant's test predictions."""

    def __init__(self, root, tree, monkeypatch) -> None:
        self.cfg_path, self.run_dir = finished_run(root, tree)
        self.cfg = load_config(self.cfg_path)
        recorded = []

        class Recording(scoring.KeepPrediction):
            def add(self, pred_BCTS, true_BCTS, one_step_BCTS):
                super().add(pred_BCTS, true_BCTS, one_step_BCTS)
                recorded.append(pred_BCTS.transpose(1, 2).clone())

        monkeypatch.setattr(scoring, "KeepPrediction", Recording)
        self.tree = scoring.evaluate_config(self.cfg, CPU)
        self.surrogate = load_run(self.run_dir)
        # One batch of test samples: the taps come in the order of the task's variants.
        self.predictions = dict(zip(self.surrogate.task().variants, recorded, strict=True))
        (self.data_file,) = (root / "data").glob("*.h*5")
        task = self.cfg.data.tasks[0]
        data = read_task(self.data_file, reduce_x=task.reduce_x, reduce_t=task.reduce_t)
        self.u = torch.from_numpy(data.u)
        self.coefficient = None if data.coefficient is None else torch.from_numpy(data.coefficient)


@pytest.fixture(scope="module")
def run1d(tmp_path_factory):
    root = tmp_path_factory.mktemp("r1d")
    with pytest.MonkeyPatch.context() as mp:
        return _Evaluated(root, tree_1d(root), mp)


@pytest.fixture(scope="module")
def run2d(tmp_path_factory):
    root = tmp_path_factory.mktemp("r2d")
    with pytest.MonkeyPatch.context() as mp:
        return _Evaluated(root, tree_2d(root), mp)


@pytest.fixture(scope="module")
def run_steady(tmp_path_factory):
    root = tmp_path_factory.mktemp("rs")
    with pytest.MonkeyPatch.context() as mp:
        return _Evaluated(root, tree_steady(root), mp)


def _test_rows(run) -> int:
    return run.tree["tasks"][run.surrogate.task().name]["n_test_samples"]


@pytest.mark.timeout(400)
def test_the_api_rolls_out_the_evaluations_predictions_bitwise_1d(run1d):
    info = run1d.surrogate.task()
    assert info.channels == ("u",) and info.grid == (32,) and info.given_steps == 2 and not info.steady
    assert info.variants == ("operator", "operator+diffusion", "operator+consistency")
    # The time step the evaluation reads from the file (float32 there), from the config alone.
    assert np.float32(info.time_step) == np.float32(0.2)
    n, g = _test_rows(run1d), info.given_steps
    u = run1d.u[:n]
    for variant, expected in run1d.predictions.items():
        got = run1d.surrogate.rollout(u[:, :g], u.shape[1] - g, variant=variant)
        assert got.shape == expected.shape == u.shape
        assert torch.equal(got, expected), variant
    # numpy in, numpy out; one trajectory alone draws its own noise (its id's), so only the float
    # rounding of a batch of one differs (a matmul's blocking depends on the batch)
    one = run1d.surrogate.rollout(u[1:2, :g].numpy(), u.shape[1] - g, variant="operator+consistency",
                                  sample_ids=[1])
    assert isinstance(one, np.ndarray)
    np.testing.assert_allclose(one, run1d.predictions["operator+consistency"][1:2].numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(400)
def test_the_api_rolls_out_the_evaluations_predictions_bitwise_2d_flow(run2d):
    info = run2d.surrogate.task()
    assert info.channels == ("activator", "inhibitor") and info.grid == (16, 16)
    n, g = _test_rows(run2d), info.given_steps
    u = run2d.u[:n]
    for variant, expected in run2d.predictions.items():
        fields = {c: u[:, :g, j].numpy() for j, c in enumerate(info.channels)}  # a mapping in: one out
        got = run2d.surrogate.rollout(fields, u.shape[1] - g, variant=variant)
        assert set(got) == set(info.channels)
        for j, c in enumerate(info.channels):
            assert np.array_equal(got[c], expected[:, :, j].numpy()), (variant, c)


def test_members_seed_and_edge_shapes(run1d):
    s, g = run1d.surrogate, 2
    u = run1d.u[:2, :g]
    ens = s.rollout(u, 3, variant="operator+diffusion", members=3)
    assert ens.shape == (3, 2, g + 3, 1, 32)
    assert torch.equal(ens[0], s.rollout(u, 3, variant="operator+diffusion"))  # member 0: the single rollout
    assert not torch.equal(ens[1], ens[0]) and not torch.equal(ens[2], ens[1])
    assert not torch.equal(s.rollout(u, 3, variant="operator+diffusion", seed=11), ens[0])
    assert torch.equal(s.rollout(u, 0), u)  # no step: the given frames
    assert s.rollout(u[:0], 4).shape == (0, g + 4, 1, 32)
    torch.testing.assert_close(s.rollout(u, 3, batch_size=1), s.rollout(u, 3), rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(400)
def test_solve_gives_the_evaluations_steady_predictions_bitwise(run_steady):
    s = run_steady.surrogate
    info = s.task()
    assert info.steady and info.variants == ("steady",) and info.grid == (16, 16)
    n = _test_rows(run_steady)
    got = s.solve(run_steady.coefficient[:n])
    assert torch.equal(got, run_steady.predictions["steady"][:, 0])
    with pytest.raises(InputError, match="steady"):
        s.rollout(run_steady.u[:n], 1)


@pytest.mark.parametrize("bad, match", [
    (lambda u: {"v": u[:, :, 0]}, r"fields \['u'\]; got \['v'\]"),
    (lambda u: u[:, :, 0], r"is 1D: expected \[B, T0, C, \*S\]"),
    (lambda u: torch.cat([u, u], dim=2), "wrong channels"),
    (lambda u: u[..., ::2], r"wrong grid \(resolution\)"),
    (lambda u: u[:, :0], "at least one frame"),
    (lambda u: u * float("nan"), "NaN"),
])
def test_input_that_does_not_fit_the_run_is_one_input_error(run1d, bad, match):
    with pytest.raises(InputError, match=match):
        run1d.surrogate.rollout(bad(run1d.u[:2, :2]), 3)


def test_unknown_variant_task_and_steps_are_input_errors(run1d):
    u = run1d.u[:1, :2]
    with pytest.raises(InputError, match="no variant 'steady'"):
        run1d.surrogate.rollout(u, 1, variant="steady")
    with pytest.raises(InputError, match="no task 'burgers1d'"):
        run1d.surrogate.rollout(u, 1, task="burgers1d")
    with pytest.raises(InputError, match="steps must be"):
        run1d.surrogate.rollout(u, -1)


def test_a_run_of_several_tasks_is_asked_which_one_by_the_name_eval_json_gives_it(tmp_path):
    tree = tree_1d(tmp_path)
    tree["data"]["tasks"].append({**tree["data"]["tasks"][0], "param": 0.4})
    _, run = finished_run(tmp_path, tree, generate=False)
    surrogate = load_run(run)
    with pytest.raises(InputError, match=r"2 tasks \(advection1d_param0.1, advection1d_param0.4\); name one \(--task"):
        surrogate.task()
    assert surrogate.task("advection1d_param0.4").index == 1 and surrogate.task(0).name == "advection1d_param0.1"
    assert surrogate.task("1").index == 1  # --task 1 on a command line


# ----------------------------------------------------------------------------------- the command


def _predict(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "entry.predict", *args], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)


def _predict_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """`python -m entry.predict ARGS` run in this process (its `main`, exit code and stderr as the
    command gives them): the refusals are decided before any model runs, and a process start per
    case costs more than the case."""
    import entry.predict

    return run_here(entry.predict.main, list(args), capsys)


def _nrmse(pred_NTCS: np.ndarray, true_NTCS: np.ndarray, given: int) -> float:
    """The evaluation's nRMSE of predictions against the truth (core.evaluation.MetricSums)."""
    sums = scoring.MetricSums.zeros(true_NTCS.shape[2], true_NTCS.shape[1], given, False, "cpu")
    sums.add(torch.from_numpy(pred_NTCS).transpose(1, 2), torch.from_numpy(true_NTCS).transpose(1, 2), None)
    return sums.summary()["nrmse"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("which, variant, layout", [("run1d", "operator", None),
                                                    ("run2d", "operator+consistency", "the_well")])
def test_predict_on_the_test_split_reproduces_eval_json(request, tmp_path, which, variant, layout):
    run = request.getfixturevalue(which)
    info, n = run.surrogate.task(), _test_rows(run)
    steps = run.u.shape[1] - info.given_steps
    out = tmp_path / "pred.h5"
    proc = _predict("--run", str(run.run_dir), "--input", str(run.data_file), "--rows", f"0:{n}", "--steps",
                    str(steps), "--variant", variant, "--out", str(out), *(["--out-layout", layout] if layout else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (desc,) = describe(out)
    assert desc.layout == (layout or "pdebench") and desc.channels == info.channels and desc.trajectories == n
    assert desc.steps == run.u.shape[1] and desc.grid.shape == info.grid
    np.testing.assert_allclose(desc.times[1] - desc.times[0], info.time_step, rtol=1e-6)
    pred = np.stack(read_windows(desc, range(n)))
    assert np.array_equal(pred, run.predictions[variant].numpy())
    expected = run.tree["tasks"][info.name]["variants"][variant]["nrmse"]
    assert _nrmse(pred, run.u[:n].numpy(), info.given_steps) == pytest.approx(expected, rel=1e-6)
    assert "\r" not in proc.stderr  # no progress bar off a terminal


def _one_line_exit_2(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(("data error", "config error", "checkpoint error")), lines
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.timeout(600)
def test_bad_inputs_are_one_line_exit_2_and_write_nothing(run1d, run2d, tmp_path, capsys):
    out = tmp_path / "out" / "pred.h5"
    out.parent.mkdir()
    good = ["--run", str(run1d.run_dir), "--input", str(run1d.data_file), "--steps", "3"]

    def files():
        return sorted(p.name for p in out.parent.iterdir())

    # a run whose operator was never trained
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run1d.run_dir, unfinished)
    (unfinished / "operator.pt").unlink()
    _one_line_exit_2(_predict_here(capsys, *good[2:], "--run", str(unfinished), "--out", str(out)), "operator.pt")
    # a folder no run wrote
    _one_line_exit_2(_predict_here(capsys, *good[2:], "--run", str(tmp_path), "--out", str(out)), "config.json")
    # a file of other fields (the 2D flow's) for the 1D run
    _one_line_exit_2(_predict_here(capsys, *good[:2], "--input", str(run2d.data_file), "--steps", "3", "--out", str(out)),
                     "activator", "'u'")
    # a file of another shape: 48 points where the run takes 32
    other = generate_task("advection1d", 3, tmp_path / "other", nx=48, nt=11, param=0.1)
    _one_line_exit_2(_predict_here(capsys, *good[:2], "--input", str(other), "--steps", "3", "--out", str(out)), "[48]", "[32]")
    # an unreadable file
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"not hdf5 at all" * 10)
    _one_line_exit_2(_predict_here(capsys, *good[:2], "--input", str(garbage), "--steps", "3", "--out", str(out)), "garbage.h5")
    assert files() == []
    # an output that exists, without --force: left as it was
    out.write_bytes(b"keep me")
    _one_line_exit_2(_predict_here(capsys, *good, "--out", str(out)), "--force")
    assert out.read_bytes() == b"keep me" and files() == ["pred.h5"]
    # with --force it is replaced by a whole file
    assert _predict(*good, "--out", str(out), "--force").returncode == 0  # the command itself
    assert describe(out)[0].steps == 2 + 3 and files() == ["pred.h5"]


@pytest.mark.parametrize("device", ["gpu", f"cuda:{torch.cuda.device_count()}", "meta"])
def test_a_device_the_machine_lacks_is_one_input_error(run1d, device):
    """torch's own refusal came as a traceback from the first weights copied (entry.predict and
    entry.export take --device and load through load_run)."""
    with pytest.raises(InputError, match="device"):
        load_run(run1d.run_dir, device=device)


def test_the_api_refuses_an_unfinished_run(tmp_path, run1d):
    from entry.config.errors import ConfigError

    with pytest.raises(ConfigError, match="config.json"):
        load_run(tmp_path)
    eval_json = orjson.loads((run1d.run_dir / "eval.json").read_bytes())
    assert eval_json["tasks"]  # the fixture's evaluation wrote its report
