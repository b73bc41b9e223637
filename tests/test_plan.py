"""entry.plan: the simulated per-rank memory equals what a real gloo run allocates, its cost does
not grow with the simulated world size, and its arithmetic (sizes, largest batch) is right."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
import torch
import yaml

from entry.config.load import ConfigError
from entry.distributed.memory_sim import StepMemory
from entry.training.memory_plan import largest_micro_batch, parse_bytes
from tests import tiny_run as tr


def _config(tmp_path, *, precision: str = "fp32", accum: int = 1, parallel: str = "fsdp") -> str:
    """An operator big enough that activations dwarf the profiler's own allocations (~40 MB a step)."""
    tree = {
        "data": {"root": str(tmp_path / "data"),
                 "tasks": [{"name": "advection1d", "param": 0.1, "samples": 20, "nx": 32, "nt": 11}]},
        "latent": {"tokens": 64, "dim": 32, "hidden": 16},
        "operator": {"steps": 2, "batch_size": 32,
                     "pdet": {"hidden_dim": 64, "depths": [1, 1], "num_heads": 2, "group_size": 8}},
        "training": {"num_workers": 0, "parallel": parallel, "precision": precision, "accum_steps": accum},
        "stages": ["operator"],
        "logging": {"run_dir": str(tmp_path / "runs"), "plots": False, "wandb": {"mode": "disabled"}},
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def _plan(cfg: str, world_sizes: str, out, capsys) -> list[dict]:
    """entry.plan's records for `world_sizes`, from its `main` in this process (a process of its own
    would add ~4 CPU-seconds of imports to each plan)."""
    from entry.plan import main

    done = tr.run_here(main, ["--config", cfg, "--world-size", world_sizes, "--json", str(out)], capsys)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "largest micro-batch that fits" in done.stdout
    return orjson.loads(out.read_bytes())


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size, precision, accum, parallel",
                         [(1, "fp32", 1, "fsdp"), (2, "bf16", 2, "fsdp"), (2, "fp32", 1, "ddp")])
def test_plan_equals_a_real_gloo_run(tmp_path, capsys, world_size, precision, accum, parallel):
    """Parameter, gradient and optimizer bytes exactly; the activation peak within 25% of the
    CPU memory profiler's (tests/real_step_memory.py measures a real step on its own)."""
    cfg = _config(tmp_path, precision=precision, accum=accum, parallel=parallel)
    worker = ["-m", "tests.real_step_memory", cfg, str(tmp_path)]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}", *worker]
           if world_size > 1 else [sys.executable, *worker])
    real = subprocess.run(cmd, cwd=tr.ROOT, env=tr.env(), capture_output=True, text=True, timeout=300)
    assert real.returncode == 0, (real.stdout + real.stderr)[-3000:]
    measured = orjson.loads((tmp_path / "rank0.json").read_bytes())
    planned = _plan(cfg, str(world_size), tmp_path / "plan.json", capsys)[0]["stages"]["operator"]
    assert planned["micro_batch"] == measured["micro_batch"] == 32 // world_size // accum
    for key in ("parameters", "gradients", "optimizer"):
        assert planned[key] == measured[key], key
    assert abs(planned["activation_peak"] - measured["activation_peak"]) <= 0.25 * measured["activation_peak"], (
        planned["activation_peak"], measured["activation_peak"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plan_cost_is_independent_of_the_world_size(tmp_path, capsys):
    """8, 64 and 1024 simulated ranks dispatch the same operations (the cost of a plan; the time is
    a measurement, not a test): only the shard sizes change, and rank 0 holds at least 1/N."""
    plans = _plan(_config(tmp_path), "8,64,1024", tmp_path / "plan.json", capsys)
    stages = [p["stages"]["operator"] for p in plans]
    assert len({s["ops"] for s in stages}) == 1
    full = 4 * sum(p.numel() for p in _meta_operator(tmp_path).parameters())  # fp32 bytes, unsharded
    for n, s in zip((8, 64, 1024), stages):
        assert s["parameters"] >= full / n and s["optimizer"] >= 2 * full / n, n  # rank 0 holds the most
        assert s["largest_micro_batch"] > s["micro_batch"]
        assert s["all_gathered"] >= full and s["reduce_scattered"] >= full  # every parameter, every step
    assert stages[0]["parameters"] > stages[1]["parameters"] > stages[2]["parameters"]


def _meta_operator(tmp_path):
    import torch

    from entry.config.load import load_config
    from entry.models.build import build_operator

    with torch.device("meta"):
        return build_operator(load_config(tmp_path / "plan.yaml"))


def _memory(micro: int, step_peak: int, optimizer_peak: int = 0) -> StepMemory:
    return StepMemory(micro_batch=micro, parameters=0, frozen=0, gradients=0, optimizer=0, activation_peak=0,
                      step_peak=step_peak, optimizer_peak=optimizer_peak, all_gathered=0, reduce_scattered=0, ops=0)


def test_largest_micro_batch_extrapolates_the_two_peaks():
    at, twice = _memory(4, 1000 + 4 * 50), _memory(8, 1000 + 8 * 50)
    assert largest_micro_batch(at, twice, 1000 + 50 * 37) == 37
    assert largest_micro_batch(at, twice, 1000 + 50 * 37 + 49) == 37
    assert largest_micro_batch(at, twice, 999) == 0  # the fixed part alone does not fit
    assert largest_micro_batch(_memory(4, 1200, optimizer_peak=5000), twice, 4000) == 0
    assert largest_micro_batch(at, twice, 1000 + 50 * 37, offloaded=500) == 47


@pytest.mark.parametrize("text, expected", [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("24G", 24 * 2**30),
                                            ("81920MiB", 80 * 2**30), ("1.5 GiB", int(1.5 * 2**30)), ("4096", 4096)])
def test_gpu_memory_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "80 parsecs", "GiB", "-1GiB"])
def test_gpu_memory_refuses_what_is_not_a_size(text):
    with pytest.raises(ConfigError, match="--gpu-memory"):
        parse_bytes(text)


