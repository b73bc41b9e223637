"""Stage completeness follows the config sections a stage depends on, and a stage never resumes
from checkpoints written for another config."""

from __future__ import annotations

import pytest
import torch

from entry.config.load import load_config
from entry.training.stage_record import resume_hash, stage_hash
from tests import tiny_run

STAGES = ("autoencoder", "cache", "operator", "diffusion", "consistency", "steady")


def _hashes(tree: dict, *sets: str) -> dict[str, str]:
    cfg = load_config(tree=tree, overrides=list(sets))
    return {s: stage_hash(cfg, s) for s in STAGES}


def test_a_stage_hash_changes_with_its_own_and_its_inputs_sections_only(tmp_path):
    tree = tiny_run.tiny_tree(tmp_path)
    base = _hashes(tree)
    op = _hashes(tree, "operator.lr=0.5")
    assert [s for s in STAGES if op[s] != base[s]] == ["operator", "diffusion", "consistency"]
    ae = _hashes(tree, "autoencoder.lr=0.5")
    assert all(ae[s] != base[s] for s in STAGES)  # every stage reads the autoencoder's output
    steady = _hashes(tree, "steady.lr=0.5")
    assert [s for s in STAGES if steady[s] != base[s]] == ["steady"]
    val = _hashes(tree, "evaluation.val_every=5")  # validation picks weights of the validated stages
    assert [s for s in STAGES if val[s] != base[s]] == ["operator", "diffusion", "consistency", "steady"]
    assert _hashes(tree, "logging.log_every=3") == base


