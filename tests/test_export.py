"""`entry.export`: a run's networks as torch.export programs. Rolled out, they give the eager
rollout within 1e-5 (operator, and the consistency sampler with the same draws); they load and run
in a Python that never imports this project; a bad call is one line, exit 2, nothing written.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest
import torch

from core.steps.common import SampleNoise
from entry.config.errors import InputError
from entry.export import main as export_main
from entry.inference import load_run
from entry.inference.files import require_out
from pipelines.fields import SAMPLE_ID_STRIDE
from tests import tiny_run as tr
from tests.inference_runs import finished_run, tree_1d

STEPS = 4


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(surrogate, exported folder) of the tiny 1D run with a consistency model, exported by the command."""
    root = tmp_path_factory.mktemp("export")
    _, run_dir = finished_run(root, tree_1d(root))
    assert export_main(["--run", str(run_dir), "--out", str(root / "model")]) == 0
    return load_run(run_dir), root / "model"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.timeout(600)
def test_the_exported_rollout_equals_the_eager_one(exported):
    surrogate, folder = exported
    info = surrogate.task()
    meta = orjson.loads((folder / "meta.json").read_bytes())
    assert meta["channels"] == ["u"] and meta["grid"] == [32] and meta["task_id"] == 0
    assert meta["programs"] == ["decode", "encode", "refine", "step"] and meta["refine_noise_draws"] == 1
    encode, decode, step, refine = (torch.export.load(folder / f"{n}.pt2").module()
                                    for n in ("encode", "decode", "step", "refine"))
    u0 = torch.randn(3, 1, 32)  # any fields; a batch of 3, not the export's example 2
    dt, tid = torch.full((3,), info.time_step), torch.zeros(3, dtype=torch.int64)
    z = encode(u0)
    frames = []
    for _ in range(STEPS):
        z = step(z, dt, tid)
        frames.append(decode(z))
    eager = surrogate.rollout(u0[:, None], STEPS)[:, 1:]
    assert _rel(torch.stack(frames, 1), eager) < 1e-5
    # the sampler: the evaluation's draws for these samples, given to the program as an input
    ids = torch.arange(3)
    noise = SampleNoise(surrogate.config.training.seed, ids + 0 * SAMPLE_ID_STRIDE, torch.full((3,), -1))
    z = encode(u0)
    frames = []
    for _ in range(STEPS):
        draws = torch.stack([noise.normal(tuple(z.shape), dtype=z.dtype, device="cpu")
                             for _ in range(meta["refine_noise_draws"])])
        z = refine(step(z, dt, tid), dt, tid, draws)
        frames.append(decode(z))
    eager = surrogate.rollout(u0[:, None], STEPS, variant="operator+consistency")[:, 1:]
    assert _rel(torch.stack(frames, 1), eager) < 1e-5


@pytest.mark.timeout(300)
def test_the_programs_load_without_the_project(exported, tmp_path):
    surrogate, folder = exported
    u0 = torch.randn(2, 1, 32)
    torch.save(u0, tmp_path / "u0.pt")
    code = textwrap.dedent(f"""
        import sys, torch
        load = lambda name: torch.export.load("{folder}/" + name + ".pt2").module()
        encode, step, decode = load("encode"), load("step"), load("decode")
        z = encode(torch.load("u0.pt"))
        for _ in range({STEPS}):
            z = step(z, torch.full((2,), {surrogate.task().time_step!r}), torch.zeros(2, dtype=torch.int64))
        torch.save(decode(z), "u.pt")
        assert not {{"entry", "core", "pipelines"}} & set(sys.modules), sorted(sys.modules)
    """)
    # -I: PYTHONPATH ignored, no user site, no script folder on sys.path; cwd far from the checkout
    proc = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, env=tr.bare_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    eager = surrogate.rollout(u0[:, None], STEPS)[:, -1]
    assert _rel(torch.load(tmp_path / "u.pt"), eager) < 1e-5


def test_bad_calls_are_one_line_exit_2_and_write_nothing(exported, tmp_path, capsys):
    surrogate, folder = exported
    before = sorted(p.name for p in folder.iterdir())
    mtimes = [p.stat().st_mtime_ns for p in sorted(folder.iterdir())]
    assert export_main(["--run", str(surrogate.run_dir), "--out", str(folder)]) == 2  # exists, no --force
    unfinished = tmp_path / "unfinished"
    shutil.copytree(surrogate.run_dir, unfinished)
    (unfinished / "autoencoder.pt").unlink()
    assert export_main(["--run", str(unfinished), "--out", str(tmp_path / "m")]) == 2
    assert export_main(["--run", str(surrogate.run_dir), "--out", str(tmp_path / "no" / "m")]) == 2
    assert export_main(["--run", str(surrogate.run_dir), "--out", str(tmp_path / "m"), "--device", "gpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and "--force" in lines[0] and "autoencoder.pt" in lines[1], lines
    assert f"no folder {tmp_path / 'no'}" in lines[2] and "'gpu' is not a torch device" in lines[3], lines
    assert sorted(p.name for p in folder.iterdir()) == before
    assert [p.stat().st_mtime_ns for p in sorted(folder.iterdir())] == mtimes
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.*"))


def test_an_out_folder_that_takes_no_file_is_refused_before_any_work():
    if not Path("/proc/self").is_dir():
        pytest.skip("needs a /proc file system (Linux)")
    with pytest.raises(InputError, match=r"cannot write in /proc \("):
        require_out(Path("/proc/m.h5"), [Path("/proc/m.h5")], force=False)
