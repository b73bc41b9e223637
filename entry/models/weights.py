"""Exported weights into models: loading a state dict into a model (refused with the file named
when it is missing, unreadable or of another model) and frozen helper networks for a stage or an
evaluation (on the device, in eval mode, blocks compiled when asked)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from entry.config.errors import CheckpointError
from entry.config.recipe import resolve_compile
from entry.distributed.process_group import DistInfo
from entry.distributed.sharding import compile_blocks


def load_weights(model: nn.Module, path: str | Path, *, made_by: str) -> nn.Module:
    """Load an exported weights file into `model` (in place; returns it).

    Takes the model, the file and the command that writes the file (quoted in the error).
    Raises `CheckpointError` naming the file when it is missing, unreadable or written for
    another model.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"missing weights {path}: run `{made_by}` first (or entry.pipeline)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated or garbage: one answer
        raise CheckpointError(f"weights file {path} is unreadable ({type(e).__name__}: {e}); "
                              f"re-create it with `{made_by}`") from None
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as e:
        first = str(e).strip().splitlines()[0][:300]
        raise CheckpointError(f"weights file {path} does not fit this config's model ({first}); "
                              f"re-create it with `{made_by}`") from None
    return model


def load_frozen(make: Callable[[], nn.Module], weights, info: DistInfo, *,
                made_by: str = "python -m entry.pipeline --config CFG", compile: bool | str = False) -> nn.Module:
    """A frozen helper network (operator, teacher, autoencoder) from an exported weights file, on
    the device, in eval mode; its blocks compiled for inference when `compile` (`training.compile`:
    "auto", as a config loaded without resolving it holds, is on with CUDA only).

    Frozen networks are not sharded: every rank holds the full copy and only runs forward. Called
    inside a training step they run under the step's autocast, as the trained model does
    (entry.distributed.precision), so they follow the same precision contract on every layout. A missing,
    unreadable or mismatched file is a `CheckpointError` quoting `made_by`.
    """
    return frozen_placed(load_weights(make(), weights, made_by=made_by), info, compile=compile)


def frozen_placed(model: nn.Module, info: DistInfo, *, compile: bool | str = False) -> nn.Module:
    """`model` frozen (no gradients), on the device, in eval mode, its blocks compiled for inference when
    `compile` resolves on (`load_frozen`'s placement, for a frozen network whose weights come otherwise)."""
    model.requires_grad_(False)
    model = model.to(info.device).eval()
    # Resolved here, not only by the commands: "auto" is truthy, and compiled every block on a CPU.
    return compile_blocks(model) if resolve_compile(compile, cuda=info.device.type == "cuda") else model