def test_resume_survives_more_steps_and_run_control_but_not_the_math(tmp_path):
    tree = tiny_run.tiny_tree(tmp_path)
    base = load_config(tree=tree)
    longer = load_config(tree=tree, overrides=["operator.steps=999"])
    assert resume_hash(longer, "operator") == resume_hash(base, "operator")  # resumes and trains on
    assert stage_hash(longer, "operator") != stage_hash(base, "operator")  # but is not complete yet
    driven = load_config(tree=tree, overrides=["training.checkpoint_every=3", "training.num_workers=1"])
    assert resume_hash(driven, "operator") == resume_hash(base, "operator")
    for other in (["operator.lr=0.5"], ["autoencoder.steps=7"], ["operator.pdet.hidden_dim=8"]):
        assert resume_hash(load_config(tree=tree, overrides=other), "operator") != resume_hash(base, "operator")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_changed_config_does_not_resume_the_old_checkpoints(tmp_path):
    tiny_run.prepare(tmp_path)
    args = tiny_run.new_run(tmp_path, "run")
    first = tiny_run.launch(tmp_path, args, nproc=1, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    # Same run folder, another learning rate: the step-20 checkpoint of the first config must not
    # be taken as this run's finished training.
    changed = args + ["--set", "operator.lr=3e-3"]
    second = tiny_run.launch(tmp_path, changed, nproc=1, timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "written for another config" in (tmp_path / "runs" / "run" / "rank0.log").read_text()
    assert list((tmp_path / "runs" / "run" / "checkpoints").glob("operator.stale-*"))
    fresh_args = tiny_run.new_run(tmp_path, "fresh") + ["--set", "operator.lr=3e-3"]
    fresh = tiny_run.launch(tmp_path, fresh_args, nproc=1, timeout=120)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    a, b = tiny_run.final_weights(tmp_path, "run"), tiny_run.final_weights(tmp_path, "fresh")
    assert all(torch.equal(a[k], b[k]) for k in a)  # trained afresh, exactly as a new run


def test_locations_and_run_control_are_not_part_of_a_stage(tmp_path):
    tree = tiny_run.tiny_tree(tmp_path)
    base = _hashes(tree)
    elsewhere = [f"data.root={tmp_path / 'copy'}", f"training.cache_dir={tmp_path / 'cache2'}",
                 f"data.tasks.0.path={tmp_path / 'copy' / 'a.hdf5'}", "data.generate_if_missing=false"]
    driven = ["training.num_workers=3", "training.prefetch_factor=4", "training.checkpoint_every=9",
              "training.keep_checkpoints=7", "training.timeout_s=12", "training.debug=true",
              "training.on_oom=fail", "training.max_skips_in_a_row=2", "evaluation.plot_samples=0",
              "evaluation.max_test_samples=3", "evaluation.split=val", "evaluation.time_rollout=true",
              "consistency.sample_steps=2", "consistency.sigma_mid=0.3"]
    assert _hashes(tree, *elsewhere) == base
    assert _hashes(tree, *driven) == base
    # The refiner's sampler shapes only the test report; training it at every level is the math.
    continuous = _hashes(tree, "diffusion.continuous_levels=true")
    assert [s for s in STAGES if continuous[s] != base[s]] == ["diffusion", "consistency"]
    assert _hashes(tree, "diffusion.continuous_levels=true", "diffusion.sampler=ode",
                   "diffusion.sample_steps=7") == continuous
    # Validation's rollout length picks the best weights: a stage that validates is not complete
    # after it changes, although its checkpoints still resume.
    longer = _hashes(tree, "evaluation.rollout_steps=3")
    assert [s for s in STAGES if longer[s] != base[s]] == ["operator", "diffusion", "consistency", "steady"]
    cfg, rolled = load_config(tree=tree), load_config(tree=tree, overrides=["evaluation.rollout_steps=3"])
    assert resume_hash(rolled, "operator") == resume_hash(cfg, "operator")
    # The optimiser's second-moment decay, added later: hashed only when set, then the stage's own.
    assert _hashes(tree, "operator.adam_beta2=0.999", "diffusion.adam_beta2=0.999") == base
    beta2 = _hashes(tree, "operator.adam_beta2=0.95")
    assert [s for s in STAGES if beta2[s] != base[s]] == ["operator", "diffusion", "consistency"]
    # So does validation's own rollout length, added later: hashed only when set.
    assert _hashes(tree, "evaluation.val_rollout_steps=0") == base
    val_short = _hashes(tree, "evaluation.val_rollout_steps=2")
    assert [s for s in STAGES if val_short[s] != base[s]] == ["operator", "diffusion", "consistency", "steady"]
    short = load_config(tree=tree, overrides=["evaluation.val_rollout_steps=2"])
    assert resume_hash(short, "operator") == resume_hash(cfg, "operator")


def test_weights_are_fingerprinted_by_their_tensors_not_their_file(tmp_path):
    from entry.storage.weights_fingerprint import weights_fingerprint

    torch.manual_seed(0)
    state = {"a.weight": torch.randn(4, 3), "a.bias": torch.zeros(3, dtype=torch.bfloat16), "n": torch.tensor(7)}
    torch.save(state, tmp_path / "one.pt")  # the zip inside names itself after the file
    (tmp_path / "two.pt").write_bytes(b"")
    with open(tmp_path / "two.pt", "wb") as f:
        torch.save(dict(reversed(state.items())), f)
    assert (tmp_path / "one.pt").read_bytes() != (tmp_path / "two.pt").read_bytes()
    fp = weights_fingerprint(tmp_path / "one.pt")
    assert fp.startswith("tensors:sha256:") and weights_fingerprint(tmp_path / "two.pt") == fp
    for changed in ({**state, "a.weight": state["a.weight"].clone().index_put_((torch.tensor(1),), torch.tensor(0.5))},
                    {**state, "n": torch.tensor(7.0)},  # same value, another dtype
                    {**state, "a.weight": state["a.weight"].reshape(3, 4)},  # same bytes, another shape
                    {k.replace("a.", "b."): v for k, v in state.items()}):
        torch.save(changed, tmp_path / "other.pt")
        assert weights_fingerprint(tmp_path / "other.pt") != fp
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    assert weights_fingerprint(tmp_path / "garbage.pt").startswith("bytes:16:sha256:")
    assert not list(tmp_path.glob(".*facts*"))  # nothing written beside a weights file


def test_the_same_weights_exported_twice_are_the_same_bytes(tmp_path):
    from entry.distributed.process_group import DistInfo
    from entry.training.checkpoint import export_weights

    info = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)
    model = torch.nn.Linear(3, 2)
    a, b = export_weights(model, tmp_path / "a.pt", info), export_weights(model, tmp_path / "b.pt", info)
    assert a.read_bytes() == b.read_bytes()
