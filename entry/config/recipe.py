"""The `auto` training recipe: `training.precision: auto` and `training.compile: auto` resolved for
a machine with or without a GPU (bf16 and torch.compile on CUDA, fp32 eager on CPU). A pure
function of the config and one fact about the machine, so the shared command line resolves it
before anything else sees the config; the precision contract that the resolved values select is
entry/distributed/precision.py."""

from __future__ import annotations

import dataclasses

from entry.config.schema import Config, TrainingConfig

AUTO = "auto"
AUTO_RULE = "'auto' is bf16 + compile on CUDA, fp32 eager on CPU"


def resolve_training(t: TrainingConfig, *, cuda: bool) -> TrainingConfig:
    """`t` with `precision` and `compile` resolved for a machine with (`cuda`) or without a GPU;
    explicit values are kept."""
    precision = ("bf16" if cuda else "fp32") if t.precision == AUTO else t.precision
    return dataclasses.replace(t, precision=precision, compile=resolve_compile(t.compile, cuda=cuda))


def resolve_compile(compile_: bool | str, *, cuda: bool) -> bool:
    """`training.compile` for a machine with (`cuda`) or without a GPU: "auto" is on with CUDA only."""
    return cuda if compile_ == AUTO else compile_


def resolve_config(cfg: Config, *, cuda: bool) -> Config:
    """`cfg` with `training.precision` / `training.compile` resolved (`resolve_training`)."""
    return dataclasses.replace(cfg, training=resolve_training(cfg.training, cuda=cuda))


def describe(t: TrainingConfig) -> str:
    """One line naming a resolved recipe, e.g. `precision bf16, compile on`."""
    return f"precision {t.precision}, compile {'on' if t.compile is True else 'off'}"
