"""Fitting a codec's linear path in closed form, whichever registered codec it is.

Each codec fits its own way (`core.models.grid_codec.fit_linear_path`: the PCA of each spatial
dimension's cell coefficients; `core.models.conv_codec.fit_linear`: the PCA of the normalised
patches; the field codec has no linear path and fits each dataset's normalisation of its fields,
`core.models.field_codec.fit_field_scales`); `fit_codec` picks the fit by the model's registry
description, so no caller tests the codec's class, and says in one phrase how much of the fields
the fitted latent keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tensordict import TensorDictBase
from torch import Tensor, nn

from core.models import conv_codec, field_codec, grid_codec
from core.models.registry import describe

Batch = Tensor | TensorDictBase
"""A batch of training fields: ``u [B, C, *S]``, or a TensorDict with ``u`` and ``task_id`` [B] (one
task: what the field codec needs to name the fields)."""


def _frames(batches: Iterable[Batch]) -> Iterable[Tensor]:
    return (b if isinstance(b, Tensor) else b["u"] for b in batches)


def _fit_grid(model: nn.Module, batches: Iterable[Batch]) -> str:
    captured = grid_codec.fit_linear_path(model.encoder, model.decoder, _frames(batches))
    return "energy captured per spatial dimension: " + ", ".join(f"{d}D {v:.6f}" for d, v in sorted(captured.items()))


def _fit_conv(model: nn.Module, batches: Iterable[Batch]) -> str:
    captured = conv_codec.fit_linear(model, _frames(batches))
    return f"energy captured per spatial dimension: {model.encoder.ndim}D {captured:.6f}"


def _fit_fields(model: nn.Module, batches: Iterable[Batch], only: list[str] | None = None) -> str:
    def named() -> Iterable[tuple[str, Tensor]]:
        for b in batches:
            if isinstance(b, Tensor):
                raise ValueError("the field codec fits from batches that name their task (TensorDicts with u and "
                                 "task_id)")
            dataset = model.dataset_of(b["task_id"])
            if only is None or dataset in only:
                yield dataset, b["u"]

    scales = field_codec.fit_field_scales(model, named())
    # A whole codec's fit says that it has no linear path; a fine-tuned codec's new datasets' fit is their tables alone.
    whole = "" if only is not None else "none: codec fields learns its whole map; "
    return whole + "fields normalised per dataset (mean/scale): " + "; ".join(
        f"{key}: " + ", ".join(f"{name} {mean:.3g}/{scale:.3g}" for name, (mean, scale) in fields.items())
        for key, fields in scales.items())


FITS: dict[str, Callable[[nn.Module, Iterable[Batch]], str]] = {"grid": _fit_grid, "conv": _fit_conv,
                                                                 "fields": _fit_fields}
"""Codec arch (its registered name) -> the fit of its linear path."""


def fit_codec(model: nn.Module, batches: Iterable[Batch], *, only: list[str] | None = None) -> str:
    """Fit the linear path of a codec built by the registry (kind "codec"), in place.

    Args:
        model: an unplaced ``Autoencoder`` from ``core.models.registry.build`` (its description
            names the arch).
        batches: training fields ``u [B, C, *S]`` (or TensorDicts with ``u`` and ``task_id``, which
            the field codec needs), read once.
        only: the field codec only: the datasets to fit (a fine-tuned codec's new ones, by
            `entry.models.build.dataset_key`); the others keep theirs. None: all.
    Returns:
        What the fit kept, for the log: "energy captured per spatial dimension: 2D 0.998712" (the
        fraction of the fitted vectors' variance the latent holds; 1 when the code is exact).
    Raises:
        ValueError: a model that is no registered codec, or a codec with no fit here.
    """
    found = describe(model)
    if found is None or found["kind"] != "codec":
        raise ValueError(f"fit_codec takes a codec built by core.models.registry.build, got "
                         f"{type(model).__name__} described as {found}")
    if found["arch"] not in FITS:
        raise ValueError(f"no linear-path fit for codec {found['arch']!r}; fits: {sorted(FITS)}")
    if only is not None:
        if found["arch"] != "fields":
            raise ValueError(f"fit_codec(only=...) fits some datasets of a field codec, not of codec {found['arch']!r}")
        return _fit_fields(model, batches, only)
    return FITS[found["arch"]](model, batches)
