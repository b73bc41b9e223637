"""Every stage is defined once (entry.stages.record.STAGES), and the pipeline, the planner, the
dry-run estimate, the stage hashes and the evaluation read that record; what the planner and the
estimate probe is what training runs: the same step settings and the same batch shapes (issue 25, item 1: the steady
prior's 2D tokens and the operator's unroll had drifted)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from entry.config.identity import math_hash
from entry.config.load import ConfigError, config_to_dict, hashed_tree, load_config
from entry.config.schema import STAGE_NAMES
from entry.distributed.process_group import DistInfo
from entry.stages import record as stages
from entry.training.stage_record import STAGE_INPUT_WEIGHTS, STAGE_SECTIONS, stage_hash
from tests import tiny_run as tr

INFO = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)


def test_the_record_lists_every_stage_and_the_tables_are_read_from_it(tmp_path):
    assert [s.name for s in stages.STAGES] + ["evaluate"] == list(STAGE_NAMES)
    assert stages.TRAINING_STAGES == tuple(s.name for s in stages.STAGES if s.section is not None)
    assert STAGE_SECTIONS == {s.name: s.sections for s in stages.STAGES}
    assert STAGE_INPUT_WEIGHTS == {s.name: s.weights_read for s in stages.STAGES}
    cfg = load_config(tree=tr.tiny_tree(tmp_path))
    for spec in stages.STAGES:
        assert stage_hash(cfg, spec.name) == math_hash(cfg, spec.sections)
        assert set(spec.reads) <= set(stages.SPECS[d].name for d in spec.reads)  # reads name stages
        if spec.trains:
            assert spec.step_config is not None and spec.probe is not None, spec.name
    # What a command builds first follows `reads`, transitively, in the record's order.
    assert stages.input_stages(cfg, "consistency") == ["autoencoder", "cache", "operator", "diffusion"]


def test_each_stage_is_built_averaged_and_predicted_as_its_record_says(tmp_path):
    """The record holds each training stage's build, the cache it trains on and whether it keeps a
    weight average (the config refuses `ema_decay` on a stage that keeps none); the evaluation's
    variants and the accuracy benchmark's stage tables are read from it."""
    from bench.accuracy_scores import VARIANT_STAGES
    from entry.evaluation.variants import STOCHASTIC, variant_name

    tree = tr.tiny_tree(tmp_path)
    for spec in stages.STAGES:
        assert (spec.build is not None) == spec.trains, spec.name
        assert spec.cache_kind in (("dynamic", "steady") if spec.reads == ("cache",) or spec.refines else ("",))
        if not spec.trains:
            continue
        averaged = {**tree, spec.name: {**tree.get(spec.name, {}), "ema_decay": 0.9}}
        if spec.averages:
            assert spec.section(load_config(tree=averaged)).ema_decay == 0.9
        else:
            with pytest.raises(ConfigError, match="ema_decay"):
                load_config(tree=averaged)
    assert STOCHASTIC == ("operator+diffusion", "operator+consistency", "steady")
    assert list(VARIANT_STAGES) == [variant_name(s) for s in stages.STAGES if s.predict is not None]
    assert VARIANT_STAGES["operator+consistency"] == ("autoencoder", "cache", "operator", "diffusion", "consistency")


def test_the_planner_and_the_estimate_probe_through_the_record(tmp_path, monkeypatch):
    from entry.training.memory_plan import plan_stages
    from entry.training.estimate import estimate_run

    tr.prepare(tmp_path)
    cfg = load_config(tmp_path / "tiny.yaml", overrides=["stages=[operator]", "training.precision=fp32",
                                                        "training.compile=false"])
    probed = []
    spec = stages.SPECS["operator"]

    def probe(c):
        probed.append(c)
        return spec.probe(c)

    monkeypatch.setitem(stages.SPECS, "operator", dataclasses.replace(spec, probe=probe))
    plan = plan_stages(cfg, world_size=1)
    assert list(plan["stages"]) == ["operator"] and len(probed) == 1
    lines = estimate_run(cfg, INFO)
    assert lines[0].startswith("operator:") and len(probed) == 2


