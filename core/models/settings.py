"""A model's settings: the typed, frozen dataclass of its hyperparameters, defined beside the model.

A model registers its settings class with itself (``@register("operator", "transformer",
settings=TransformerSettings)``, core.models.registry); the config reads that section of the YAML
into it (``operator.transformer: {...}``), and the model is built from its fields as keyword
arguments (``as_args``), so a field's name is the constructor argument it sets. A settings class is
``@dataclass(**SETTINGS)`` with a docstring per field, a default for every field (every config holds
every registered arch's section) and ``__post_init__`` checks that raise ``ValueError`` naming the
field; the config loader prefixes the key path (``operator.transformer.depth must be > 0, got 0``).
"""

from __future__ import annotations

import dataclasses
import reprlib
from typing import Any

SETTINGS = dict(frozen=True, kw_only=True, slots=True)
"""The dataclass options of every settings class (the config sections' own)."""


def shown(value: Any) -> str:
    """A value as a settings error shows it: its repr, long lists and strings elided (reprlib)."""
    return reprlib.repr(value)


def positive(settings: Any, *names: str) -> None:
    """ValueError naming the first field of `names` that is not > 0."""
    for name in names:
        if getattr(settings, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {shown(getattr(settings, name))}")


def heads_divide(settings: Any, width: str = "hidden_dim", heads: str = "num_heads") -> None:
    """ValueError unless field `heads` divides field `width` (attention splits the width into heads)."""
    if getattr(settings, width) % getattr(settings, heads):
        raise ValueError(f"{width} ({shown(getattr(settings, width))}) must be divisible by {heads} "
                         f"({shown(getattr(settings, heads))})")


def as_args(settings: Any) -> dict[str, Any]:
    """The fields of a settings dataclass as constructor keyword arguments (name -> value; tuples
    stay tuples: the registry writes them as JSON lists)."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
