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
BF16_CAPABILITY = (8, 0)
"""The CUDA compute capability (Ampere) from which a GPU computes bf16 natively; an older one (V100,
T4) emulates it, slower than fp32 (`torch.cuda.is_bf16_supported(including_emulation=False)`)."""
TRITON_CAPABILITY = (7, 0)
"""The oldest CUDA compute capability torch.compile's GPU backend, Triton, compiles for."""


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


def recipe_problems(t: TrainingConfig, capability: tuple[int, int]) -> list[str]:
    """What the resolved recipe `t` asks of a GPU of compute `capability` (major, minor) that the GPU
    cannot do, or does slower than the alternative, each naming the key that fixes it; [] when it
    suits. `auto` resolves by CUDA alone, so a pre-Ampere GPU gets bf16 from it."""
    found = f"this GPU's compute capability is {capability[0]}.{capability[1]}"
    problems = []
    if t.precision == "bf16" and tuple(capability) < BF16_CAPABILITY:
        problems.append(f"bf16 is emulated before compute capability 8.0, slower than fp32 ({found}): "
                        f"set training.precision=fp32")
    if t.compile is True and tuple(capability) < TRITON_CAPABILITY:
        problems.append(f"torch.compile (Triton) needs compute capability 7.0 or later ({found}): "
                        f"set training.compile=false")
    return problems
