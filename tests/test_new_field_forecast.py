"""New fields fitted by the source operator's forecast (`finetune.new_fields: forecast`): the codec's
step on pairs of frames adds the error of decode(operator(encode(u_t))) against u_next to the
reconstruction; a fine-tuned run trains that way on 1 and 2 processes (DDP, FSDP2), records the
source operator among its inputs, and a source or data it cannot serve are refused with one line.
"""

from __future__ import annotations

import shutil

import orjson
import pytest
import torch
from tensordict import TensorDict

from core.models.registry import build
from core.steps.autoencoder import AutoencoderStepConfig, autoencoder_step
from entry.config.load import ConfigError, load_config
from entry.models.build import build_autoencoder
from entry.stages.stage_build import from_source
from entry.training.finetune import check_source
from tests.test_field_codec_stack import fine_tune, train_fields_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fields_run(tmp_path_factory):
    """The source run: tests.test_field_codec_stack's `fields_tree` trained (codec, cache, operator,
    evaluation); -> (its root, its config file)."""
    return train_fields_run(tmp_path_factory.mktemp("fields"))


class HalfStep(torch.nn.Module):
    """A stand-in operator: z -> z * (1 - dt) + the task id / 10 (frozen, no parameters)."""

    def forward(self, z, dt, task_id):
        return z * (1 - dt[:, None, None]) + task_id[:, None, None] / 10


def _relative(u_hat, u):
    return (u_hat - u).square().flatten(1).mean(1) / (u.square().flatten(1).mean(1) + 1e-8)


def test_a_step_on_pairs_adds_the_decoded_forecast_through_the_frozen_operator_to_the_reconstruction():
    """The loss of a pair batch is the mean over frames of the squared relative error of the reconstruction
    of u_t plus that of decode(operator(encode(u_t))) against u_next, computed here by the codec's halves
    (not its forward); without the operator a pair batch is refused."""
    torch.manual_seed(0)
    codec = build("codec", "fields", datasets=[["flow", ["a", "b"]]], dim=8, tokens={"2": 16}, modes={"2": 4},
                  hidden=16, depth=1, heads=2, tasks=["flow"])
    for p in codec.decoder.head.parameters():  # a fresh decoder returns zeros: give every output a say
        torch.nn.init.normal_(p, std=0.2)
    u_t, u_next = torch.randn(3, 2, 16, 16), torch.randn(3, 2, 16, 16)
    batch = TensorDict({"u_t": u_t, "u_next": u_next, "dt": torch.tensor([0.1, 0.2, 0.3]),
                        "task_id": torch.zeros(3, dtype=torch.long), "sample_id": torch.arange(3)}, batch_size=[3])
    loss, metrics = autoencoder_step(codec, dict(codec.named_parameters()), batch, cfg=AutoencoderStepConfig(),
                                     operator=HalfStep())
    with torch.no_grad():
        z = codec.encode(u_t, "flow")
        rec = codec.decode(z, "flow", (16, 16))
        nxt = codec.decode(HalfStep()(z, batch["dt"], batch["task_id"]), "flow", (16, 16))
    expected = (_relative(rec, u_t) + _relative(nxt, u_next)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["forecast_rel_mse"].item() == pytest.approx(_relative(nxt, u_next).mean().item(), rel=1e-5)
    with pytest.raises(ValueError, match="needs the frozen operator"):
        autoencoder_step(codec, dict(codec.named_parameters()), batch, cfg=AutoencoderStepConfig())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("parallel,freeze", [("none", True), ("ddp", True), ("fsdp", True), ("none", False)])
def test_new_fields_fitted_by_the_forecast_train_on_pairs_through_the_source_operator(fields_run, tmp_path,
                                                                                      parallel, freeze):
    """A codec meeting a new field (ns2d's vorticity) with `new_fields: forecast`: the codec trains on
    pairs, its loss holding the forecast through the source's operator (logged as forecast_rel_mse); the
    new embeddings moved, the source operator's fingerprint recorded as an input of the codec; frozen
    (`finetune.freeze: [autoencoder]`), the source's weights published bit for bit, on one rank and on
    two under DDP and FSDP2; not frozen, the source's weights trained too."""
    root, _ = fields_run
    source = root / "runs" / "fields"
    run, cfg_path = fine_tune(source, tmp_path, {"name": "ns2d", "param": 0.001, "samples": 12, "nx": 16,
                                                 "resolution": 32, "nt": 6}, "forecast",
                              ranks=1 if parallel == "none" else 2, training={"parallel": parallel},
                              operator={"steps": 2}, finetune={"freeze": ["autoencoder"] if freeze else [],
                                                               "new_lr_scale": 10, "new_fields": "forecast"})
    assert "fitted by reconstruction and the source operator's forecast" in (run / "rank0.log").read_text()
    theirs = torch.load(source / "autoencoder.pt", weights_only=True)
    mine = torch.load(run / "autoencoder.pt", weights_only=True)
    moved = {k for k, v in theirs.items() if not torch.equal(mine[k], v)}
    assert moved == set() if freeze else {"encoder.out.weight", "decoder.inp.weight"} <= moved
    cfg = load_config(cfg_path)
    start = from_source(lambda: build_autoencoder(cfg), cfg, "autoencoder")().state_dict()
    assert all(not torch.equal(mine[k], start[k]) for k in ("encoder.embed.f_vorticity", "decoder.embed.f_vorticity"))
    rows = [orjson.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    forecast = [r["forecast_rel_mse"] for r in rows if r.get("stage") == "autoencoder" and "forecast_rel_mse" in r]
    assert forecast and all(v > 0 for v in forecast)
    done = orjson.loads((run / "autoencoder.done.json").read_bytes())
    assert set(done["inputs"]["source"]) == {"autoencoder", "operator"}


def test_a_source_without_an_operator_or_a_steady_task_is_refused_with_one_line(fields_run, tmp_path):
    """`new_fields: forecast` from a source that trained no operator, or with a steady task among the new
    data: one line naming the fix, before anything is written; without `finetune.from`, the config is refused."""
    root, _ = fields_run
    codec_only = tmp_path / "codec-only"
    shutil.copytree(root / "runs" / "fields", codec_only, ignore=shutil.ignore_patterns("checkpoints"))
    recorded = orjson.loads((codec_only / "config.json").read_bytes())
    recorded["config"]["stages"] = ["autoencoder"]
    (codec_only / "config.json").write_bytes(orjson.dumps(recorded))
    logging = {"run_dir": str(tmp_path / "runs"), "run_name": "ft"}
    new = {"name": "ns2d", "param": 0.001, "samples": 12, "nx": 16, "resolution": 32, "nt": 6}
    cfg = load_config(tree={"data": {"root": str(tmp_path / "data"), "tasks": [new]}, "logging": logging,
                            "finetune": {"from": str(codec_only), "new_fields": "forecast"}})
    with pytest.raises(ConfigError, match="trained none; set finetune.new_fields=reconstruction"):
        check_source(cfg)
    darcy = {"name": "darcy2d", "param": 1.0, "samples": 12, "nx": 16}
    cfg = load_config(tree={"data": {"root": str(tmp_path / "data"), "tasks": [new, darcy]}, "logging": logging,
                            "finetune": {"from": str(root / "runs" / "fields"), "new_fields": "forecast"}})
    with pytest.raises(ConfigError, match=r"darcy2d is steady; fine-tune steady tasks with"):
        check_source(cfg)
    with pytest.raises(ConfigError, match="finetune.from is empty"):
        load_config(tree={"finetune": {"new_fields": "forecast"}})
    assert not (tmp_path / "runs").exists()
