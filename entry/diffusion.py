"""`torchrun --nproc_per_node=N -m entry.diffusion --config CFG`: train the residual denoiser.

PDE-Refiner style: the trained operator, frozen, predicts z_op; the denoiser learns the
residual z_next - z_op from noised copies at a few noise levels.
"""

from __future__ import annotations

import sys
from pathlib import Path

from entry.config import ConfigError
from entry.config_schema import Config
from entry.distributed import DistInfo
from entry.models import build_denoiser, build_operator
from entry.runner import Stage, stage_command, weights_file
from entry.stage_build import latent_pair_loader, load_frozen, optimizer_for, place_model
from entry.train_loop import StageParts


def required_weights(run_dir: Path, stage: str, command: str) -> Path:
    """The exported weights of an earlier stage, or a ConfigError naming the command that makes them."""
    path = weights_file(run_dir, stage)
    if not path.is_file():
        raise ConfigError(f"missing {stage} weights {path}: run `{command}` first (or entry.pipeline)")
    return path


def build(cfg: Config, info: DistInfo, run_dir: Path, logger) -> StageParts:
    """Frozen operator, data, then the denoiser (placed, sharded, compiled), then optimizer."""
    from core.steps.diffusion import DiffusionStepConfig, diffusion_step

    op_weights = required_weights(run_dir, "operator", "python -m entry.operator --config CFG")
    operator = load_frozen(lambda: build_operator(cfg), op_weights, info)
    loader = latent_pair_loader(cfg, info, "dynamic", "train", global_batch=cfg.diffusion.batch_size,
                                horizon=cfg.operator.horizon)
    model = place_model(lambda: build_denoiser(cfg, cfg.diffusion.pdet), cfg, info)
    optimizer, scheduler = optimizer_for(model, cfg.diffusion, info)
    step_cfg = DiffusionStepConfig(num_levels=cfg.diffusion.noise_levels, sigma_min=cfg.diffusion.sigma_min)
    return StageParts("diffusion", model, diffusion_step, step_cfg, loader, optimizer, scheduler,
                      frozen={"operator": operator})


STAGE = Stage("diffusion", lambda c: c.diffusion, build)

main = stage_command(STAGE, __doc__)


if __name__ == "__main__":
    sys.exit(main())
