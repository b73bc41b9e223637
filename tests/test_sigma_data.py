"""The diffusion refiner's sigma_data: measured from the operator's residual when the diffusion
stage starts (`diffusion.sigma_data: 0`), stored in the weights, reused by the consistency
stage and the evaluation.

A tiny run (tests/tiny_run.py): generated data, a seeded encoder and its cache, and a seeded,
untrained operator with random output layers (not the identity), whose residual is what the
refiner would model. Stages run in this process at world size 1 on the CPU.

Legend: N pairs, L tokens, D latent dim.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import yaml

from core.models.denoiser import SIGMA_DATA_KEY
from tests import tiny_run as tr

PDET = {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2, "group_size": 2}
CPU = dict(local_rank=0, device=torch.device("cpu"), backend=None, restart_count=0)


def _info(rank: int = 0, world_size: int = 1):
    from entry.distributed.process_group import DistInfo

    return DistInfo(rank=rank, world_size=world_size, **CPU)


def _config(root, **diffusion):
    from entry.config.load import load_config

    tree = tr.tiny_tree(root)
    tree["diffusion"] = {"steps": 3, "batch_size": 8, "lr": 1e-3, "noise_levels": 2, "sigma_min": 1e-3,
                         "pdet": PDET, **diffusion}
    tree["consistency"] = {"steps": 2, "batch_size": 8, "lr": 1e-4}
    path = root / f"sd_{len(diffusion)}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return load_config(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(root, cfg, true residual RMS and std over every training pair) after the diffusion and
    consistency stages ran with sigma_data 0."""
    from core.steps.diffusion import attach_operator_prediction
    from entry.stages.record import stage_spec
    from entry.data.cache_plan import cache_plan, open_cache
    from entry.storage.run_folder import run_dir_for
    from entry.models.build import build_operator
    from entry.training.runner import execute_stage
    from entry.training.stage_record import weights_file
    from pipelines.datasets import LatentPairs

    root = tmp_path_factory.mktemp("sigma_data")
    tr.prepare(root)
    cfg = _config(root)
    torch.manual_seed(1)
    op = build_operator(cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in op.parameters():
            if not p.any():  # zero-initialised output layers: the fresh operator is the identity
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    torch.save(op.state_dict(), weights_file(run_dir_for(cfg), "operator"))

    pairs = LatentPairs(open_cache(cache_plan(cfg, "dynamic", "train")), horizon_k=cfg.operator.horizon)
    batch = pairs.gather(torch.arange(len(pairs)))
    r_NLD = batch["z_next"] - attach_operator_prediction(op.eval(), batch)["z_op"]
    truth = {"rms": r_NLD.square().mean().sqrt().item(), "std": r_NLD.std().item(), "pairs": len(pairs)}

    deterministic = torch.are_deterministic_algorithms_enabled()
    try:  # the tiny config asks for deterministic kernels; leave the process as it was
        for stage in (stage_spec("diffusion"), stage_spec("consistency")):
            assert execute_stage(cfg, _info(), stage, resume=False) == 0
    finally:
        torch.use_deterministic_algorithms(deterministic)
    return root, cfg, truth


def _stored(cfg, stage: str) -> float:
    from entry.storage.run_folder import run_dir_for
    from entry.training.stage_record import weights_file

    state = torch.load(weights_file(run_dir_for(cfg), stage), map_location="cpu", weights_only=True)
    return state[SIGMA_DATA_KEY].item()


def test_diffusion_stage_measures_the_residual_rms(run):
    from entry.storage.run_folder import run_dir_for

    _, cfg, truth = run
    measured = _stored(cfg, "diffusion")
    # A subset of the pairs (MEASURE_BATCHES global batches, evenly spaced) is measured.
    assert measured == pytest.approx(truth["rms"], rel=0.05)
    assert measured == pytest.approx(truth["std"], rel=0.1)
    log = (run_dir_for(cfg) / "rank0.log").read_text()
    assert f"diffusion: sigma_data {measured:.4g} (the operator's residual RMS" in log


def test_measurement_is_the_stored_value_and_independent_of_the_world_size(run, monkeypatch):
    from entry.stages import diffusion
    from entry.storage.run_folder import run_dir_for
    from entry.models.build import build_operator
    from entry.models.weights import load_frozen
    from entry.training.stage_record import weights_file

    _, cfg, _ = run
    op = load_frozen(lambda: build_operator(cfg), weights_file(run_dir_for(cfg), "operator"), _info())
    one, pairs = diffusion.measure_sigma_data(cfg, _info(), op)
    assert one == _stored(cfg, "diffusion")  # exact: float32-rounded, as the buffer holds it
    assert pairs == min(diffusion.MEASURE_BATCHES * cfg.diffusion.batch_size, run[2]["pairs"])
    # Two ranks without a process group: capture each rank's sums, then average them as the
    # collective would. Same pairs in all, so the same value up to float64 summation order.
    sums = []
    monkeypatch.setattr(diffusion, "all_reduce_mean", lambda v, info: sums.append(v.clone()) or v)
    for rank in (0, 1):
        diffusion.measure_sigma_data(cfg, _info(rank, 2), op)
    assert sums[0][1] + sums[1][1] == pairs * cfg.latent.tokens * cfg.latent.dim  # split, not repeated
    total, count = torch.stack(sums).mean(0).tolist()
    assert math.sqrt(total / count) == pytest.approx(one, rel=1e-6)


def test_consistency_stage_and_evaluation_use_the_teachers_sigma_data(run):
    from entry.stages import consistency
    from entry.evaluation.variants import load_models
    from entry.storage.run_folder import run_dir_for
    from entry.training.stage_record import weights_file

    _, cfg, _ = run
    measured = _stored(cfg, "diffusion")
    assert _stored(cfg, "consistency") == measured
    run_dir = run_dir_for(cfg)
    parts = consistency.build(cfg, _info(), run_dir, logging.getLogger("test"))
    try:
        assert parts.step_cfg.sigma_data == measured
        assert parts.model.sigma_data == measured
        assert parts.frozen["teacher"].sigma_data == parts.frozen["target"].sigma_data == measured
    finally:
        parts.loader.close()
    models = load_models(cfg, {s: weights_file(run_dir, s) for s in ("diffusion", "consistency")}, _info())
    assert models["diffusion"].sigma_data == models["consistency"].sigma_data == measured


def test_configured_sigma_data_is_used_as_given_and_a_coarse_sigma_min_warns(run, caplog):
    from entry.stages import diffusion
    from entry.storage.run_folder import run_dir_for

    root, _, _ = run
    cfg = _config(root, sigma_data=5e-4)  # below sigma_min = 1e-3
    with caplog.at_level(logging.INFO, logger="test.sd"):
        parts = diffusion.build(cfg, _info(), run_dir_for(cfg), logging.getLogger("test.sd"))
    try:
        expected = float(torch.tensor(5e-4, dtype=torch.float32))
        assert parts.step_cfg.sigma_data == parts.model.sigma_data == expected
    finally:
        parts.loader.close()
    assert "(diffusion.sigma_data)" in caplog.text
    assert any(r.levelno == logging.WARNING and "sigma_min" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value", [-1.0, float("nan")])
def test_negative_sigma_data_is_refused(value):
    from entry.config.schema import DiffusionConfig

    with pytest.raises(ValueError, match="sigma_data"):
        DiffusionConfig(sigma_data=value)
