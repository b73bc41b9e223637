"""`torchrun --nproc_per_node=N -m entry.autoencoder --config CFG`: train the grid encoder/decoder.

Field snapshots of every task's training split (Darcy: coefficient and solution), one task
per step on every rank, reconstruction loss.
"""

from __future__ import annotations

import sys
from pathlib import Path

from entry.config_schema import Config
from entry.data import task_path, task_split
from entry.distributed import DistInfo
from entry.models import build_autoencoder
from entry.runner import Stage, stage_command
from entry.stage_build import optimizer_for, place_model
from entry.train_loop import StageParts


def field_loader(cfg: Config, info: DistInfo, split: str = "train"):
    """Single-task field batches of every task's `split`, sharded over ranks."""
    from pipelines.fields import FieldSnapshots, build_field_loader

    datasets = [FieldSnapshots(task_path(cfg, task), task_split(cfg, i, split)[0], reduce_x=task.reduce_x,
                               reduce_t=task.reduce_t, task_id=i) for i, task in enumerate(cfg.data.tasks)]
    return build_field_loader(datasets, rank=info.rank, world_size=info.world_size,
                              batch_size_per_rank=cfg.autoencoder.batch_size // info.world_size,
                              seed=cfg.training.seed, num_workers=cfg.training.num_workers,
                              prefetch_factor=cfg.training.prefetch_factor, pin_memory=info.device.type == "cuda")


def build(cfg: Config, info: DistInfo, run_dir: Path, logger) -> StageParts:
    """Data, then model (placed, blocks compiled, sharded), then optimizer."""
    from core.steps.autoencoder import AutoencoderStepConfig, autoencoder_step

    loader = field_loader(cfg, info)
    model = place_model(lambda: build_autoencoder(cfg), cfg, info)
    optimizer, scheduler = optimizer_for(model, cfg.autoencoder, info)
    return StageParts("autoencoder", model, autoencoder_step, AutoencoderStepConfig(), loader, optimizer, scheduler)


STAGE = Stage("autoencoder", lambda c: c.autoencoder, build)

main = stage_command(STAGE, __doc__)


if __name__ == "__main__":
    sys.exit(main())
