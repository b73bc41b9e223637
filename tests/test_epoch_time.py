"""`python -m bench.epoch_time` end to end at the config's small CPU size (no timing asserted)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
from tests import tiny_run as tr

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "bench_burgers.yaml"
ROUNDS = 3


def small_overrides(root: Path) -> list[str]:
    """The `--set` line documented in configs/bench_burgers.yaml, under `root`."""
    sets = [f"data.root={root / 'data'}", "data.tasks.0.samples=32", "data.tasks.0.nx=128", "data.tasks.0.nt=21",
            "latent.tokens=16", "latent.dim=16", "latent.hidden=16", "operator.pdet.hidden_dim=32",
            "operator.pdet.depths=[1,1]", "operator.pdet.num_heads=2", "operator.pdet.group_size=4",
            "operator.batch_size=16", "training.precision=fp32", "training.compile=false",
            "training.num_workers=0", f"training.cache_dir={root / 'cache'}", f"logging.run_dir={root / 'runs'}"]
    return [a for s in sets for a in ("--set", s)]


def test_small_config_line_is_documented():
    header = CONFIG.read_text()
    for s in small_overrides(Path("ROOT")):
        if s != "--set":
            assert s in header or f"'{s}'" in header, s


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_command_writes_well_formed_json(tmp_path):
    out = tmp_path / "results"
    env = {**tr.env(), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.epoch_time", "--config", str(CONFIG), *small_overrides(tmp_path),
         "--max-steps", "4", "--warmup-steps", "1", "--rounds", str(ROUNDS), "--profile", str(tmp_path / "trace"),
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = list(out.glob("*-epoch_time.json"))
    assert len(files) == 1
    r = orjson.loads(files[0].read_bytes())
    assert files[0].name == f"{r['device']}-{r['date']}-epoch_time.json" and r["device"].startswith("cpu")
    for key in ("config_hash", "git_commit", "dirty", "processor", "environment", "encoder", "warmup", "flops_per_step", "ratios"):
        assert key in r
    assert "freshly initialised" in r["encoder"]  # no trained encoder in tmp_path: made by the bench
    assert r["flops_per_step"] > 0 and r["parameters"] > 0 and r["warmup"]["seconds"] > 0
    assert r["rounds"] == ROUNDS and r["precision"] == "fp32" and r["compile"] is False
    epoch_s = {}
    for name in ("pipeline", "bound", "baseline"):
        s, q = r[name], r[name]["s_per_step"]
        assert s["samples_per_s"] > 0 and s["timed_steps"] == 4 * ROUNDS
        assert len(q["rounds"]) == ROUNDS and q["min"] <= q["median"] <= q["max"] and q["min"] > 0
        assert q["median"] == sorted(q["rounds"])[1]  # three rounds: the middle one
        assert math.isclose(s["epoch_s"], q["median"] * s["steps_per_epoch"])
        assert 0 <= s["data_wait_fraction"] <= 1
        assert s["peak_memory_gib"] is None and s["mfu"] is None  # no GPU: absent, not zero
        assert s["gpu_util"]["util_pct_mean"] is None and s["gpu_util"]["note"]
        epoch_s[name] = [x * s["steps_per_epoch"] for x in q["rounds"]]
    # Interleaved: round k of every section runs before round k + 1 of any.
    starts = [r[name]["round_start_s"][k] for k in range(ROUNDS) for name in ("pipeline", "bound", "baseline")]
    assert starts == sorted(starts)
    for key, (a, b) in {"pipeline_over_bound": ("pipeline", "bound"),
                        "baseline_over_pipeline": ("baseline", "pipeline")}.items():
        q = r["ratios"][key]
        assert q["rounds"] == pytest.approx([x / y for x, y in zip(epoch_s[a], epoch_s[b])], rel=1e-12)
        assert q["min"] <= q["median"] <= q["max"]
        assert q["spread_exceeds_effect"] == (q["max"] - q["min"] > abs(q["median"] - 1))
        verdict = "not resolved on this machine" if q["spread_exceeds_effect"] else "spread smaller than the effect"
        assert verdict in proc.stdout
    assert r["gpu"] is False and "no GPU" in r["gpu_note"] and "no GPU" in proc.stdout
    assert r["gpu_util_note"] is None  # only on a GPU: utilisation that could not be sampled
    assert r["peak_bf16_flops"] is None
    assert Path(r["profile"]).is_file()
    assert str(files[0]) in proc.stdout


def test_sampler_without_gpu_reports_absent():
    from bench.nvml import GpuSampler

    with GpuSampler(torch.device("cpu")) as gpu:
        pass
    res = gpu.result()
    assert res["available"] is False and res["util_pct_mean"] is None and "no GPU" in res["note"]
    with pytest.raises(ValueError):
        GpuSampler(torch.device("cpu"), hz=5)


def test_peak_table():
    from bench.epoch_time import peak_flops, peak_for_name

    assert peak_flops(torch.device("cpu"))[0] is None
    assert peak_for_name("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert peak_for_name("NVIDIA H100 PCIe")[0] == 756e12
    assert peak_for_name("NVIDIA H200")[0] == 989e12
    assert peak_for_name("NVIDIA A100-SXM4-80GB")[0] == 312e12
    peak, note = peak_for_name("NVIDIA H100 NVL")
    assert peak is None and "unknown" in note


def test_sampler_polls_a_fake_nvml(monkeypatch):
    """The thread samples at >= 10 Hz and reports mean/min/max and max memory."""
    import time
    import types

    from bench.nvml import GpuSampler

    readings = iter([10, 50, 90] * 1000)
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=next(readings)),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=2**30))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with GpuSampler(torch.device("cuda", 0), hz=50) as gpu:
        time.sleep(0.3)
    res = gpu.result()
    assert res["available"] and res["samples"] >= 3 and res["sample_hz"] >= 10
    assert res["util_pct_min"] == 10 and res["util_pct_max"] == 90 and res["memory_used_gib_max"] == 1.0


def test_bad_arguments_are_a_user_error(tmp_path):
    from bench.epoch_time import main

    assert main(["--config", str(CONFIG), "--epochs-timed", "0", "--out", str(tmp_path)]) == 2
    assert main(["--config", str(CONFIG), "--rounds", "0", "--out", str(tmp_path)]) == 2


def test_spread_and_ratio():
    from bench.epoch_time import ratio, spread

    assert spread([3.0, 1.0, 2.0]) == {"rounds": [3.0, 1.0, 2.0], "min": 1.0, "median": 2.0, "max": 3.0}
    assert spread([4.0, 1.0, 2.0, 3.0])["median"] == 2.5
    clear = ratio([2.2, 1.8, 2.0], [1.0, 1.0, 1.0])  # spread 0.4, effect 1.0: resolved
    assert clear["median"] == 2.0 and clear["spread_exceeds_effect"] is False
    noisy = ratio([1.2, 0.9, 1.05], [1.0, 1.0, 1.0])  # spread 0.3, effect 0.05: not resolved
    assert noisy["median"] == 1.05 and noisy["spread_exceeds_effect"] is True
    with pytest.raises(ValueError):
        ratio([1.0, 2.0], [1.0])


def test_sampler_without_pynvml_says_how_to_install_it(monkeypatch):
    """On a GPU machine without the gpu extra, utilisation is null and the note names the fix."""
    from bench.nvml import GpuSampler

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with GpuSampler(torch.device("cuda", 0)) as gpu:
        pass
    res = gpu.result()
    assert res["available"] is False and res["util_pct_mean"] is None
    assert "pynvml is not installed" in res["note"] and ".[gpu]" in res["note"]


def test_sampler_covers_every_round(monkeypatch):
    """Entered once per round, a sampler's figures span all its rounds."""
    import time
    import types

    from bench.nvml import GpuSampler

    readings = iter([10, 90] * 1000)
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=next(readings)),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=2**30))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpu = GpuSampler(torch.device("cuda", 0), hz=50)
    counts = []
    for _ in range(2):
        with gpu:
            time.sleep(0.2)
        counts.append(gpu.result()["samples"])
    assert 0 < counts[0] < counts[1]
    assert gpu.result()["util_pct_min"] == 10 and gpu.result()["util_pct_max"] == 90
