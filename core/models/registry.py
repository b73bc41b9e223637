"""Model registry: every network the stack trains or compares against, by kind and name, built
from plain JSON arguments that are kept with it, so the weights file plus its description rebuilds it.

A model is described as ``{"kind": ..., "arch": ..., "args": {...}}``; ``args`` are the keyword
arguments of its registered constructor, as plain JSON values (lists for tuples, string keys).
``build`` calls the constructor with exactly those canonical values and records them on the module
(``describe`` reads them back), so ``rebuild(describe(model))`` makes the same architecture, and
loading the same weights gives the same function.

Models register themselves where they are defined (``@register("operator", "pdet_unet")``, after
neuraloperator's ``BaseModel`` and torchtitan's model specs). ``core/models/__init__.py`` imports
every model module, and Python runs a package's ``__init__`` before any of its modules, so any
import from ``core.models`` (this module included) sees the full table.

Kinds: ``operator`` (latent time stepper: ``(z_BLD, dt_B, task_id_B) -> z_next_BLD``), ``codec``
(field <-> latent autoencoder), ``denoiser`` (EDM denoiser of latents), ``peer`` (field-space
baselines such as the FNO).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn

KINDS = ("operator", "codec", "denoiser", "peer")
"""Kinds of registered model."""

DESCRIPTION_ATTR = "model_description"
"""Attribute of a built module holding its description (a plain dict; not part of its state dict)."""

DESCRIPTION_KEYS = ("kind", "arch", "args")
"""Keys of a model description, in order."""

# (kind, name) -> constructor. Filled once, at import of the model modules; read-only after.
_TABLE: dict[tuple[str, str], Callable[..., nn.Module]] = {}


def register(kind: str, name: str) -> Callable:
    """Decorator registering a model class or factory function under ``(kind, name)``.

    Takes the kind (one of ``KINDS``) and a name unique within it; returns the decorator, which
    returns its argument unchanged. A second registration of the same name is a ValueError.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; kinds: {list(KINDS)}")

    def add(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if (kind, name) in _TABLE and _TABLE[kind, name] is not factory:
            raise ValueError(f"{kind} {name!r} is registered twice")
        _TABLE[kind, name] = factory
        return factory

    return add


def names(kind: str) -> tuple[str, ...]:
    """Registered names of ``kind``, sorted (empty for a kind with none)."""
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; kinds: {list(KINDS)}")
    return tuple(sorted(name for k, name in _TABLE if k == kind))


def plain(value: Any, where: str = "args") -> Any:
    """``value`` as canonical JSON: tuples become lists, mappings need string keys, floats must be
    finite; anything else (a tensor, a module) is a ValueError naming ``where``. Returns a copy."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} must be a finite number, got {value}")
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ValueError(f"{where} needs string keys (JSON), got {bad[0]!r}")
        return {k: plain(v, f"{where}.{k}") for k, v in value.items()}
    raise ValueError(f"{where} is a {type(value).__name__}; a model's constructor arguments must be plain "
                     f"JSON values to be saved beside its weights")


def build(kind: str, name: str, **args: Any) -> nn.Module:
    """Build the model registered as ``(kind, name)`` with keyword ``args`` (plain JSON values).

    Returns the module with its description ``{"kind", "arch", "args"}`` attached (``describe``).
    An unknown kind or name is a ValueError naming the registered choices.
    """
    if (kind, name) not in _TABLE:
        raise ValueError(f"unknown {kind} arch {name!r}; registered: {list(names(kind))}")
    canonical = plain(args)
    # Built from the canonical values, exactly as `rebuild` will: the two paths cannot differ.
    model = _TABLE[kind, name](**canonical)
    setattr(model, DESCRIPTION_ATTR, {"kind": kind, "arch": name, "args": canonical})
    return model


def describe(model: nn.Module) -> dict[str, Any] | None:
    """A copy of the description of a model made by ``build``, or None for one built otherwise."""
    found = getattr(model, DESCRIPTION_ATTR, None)
    return None if found is None else plain(found, "description")


def rebuild(description: Any) -> nn.Module:
    """The model a description (``describe``'s dict, e.g. read back from JSON) names, freshly
    initialised. A malformed description is a ValueError saying what is wrong."""
    if not isinstance(description, dict) or tuple(sorted(description)) != tuple(sorted(DESCRIPTION_KEYS)):
        raise ValueError(f"a model description is a mapping with keys {list(DESCRIPTION_KEYS)}, "
                         f"got {type(description).__name__} {str(description)[:80]}")
    kind, arch, args = (description[k] for k in DESCRIPTION_KEYS)
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; kinds: {list(KINDS)}")
    if not isinstance(args, dict):
        raise ValueError(f"a model description's args is a mapping, got {type(args).__name__}")
    return build(kind, arch, **args)