QUICKSTART = str(tr.ROOT / "configs" / "quickstart.yaml")


def test_the_quickstart_plans_at_two_ranks(tmp_path, capsys):
    """Bug 6: the quickstart's exact codec has nothing to train (no optimizer); its stage is planned
    as its forward alone, with zero gradients and optimizer state, and every other stage as before."""
    from entry.plan import main

    assert main(["--config", QUICKSTART, "--world-size", "2", "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "autoencoder: micro-batch 8 per rank" in out and "no optimizer step (nothing to train)" in out
    stages = orjson.loads((tmp_path / "plan.json").read_bytes())[0]["stages"]
    assert list(stages) == ["autoencoder", "operator", "diffusion", "consistency", "steady"]
    codec = stages["autoencoder"]
    assert codec["parameters"] == codec["gradients"] == codec["optimizer"] == codec["optimizer_steps"] == 0
    assert codec["activation_peak"] > 0 and codec["fits"]
    assert all(s["optimizer"] > 0 and s["optimizer_steps"] > 0 for name, s in stages.items() if name != "autoencoder")


def test_auto_plans_the_gpu_recipe_wherever_the_plan_runs(tmp_path, capsys):
    """`training.precision` / `training.compile` at `auto` are the GPUs' bf16 and compile in a plan for
    GPUs, also on a machine without one (it planned fp32, as `auto` runs on a CPU): the same plan as
    the explicit GPU recipe."""
    from entry.plan import main

    cfg = _config(tmp_path, precision="auto")
    plans = {}
    for name, sets in (("auto", []), ("gpu", ["--set", "training.precision=bf16", "--set", "training.compile=true"])):
        assert main(["--config", cfg, "--world-size", "2", "--json", str(tmp_path / f"{name}.json"), *sets]) == 0
        plans[name] = orjson.loads((tmp_path / f"{name}.json").read_bytes())
        out = capsys.readouterr().out
        assert "precision bf16" in out and "training.compile=true is not simulated" in out, out[:600]
    assert plans["auto"] == plans["gpu"]
    fp32 = tmp_path / "fp32.json"
    assert main(["--config", cfg, "--world-size", "2", "--json", str(fp32), "--set", "training.precision=fp32"]) == 0
    ops = plans["auto"][0]["stages"]["operator"], orjson.loads(fp32.read_bytes())[0]["stages"]["operator"]
    assert ops[0]["activation_peak"] < ops[1]["activation_peak"]  # bf16 activations are half the size


def test_the_steady_plan_steps_2d_tokens_and_the_cache_counts_them():
    """The steady prior's batch has `latent.tokens_2d` tokens (Darcy's), not the 1D `latent.tokens`."""
    from entry.config.load import load_config
    from entry.training.memory_plan import cache_bytes, stage_probe

    cfg = load_config(QUICKSTART)
    assert (cfg.latent.tokens, cfg.latent.tokens_2d, cfg.latent.dim) == (16, 64, 16)
    assert stage_probe(cfg, "steady").batch(3)["z_t"].shape == (3, 64, 16)
    assert stage_probe(cfg, "operator").batch(3)["z_t"].shape == (3, 16, 16)
    same = load_config(QUICKSTART, ["latent.tokens_2d=0"])
    darcy = next(t for t in cfg.data.tasks if t.name == "darcy2d")
    kept = darcy.samples - round(darcy.samples * cfg.data.split.test_fraction)
    assert cache_bytes(cfg) - cache_bytes(same) == kept * 2 * (64 - 16) * 16 * 4  # 2 frames: coefficient, solution


def test_the_moving_average_is_one_more_copy_of_the_weights():
    """`ema_decay` > 0 holds the average beside the model (sharded like it): its bytes are counted."""
    from entry.config.load import load_config
    from entry.training.memory_plan import plan_stages

    sets = ["stages=[operator]", "training.parallel=fsdp", "training.precision=fp32", "training.compile=false"]
    plain = plan_stages(load_config(QUICKSTART, sets), world_size=2)["stages"]["operator"]
    averaged = plan_stages(load_config(QUICKSTART, [*sets, "operator.ema_decay=0.99"]), world_size=2)
    averaged = averaged["stages"]["operator"]
    weights = plain["parameters"]
    assert averaged["frozen"] == plain["frozen"] + weights
    assert averaged["total_peak"] == plain["total_peak"] + weights


@pytest.mark.timeout(120)
def test_a_dry_run_plans_a_codec_with_nothing_to_train(tmp_path, capfd, monkeypatch):
    """Bug 6 through `entry.pipeline --dry-run` (its plan runs in a child process): an exact codec
    (`latent.hidden: 0`, `autoencoder.steps: 0`) is estimated and planned, exit 0. The plan is
    against the memory of the GPU the run has (a 24 GiB card here), not entry.plan's default 80 GiB."""
    import entry.pipeline
    from entry.pipeline import gpu_memory_of, main

    assert gpu_memory_of(torch.device("cpu")) is None  # a CPU run: entry.plan's default
    monkeypatch.setattr(entry.pipeline, "gpu_memory_of", lambda device: 24 * 2**30)
    tree = tr.tiny_tree(tmp_path)
    tree["latent"]["hidden"], tree["autoencoder"]["steps"], tree["stages"] = 0, 0, ["autoencoder", "cache", "operator"]
    (tmp_path / "codec.yaml").write_text(yaml.safe_dump(tree))
    assert main(["--config", str(tmp_path / "codec.yaml"), "--dry-run"]) == 0
    err = capfd.readouterr().err
    assert "autoencoder: 0.000 M parameters, no optimizer steps (fitted only)" in err, err[-3000:]
    assert "no optimizer step (nothing to train)" in err and "dry run: stopping" in err, err[-3000:]
    assert "GPU memory 24 GiB, usable 21.6 GiB" in err, err[-3000:]


@pytest.mark.parametrize("flow", ["dr2d", "swe2d", "ns2d"])
def test_the_2d_flows_plan_their_multichannel_fields(tmp_path, capsys, flow):
    """The codec's probe batch holds the flow's channels at its training grid (a 1-channel probe
    stopped the planner of a 2-channel task)."""
    from entry.config.load import load_config
    from entry.plan import main
    from entry.training.memory_plan import stage_probe

    path = str(tr.ROOT / "configs" / "reduced" / f"{flow}.yaml")
    cfg = load_config(path)
    channels = len(cfg.data.tasks[0].spec.channels)
    assert stage_probe(cfg, "autoencoder").batch(2)["u"].shape == (2, channels, 32, 32)
    assert main(["--config", path, "--world-size", "2"]) == 0
    assert "operator: micro-batch" in capsys.readouterr().out


def test_the_universal_mixture_plans_its_field_codec(capsys):
    """The field codec reads its batch's task to pick the fields; the plan's fake tensors hold no value it
    could read, so the probe's batch names the task on the host (a mixture of 1D and 2D tasks of 1, 2 and
    3 fields stopped the planner, and `entry.pipeline --dry-run` with it)."""
    from entry.plan import main

    path = str(tr.ROOT / "configs" / "universal" / "pretrain.yaml")
    assert main(["--config", path, "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "autoencoder: micro-batch" in out and "operator: micro-batch" in out, out[-2000:]


def test_refiners_trained_at_every_noise_level_plan(capsys):
    """`diffusion.continuous_levels` draws each sample's noise level on the device: the memory plan
    (fake tensors, no value can be read back) simulates its step as it does the others'."""
    from entry.plan import main

    path = str(tr.ROOT / "configs" / "reduced" / "ns2d_kolmogorov.yaml")
    assert main(["--config", path, "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "diffusion: micro-batch" in out and "consistency: micro-batch" in out, out[-2000:]
