"""`python -m bench.epoch_time` end to end at the config's small CPU size (no timing asserted)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "bench_burgers.yaml"


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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.epoch_time", "--config", str(CONFIG), *small_overrides(tmp_path),
         "--max-steps", "4", "--warmup-steps", "1", "--profile", str(tmp_path / "trace"), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = list(out.glob("*-epoch_time.json"))
    assert len(files) == 1
    r = orjson.loads(files[0].read_bytes())
    assert files[0].name == f"{r['device']}-{r['date']}-epoch_time.json" and r["device"].startswith("cpu")
    for key in ("config_hash", "git_commit", "environment", "encoder", "warmup", "flops_per_step", "ratios"):
        assert key in r
    assert "freshly initialised" in r["encoder"]  # no trained encoder in tmp_path: made by the bench
    assert r["flops_per_step"] > 0 and r["parameters"] > 0 and r["warmup"]["seconds"] > 0
    for name in ("pipeline", "bound", "baseline"):
        s = r[name]
        assert s["epoch_s"] > 0 and s["samples_per_s"] > 0 and s["timed_steps"] == 4
        assert 0 <= s["data_wait_fraction"] <= 1
        assert s["peak_memory_gib"] is None and s["mfu"] is None  # no GPU: absent, not zero
        assert s["gpu_util"]["util_pct_mean"] is None and s["gpu_util"]["note"]
    assert all(math.isfinite(v) and v > 0 for v in r["ratios"].values())
    assert r["gpu"] is False and "no GPU" in r["gpu_note"] and "no GPU" in proc.stdout
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