def _probed_like_trained(stage: str, cfg, parts):
    """(the stage's probe, the first batch its real build's loader gives, the probe's batch of that size)."""
    try:
        trained = next(iter(parts.loader))
    finally:
        parts.loader.close()
    probe = stages.stage_spec(stage).probe(cfg)
    return probe, trained, probe.batch(trained.batch_size[0])


@pytest.mark.timeout(120)
def test_the_operator_probe_is_what_training_runs(tmp_path):
    """With unrolled training the probed batch carries the unrolled targets, and the step settings
    are the build's own (the estimate timed a default OperatorStepConfig before)."""
    from entry.stages.operator import build

    tree = tr.tiny_tree(tmp_path)
    tree["operator"].update(unroll_steps=3, input_noise=0.01, unroll_grad="pushforward")
    tr.prepare(tmp_path, tree)
    cfg = load_config(tmp_path / "tiny.yaml")
    parts = build(cfg, INFO, tmp_path / "runs" / "base", logging.getLogger("test"))
    probe, trained, probed = _probed_like_trained("operator", cfg, parts)
    assert probe.step_cfg == parts.step_cfg
    assert {k: v.shape for k, v in probed.items()} == {k: v.shape for k, v in trained.items()}
    assert probed["z_seq"].shape[1] == 3


@pytest.mark.timeout(120)
def test_the_steady_probe_steps_the_2d_tokens_training_steps(tmp_path):
    from entry.data.latent_cache import build_cache
    from entry.stages.steady import build
    from entry.storage.run_folder import run_dir_for
    from entry.models.build import build_autoencoder
    from entry.training.stage_record import weights_file
    from pipelines.generate import generate_task

    path = generate_task("darcy2d", 12, tmp_path / "data", nx=16, param=1.0)
    cfg = load_config(tree={
        "data": {"tasks": [{"name": "darcy2d", "param": 1.0, "nx": 16, "path": str(path)}]},
        "latent": {"tokens": 4, "tokens_2d": 16, "dim": 8},
        "steady": {"batch_size": 4, "noise_levels": 2,
                   "pdet": {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2, "group_size": 4}},
        "training": {"cache_dir": str(tmp_path / "cache"), "num_workers": 0},
        "logging": {"run_dir": str(tmp_path / "runs"), "run_name": "d", "wandb": {"mode": "disabled"}}})
    torch.manual_seed(0)
    weights = weights_file(run_dir_for(cfg), "autoencoder")
    weights.parent.mkdir(parents=True)
    torch.save(build_autoencoder(cfg).state_dict(), weights)
    build_cache(cfg, INFO, logging.getLogger("test"), "steady", "train")
    parts = build(cfg, INFO, run_dir_for(cfg), logging.getLogger("test"))
    probe, trained, probed = _probed_like_trained("steady", cfg, parts)
    assert probed["z_t"].shape == trained["z_t"].shape and trained["z_t"].shape[1] == 16  # tokens_2d, not tokens
    assert probe.step_cfg == parts.step_cfg


def test_a_decoded_loss_the_loader_cannot_feed_is_not_a_config_key(tmp_path):
    tree = {**tr.tiny_tree(tmp_path), "stages": ["operator"]}
    with pytest.raises(ConfigError, match="unknown key 'operator.decoded_loss_weight'"):
        load_config(tree=tree, overrides=["operator.decoded_loss_weight=0.5"])
    with pytest.raises(ConfigError, match="unknown key 'operator.decoded_loss_weight'"):
        load_config(tree={**tree, "operator": {**tree.get("operator", {}), "decoded_loss_weight": 0.0}})
    cfg = load_config(tree=tree)
    assert stages.stage_spec("operator").step_config(cfg).decoded_loss_weight == 0
    assert "decoded_loss_weight" not in config_to_dict(cfg)["operator"]
    # Hashed as every config had it before it went, so recorded runs keep their hashes.
    assert hashed_tree(cfg)["operator"]["decoded_loss_weight"] == 0.0


