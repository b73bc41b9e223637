"""Model registry: every network the stack trains or compares against, by kind and name, built
from plain JSON arguments that are kept with it, so the weights file plus its description rebuilds it.

A model is described as ``{"format": 2, "kind": ..., "arch": ..., "args": {...}}``; ``args`` are the
keyword arguments of its registered constructor, as plain JSON values (lists for tuples, string keys).
A description without ``format`` (written before it had one) is format 1, read as format 2
(``current``): the two differ only in that key.
``build`` calls the constructor with exactly those canonical values and records them on the module
(``describe`` reads them back), so ``rebuild(describe(model))`` makes the same architecture, and
loading the same weights gives the same function.

Models register themselves where they are defined, with the settings dataclass of their
hyperparameters (``@register("operator", "transformer", settings=TransformerSettings)``, after
neuraloperator's ``BaseModel`` and ``get_model(config)``, and torchtitan's model specs): the config
reads the arch's section into those settings, and the model is built from them plus the values the
stack supplies. ``core/models/__init__.py`` imports every module of the package, and Python runs a
package's ``__init__`` before any of its modules, so any import from ``core.models`` (this module
included) sees the full table.

Kinds: ``operator`` (latent time stepper: ``(z_BLD, dt_B, task_id_B) -> z_next_BLD``), ``codec``
(field <-> latent autoencoder), ``denoiser`` (EDM denoiser of latents), ``peer`` (field-space
baselines such as the FNO).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import nn

KINDS = ("operator", "codec", "denoiser", "peer")
"""Kinds of registered model."""

DESCRIPTION_ATTR = "model_description"
"""Attribute of a built module holding its description (a plain dict; not part of its state dict)."""

FORMAT = 2
"""The description format ``describe`` writes (its ``format`` key). 1: no ``format`` key (runs
exported before it had one); its keys and ``args`` are those of 2."""

DESCRIPTION_KEYS = ("format", "kind", "arch", "args")
"""Keys of a model description, in order."""

FORMAT_1_KEYS = ("kind", "arch", "args")
"""Keys of a format-1 description (no ``format``)."""


class Entry(NamedTuple):
    """What the registry holds of one model."""

    factory: Callable[..., nn.Module]
    """Its class or factory function, called with keyword arguments."""
    settings: type | None
    """The frozen dataclass of its hyperparameters (core.models.settings), or None (built from
    arguments alone: codecs, denoisers and peers, whose callers pass every argument)."""
    section: str
    """The config key of its settings under its kind's section (``operator.<section>``)."""
    stack_args: tuple[str, ...]
    """Arguments it takes from the stack beyond the ones every model of its kind takes (e.g.
    ``tokens``, the latent's token count: entry.models.build names the values it supplies)."""


# (kind, name) -> entry. Filled at import of the model modules (a test may add and remove one).
_TABLE: dict[tuple[str, str], Entry] = {}


def register(kind: str, name: str, *, settings: type | None = None, section: str = "",
             stack_args: tuple[str, ...] = ()) -> Callable:
    """Decorator registering a model class or factory function under ``(kind, name)``.

    Takes the kind (one of ``KINDS``), a name unique within it, the settings dataclass of its
    hyperparameters (each field a keyword argument of the constructor, every field defaulted),
    the config key of that section (default: the name) and the stack-supplied arguments it takes
    (``Entry.stack_args``); returns the decorator, which returns its argument unchanged. A second
    registration of the same name, or settings that are no dataclass with defaults, is a ValueError.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; kinds: {list(KINDS)}")
    if settings is not None:
        if not dataclasses.is_dataclass(settings):
            raise ValueError(f"{kind} {name!r}: settings must be a dataclass, got {settings!r}")
        settings()  # every config holds every arch's section: the defaults must make valid settings

    def add(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if (kind, name) in _TABLE and _TABLE[kind, name].factory is not factory:
            raise ValueError(f"{kind} {name!r} is registered twice")
        _TABLE[kind, name] = Entry(factory, settings, section or name, tuple(stack_args))
        return factory

    return add


def unregister(kind: str, name: str) -> None:
    """Remove ``(kind, name)`` from the table (a model a test registered for itself); absent: nothing."""
    _TABLE.pop((kind, name), None)


def entry(kind: str, name: str) -> Entry:
    """The registry's entry of ``(kind, name)``; an unknown one is a ValueError naming the choices."""
    if (kind, name) not in _TABLE:
        raise ValueError(f"unknown {kind} arch {name!r}; registered: {list(names(kind))}")
    return _TABLE[kind, name]


def with_settings(kind: str) -> tuple[tuple[str, Entry], ...]:
    """(name, entry) of every model of ``kind`` registered with settings, sorted by name."""
    return tuple((name, _TABLE[kind, name]) for name in names(kind) if _TABLE[kind, name].settings is not None)


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

    Returns the module with its description ``{"format", "kind", "arch", "args"}`` attached
    (``describe``). An unknown kind or name is a ValueError naming the registered choices.
    """
    factory = entry(kind, name).factory
    canonical = plain(args)
    # Built from the canonical values, exactly as `rebuild` will: the two paths cannot differ.
    model = factory(**canonical)
    setattr(model, DESCRIPTION_ATTR, {"format": FORMAT, "kind": kind, "arch": name, "args": canonical})
    return model


def describe(model: nn.Module) -> dict[str, Any] | None:
    """A copy of the description of a model made by ``build``, or None for one built otherwise."""
    found = getattr(model, DESCRIPTION_ATTR, None)
    return None if found is None else plain(found, "description")


def current(description: Any) -> dict[str, Any]:
    """A description (``describe``'s dict, read back from JSON) in the current format: format 2 as
    it is, format 1 (no ``format`` key: nothing was renamed since) with ``format`` added. A mapping
    of other keys or another format is a ValueError saying what is wrong."""
    keys = tuple(sorted(description)) if isinstance(description, dict) else None
    if keys == tuple(sorted(FORMAT_1_KEYS)):
        return {"format": FORMAT, **description}
    if keys != tuple(sorted(DESCRIPTION_KEYS)):
        raise ValueError(f"a model description is a mapping with keys {list(DESCRIPTION_KEYS)} (format 1: "
                         f"without format), got {type(description).__name__} {str(description)[:80]}")
    if description["format"] != FORMAT:
        raise ValueError(f"a model description of format {str(description['format'])[:20]}; this code reads "
                         f"formats 1 and {FORMAT}")
    return description


def rebuild(description: Any) -> nn.Module:
    """The model a description (``describe``'s dict, e.g. read back from JSON; any format
    ``current`` reads) names, freshly initialised. A malformed description is a ValueError saying
    what is wrong."""
    _, kind, arch, args = (current(description)[k] for k in DESCRIPTION_KEYS)
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; kinds: {list(KINDS)}")
    if not isinstance(args, dict):
        raise ValueError(f"a model description's args is a mapping, got {type(args).__name__}")
    return build(kind, arch, **args)
