"""Finished runs for the inference tests, made in seconds: a config, generated data, `config.json`
and seeded untrained weights (with their descriptions) of every stage the evaluation loads. The tests
are about the plumbing (the API's rollout is the evaluation's), not about accuracy."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

PDET = {"hidden_dim": 16, "depths": [1, 1], "num_heads": 2, "group_size": 4}


def tree_1d(root: Path) -> dict:
    """Advection on 32 points, 11 steps, 2 given; operator, diffusion and consistency (1-step)."""
    return {
        "data": {"root": str(root / "data"), "generate_if_missing": True,
                 "tasks": [{"name": "advection1d", "param": 0.1, "samples": 20, "nx": 32, "nt": 11,
                            "initial_step": 2}]},
        "latent": {"tokens": 8, "dim": 8, "hidden": 16},
        "operator": {"pdet": PDET}, "diffusion": {"pdet": PDET, "noise_levels": 2},
        "training": {"seed": 3, "num_workers": 0, "compile": False},
        "evaluation": {"plot_samples": 100},
        "logging": {"run_dir": str(root / "runs"), "run_name": "r1d", "progress": False, "plots": False,
                    "wandb": {"mode": "disabled"}},
    }


def tree_2d(root: Path) -> dict:
    """Diffusion-reaction (2 channels) on 16 x 16, 6 steps, 2 given, conv codec; operator and
    consistency (2 steps)."""
    return {
        "data": {"root": str(root / "data"), "generate_if_missing": True,
                 "tasks": [{"name": "dr2d", "param": 0.005, "samples": 20, "nx": 16, "resolution": 32, "nt": 6,
                            "initial_step": 2}]},
        "latent": {"codec": "conv", "patch": 4, "dim": 2, "hidden": 8},
        "operator": {"pdet": PDET}, "diffusion": {"pdet": PDET, "noise_levels": 2},
        "consistency": {"sample_steps": 2},
        "training": {"seed": 0, "num_workers": 0, "compile": False},
        "evaluation": {"plot_samples": 100},
        "logging": {"run_dir": str(root / "runs"), "run_name": "r2d", "progress": False, "plots": False,
                    "wandb": {"mode": "disabled"}},
    }


def finished_run(root: Path, tree: dict, *, generate: bool = True) -> tuple[Path, Path]:
    """Write `tree` as root/cfg.yaml, generate its data (unless not `generate`) and leave a finished
    run folder (config.json, seeded weights and descriptions of every evaluated stage). Returns
    (config file, run folder)."""
    from entry.config.load import load_config
    from entry.data.files import ensure_data
    from entry.distributed.process_group import DistInfo
    from entry.models.files import description_bytes, write_weights_with
    from entry.stages.record import STAGES
    from entry.storage.run_folder import run_dir_for, weights_file, write_run_header

    cfg_path = root / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(tree))
    cfg = load_config(cfg_path)
    if generate:
        ensure_data(cfg)
    run_dir = run_dir_for(cfg)
    write_run_header(run_dir, cfg, DistInfo(0, 1, 0, torch.device("cpu"), None, 0))
    torch.manual_seed(0)
    for spec in STAGES:
        if spec.evaluated and spec.applies(cfg):
            model = spec.model(cfg)
            with torch.no_grad():  # untrained corrections start at zero: give them values to carry
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            state = model.state_dict()  # the pair written as the stages export it
            write_weights_with(weights_file(run_dir, spec.name), lambda tmp, s=state: torch.save(s, tmp),
                               description_bytes(model))
    return cfg_path, run_dir


def tree_steady(root: Path) -> dict:
    """Darcy on 16 x 16: the steady prior alone."""
    return {
        "data": {"root": str(root / "data"), "generate_if_missing": True,
                 "tasks": [{"name": "darcy2d", "param": 1.0, "samples": 20, "nx": 16}]},
        "latent": {"tokens": 16, "dim": 8, "hidden": 16},
        "steady": {"pdet": PDET, "noise_levels": 2},
        "training": {"seed": 0, "num_workers": 0, "compile": False},
        "evaluation": {"plot_samples": 100},
        "logging": {"run_dir": str(root / "runs"), "run_name": "rs", "progress": False, "plots": False,
                    "wandb": {"mode": "disabled"}},
    }
