"""Fields from flat channel names, and parameters from PDEBench-style file names.

Shared by the layout readers: a file that lists its channels (``("height", "velocity_x",
"velocity_y")``) is read as the fields those names spell (a scalar ``height`` and a vector
``velocity``), and a file name such as ``2D_CFD_Rand_M0.1_Eta0.01_Zeta0.01_periodic_128_Train``
gives the parameters ``M``, ``Eta``, ``Zeta`` and the name ``2D_CFD_Rand``.
"""

from __future__ import annotations

import re

from pipelines.layouts.description import FieldSpec

__all__ = ["fields_from_channels", "name_and_parameters"]

_PARAM = re.compile(r"(?P<key>[A-Za-z]+)(?P<value>[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)")
_SPLIT_WORDS = {"train", "valid", "val", "test"}


def fields_from_channels(names: tuple[str, ...], axes: tuple[str, ...]) -> tuple[FieldSpec, ...]:
    """Group channel names into fields: consecutive ``<base>_<axis>`` for every axis of `axes`, in
    axis order, make a vector field ``<base>``; any other name is a scalar field."""
    fields, i = [], 0
    while i < len(names):
        base = names[i].rsplit("_", 1)[0] if "_" in names[i] else None
        span = tuple(f"{base}_{a}" for a in axes) if base else ()
        if span and tuple(names[i:i + len(span)]) == span:
            fields.append(FieldSpec.vector(base, axes))
            i += len(span)
        else:
            fields.append(FieldSpec.scalar(names[i]))
            i += 1
    return tuple(fields)


def name_and_parameters(stem: str) -> tuple[str, dict[str, float]]:
    """(the dataset name, the parameters) that a PDEBench file stem spells: ``<letters><number>``
    tokens between underscores are parameters; split words (Train, Valid, Test), bare numbers
    (resolutions) and ``NA`` are dropped from the name."""
    words, params = [], {}
    for token in stem.split("_"):
        match = _PARAM.fullmatch(token)
        if match:
            params[match["key"]] = float(match["value"])
        elif token.lower() in _SPLIT_WORDS or token == "NA" or re.fullmatch(r"[0-9.-]+", token) or not token:
            continue
        else:
            words.append(token)
    return "_".join(words) or stem, params
