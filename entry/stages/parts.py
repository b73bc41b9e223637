"""What a stage's build hands to the training loop (`StageParts`), and the one update of a weight
average that the loop (a stage's EMA) and the consistency stage (its target) both apply."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from core.steps.consistency import ema_update_
from entry.distributed.sharding import is_fsdp


@dataclass
class StageParts:
    """What a stage hands to the loop."""

    name: str
    model: nn.Module
    step_fn: Callable
    step_cfg: Any
    loader: Any
    optimizer: torch.optim.Optimizer | None
    """None only for a model with nothing to train (then `steps` must be 0)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    frozen: dict[str, nn.Module | torch.Tensor] = field(default_factory=dict)
    """Fixed inputs of every step, passed to `step_fn` as keyword arguments (frozen networks, the
    steady prior's solution mean)."""
    after_step: Callable[[], None] | None = None
    validate: Callable[[nn.Module], dict[str, float]] | None = None
    """`validate(model) -> {task_key: validation nRMSE}`; the loop calls it on every rank under
    no_grad and eval mode, so it must run the same forwards everywhere (FSDP2 forwards gather)."""
    ema: nn.Module | None = None
    """The moving average of `model`'s weights (`settings.ema_decay`), placed and sharded like it:
    validated, kept as best and exported in its place. None: the model itself."""
    val_extras: dict[str, float] = field(default_factory=dict)
    """Fixed numbers logged with every validation (the frozen codec's reconstruction nRMSE of the
    validation frames, `val_recon_nrmse/<task>`: the floor under `val_nrmse`)."""



def update_average(average: nn.Module, model: nn.Module, decay: float) -> None:
    """``average <- decay * average + (1 - decay) * model``, parameter by parameter, locally (under
    FSDP2 both hold shards of the same layout; no communication)."""
    # FSDP2 leaves a root's parameters gathered after a forward with no backward (validation's):
    # reshard so both lists hold local shards, which then line up one to one.
    if is_fsdp(average):
        average.reshard()
    ema_update_(list(average.parameters()), list(model.parameters()), decay)