def test_the_autoencoder_trains_and_probes_the_loss_its_config_names(tmp_path):
    cfg = load_config(tree=tr.tiny_tree(tmp_path), overrides=["autoencoder.loss=nrmse"])
    assert stages.stage_spec("autoencoder").step_config(cfg).loss == "nrmse"
    assert stages.stage_spec("autoencoder").probe(cfg).step_cfg.loss == "nrmse"
    assert stages.stage_spec("autoencoder").step_config(load_config(tree=tr.tiny_tree(tmp_path))).loss == \
        "squared_relative"


def test_the_evaluation_loads_what_the_record_says(tmp_path, monkeypatch):
    """Which weights an evaluation needs, and how it builds the models they load into, come from
    the record (`StageSpec.evaluated`, `StageSpec.model`)."""
    from entry.evaluation.variants import load_models, required_weights
    from entry.training.checkpoint import export_weights

    cfg = load_config(tree=tr.tiny_tree(tmp_path))
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ConfigError, match="autoencoder"):
        required_weights(cfg, run)  # required by the record, missing
    for name in ("autoencoder", "operator"):
        export_weights(stages.stage_spec(name).model(cfg), run / f"{name}.pt", INFO)
        (run / f"{name}.model.json").unlink()  # as weights exported before descriptions: built from the record
    assert set(required_weights(cfg, run)) == {"autoencoder", "operator"}  # diffusion is optional, absent
    built = []
    spec = stages.SPECS["operator"]
    monkeypatch.setitem(stages.SPECS, "operator",
                        dataclasses.replace(spec, model=lambda c: built.append(c) or spec.model(c)))
    models = load_models(cfg, required_weights(cfg, run), INFO)
    assert set(models) == {"autoencoder", "operator"} and len(built) == 1
    # training.compile "auto", unresolved as load_config leaves it, is eager on a CPU (it was truthy:
    # every block compiled); an explicit true compiles the blocks.
    compiled = lambda ms: {any("_orig_mod" in n for n, _ in m.named_modules()) for m in ms.values()}  # noqa: E731
    assert cfg.training.compile == "auto" and compiled(models) == {False}
    on = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, compile=True))
    assert compiled(load_models(on, required_weights(cfg, run), INFO)) == {True}


def test_the_estimate_takes_the_fastest_step_as_quiet_and_says_when_the_spread_is_wide():
    from entry.training.estimate import step_time_text

    quiet, low, high = step_time_text([0.10, 0.11, 0.12], steps=100, max_train_s=0)
    assert (low, high) == pytest.approx((10.0, 11.0)) and "noisy" not in quiet and "100.0 ms/step quiet" in quiet
    busy, low, high = step_time_text([0.10, 0.60, 7.3], steps=1000, max_train_s=300)
    assert (low, high) == pytest.approx((100.0, 300.0)) and "noisy" in busy and "capped by training.max_train_s" in busy


def test_a_stage_that_one_step_says_is_short_is_timed_once_and_a_long_one_in_full():
    from entry.training.estimate import MIN_TIMED_STEPS, _time_steps, step_time_text

    weight = torch.nn.Parameter(torch.ones(3))
    model = torch.nn.Module()
    model.weight = weight
    calls = []

    def step_fn(model, params, batch, *, cfg, generator):
        calls.append(1)
        return (params["weight"] ** 2).sum(), None

    def timed(stage_steps):
        calls.clear()
        seconds = _time_steps(step_fn, model, torch.zeros(1), None, {}, stage_steps=stage_steps)
        return seconds, len(calls)

    # One step of this model takes far under 30 s and far over 30 s / 10**12: no machine is that fast or slow.
    short, n = timed(1)
    assert len(short) == 1 and n == 2  # the warm-up call and one timed step
    assert "one step timed: a short stage" in step_time_text(short, 1, 0)[0]
    long, n = timed(10**12)
    assert len(long) >= MIN_TIMED_STEPS and n == len(long) + 1
    assert len(timed(None)[0]) >= MIN_TIMED_STEPS  # no stage length given (the race's calibration): in full
