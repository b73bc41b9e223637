"""The model description written beside an exported weights file, and rebuilding a model from it.

`<name>.pt` stays a flat state dict (fingerprinted, loaded with `weights_only=True`);
`<name>.model.json` holds the registry description `{"format", "kind", "arch", "args"}`
(core.models.registry) of the model whose weights it sits beside, so a tool rebuilds the model
from the weights file alone, whatever the config says now. A description written before it had a
`format` (format 1) is read as the current format (`core.models.registry.current`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from core.models.registry import current, describe, rebuild
from entry.config.errors import CheckpointError
from entry.storage.atomic import atomic_write_all


def description_file(weights: str | Path) -> Path:
    """`<name>.model.json` beside the weights file `<name>.pt`."""
    return Path(weights).with_suffix(".model.json")


def write_weights_with(weights: str | Path, write: Callable[[Path], None], description: bytes | None) -> Path:
    """Replace the weights file `weights` (filled by `write(tmp)`) and its description (`description`,
    the JSON text; None: the new weights have none) as one pair; returns `weights`.

    Both are written to temporary files first, so a failure there (a full disk) leaves the old pair
    as it was, never weights without their description. A changed description's old file is removed
    just before the renames: an older description never sits beside newer weights, even after a
    crash between the two renames (then the weights have none, and are built from the config).
    """
    weights, desc = Path(weights), description_file(weights)

    def drop_a_stale_description() -> None:
        try:
            stale = description is None or desc.read_bytes() != description
        except FileNotFoundError:
            return
        if stale:
            desc.unlink(missing_ok=True)

    writes = [(weights, write)] + ([] if description is None else [(desc, lambda tmp: tmp.write_bytes(description))])
    atomic_write_all(writes, before_renames=drop_a_stale_description)
    return weights


def description_bytes(model: nn.Module) -> bytes | None:
    """The registry description of `model` (unwrapped from DDP) as the JSON text `write_weights_with`
    writes beside its weights; None for a model the registry did not build."""
    found = describe(model.module if isinstance(model, DistributedDataParallel) else model)
    return None if found is None else orjson.dumps(found, option=orjson.OPT_INDENT_2)


def remove_weights(weights: str | Path) -> None:
    """Delete a weights file and its description (either may be absent)."""
    Path(weights).unlink(missing_ok=True)
    description_file(weights).unlink(missing_ok=True)


def read_description(weights: str | Path) -> dict[str, Any] | None:
    """The description beside `weights` in the current format (one of format 1 gains its `format`
    key), or None when there is none (weights exported before descriptions were written). An
    unreadable or malformed one is a CheckpointError naming it."""
    path = description_file(weights)
    if not path.is_file():
        return None
    try:
        found = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise CheckpointError(f"model description {path} is unreadable ({e}); delete it to rebuild the model "
                              f"from the config, or export the weights again") from None
    try:
        return current(found)
    except ValueError as e:
        raise CheckpointError(f"model description {path}: {e}") from None


def maker_for(weights: str | Path, from_config: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """How to build the model that `weights` fits: from its description when one lies beside it,
    else `from_config` (weights exported before descriptions were written). Returns a maker."""
    found = read_description(weights)
    if found is None:
        return from_config

    def from_description() -> nn.Module:
        try:
            return rebuild(found)
        except (ValueError, TypeError) as e:  # an arch this code no longer has, or changed arguments
            raise CheckpointError(f"model description {description_file(weights)} does not build a model "
                                  f"({e})") from None

    return from_description


def publish_weights(source: str | Path, target: str | Path) -> Path:
    """Copy the weights file `source` and its description (when it has one) to `target` as one pair
    (`write_weights_with`): a failure leaves `target`'s old pair whole."""
    desc = description_file(source)
    text = desc.read_bytes() if desc.is_file() else None
    return write_weights_with(target, lambda tmp: shutil.copyfile(source, tmp), text)
