"""The codec's moving average of its weights (`autoencoder.ema_decay`): what a mixture's codec, whose
one-task steps pull it in turn towards each task, exports and is validated with."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests import tiny_run as tr


def _trained(path, runs, name: str, steps: int, decay: float) -> dict[str, torch.Tensor]:
    """The codec `entry.autoencoder` exports for run `name` after `steps` steps at `ema_decay` `decay`."""
    from entry.autoencoder import main

    assert main(["--config", str(path), "--no-deps", "--set", f"logging.run_name={name}",
                 "--set", f"autoencoder.steps={steps}", "--set", f"autoencoder.ema_decay={decay}"]) == 0
    return torch.load(runs / name / "autoencoder.pt", weights_only=True)


@pytest.mark.timeout(300)
def test_the_exported_codec_is_the_average_of_its_fitted_start_and_its_steps(tmp_path):
    """After one step the exported codec is exactly 0.1 x the fitted codec + 0.9 x the stepped one (the
    decay's ramp, `core.schedule.ema_decay_at`, is 0.1 at the first update): the average starts at the
    fitted codec (its linear path and the fields' normalisation), not at a fresh build, and it, not
    the live weights, is what the stage exports."""
    from entry.config.load import load_config
    from entry.data.files import ensure_data

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tr.tiny_tree(tmp_path)))
    ensure_data(load_config(path))
    runs = tmp_path / "runs"
    fitted = _trained(path, runs, "fitted", 0, 0.0)
    stepped = _trained(path, runs, "stepped", 1, 0.0)
    averaged = _trained(path, runs, "averaged", 1, 0.99)

    assert fitted.keys() == stepped.keys() == averaged.keys()
    moved = [k for k, v in stepped.items() if v.is_floating_point() and not torch.equal(v, fitted[k])]
    assert moved, "one step changed no weight"
    for key, value in averaged.items():
        if not value.is_floating_point():
            assert torch.equal(value, stepped[key]), key
            continue
        expected = 0.1 * fitted[key] + 0.9 * stepped[key]
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=key)
    assert any(not torch.equal(averaged[k], stepped[k]) for k in moved)
