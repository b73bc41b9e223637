"""`python -m bench.codec`: the codec's trade-off against PCA on a tiny generated file. The
global linear path is the PCA of the fields, so at every compression it reconstructs the test
frames as well as an independent PCA fitted on the same frames; at 1x it is exact."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import yaml

from bench import codec


def test_codec_bench_writes_the_trade_off_and_meets_pca(tmp_path, capsys):
    tree = {"data": {"root": str(tmp_path / "data"), "generate_if_missing": True, "tasks": [
                {"name": "burgers1d", "param": 0.01, "samples": 60, "nx": 64, "nt": 11, "initial_step": 3}]},
            "latent": {"tokens": 4, "dim": 16, "hidden": 0},
            "logging": {"run_dir": str(tmp_path / "runs"), "run_name": "tiny", "wandb": {"mode": "disabled"}}}
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    assert codec.main(["--config", str(cfg), "--ratios", "1,4", "--out", str(tmp_path / "out")]) == 0
    [path] = list((tmp_path / "out").glob("*-codec-tiny.json"))
    result = orjson.loads(path.read_bytes())
    rows = result["tasks"]["burgers1d"]["ratios"]
    assert set(rows) == {"1", "4"} and rows["4"]["latent_numbers"] == 16
    assert rows["1"]["ours_global"]["nrmse"] < 1e-5 and rows["1"]["ours_local"]["nrmse"] < 1e-5
    assert rows["4"]["ours_global"]["nrmse"] == pytest.approx(rows["4"]["pca"]["nrmse"], rel=1e-3, abs=1e-6)
    assert Path(result["plot"]).stat().st_size > 0
    assert "| burgers1d | 4x |" in path.with_suffix(".md").read_text()
