"""The precision contract and the `auto` training recipe.

Contract (the same on every layout: one device, DDP, FSDP2; for trained and frozen networks):
parameters may compute in bf16; the latent state, residual additions (`z + delta`), losses and
reductions stay fp32. How each layout keeps it:

- bf16 compute is `torch.autocast(bf16)` around every training forward, on every layout, so the
  same ops run in bf16 everywhere, frozen networks (operator, teacher) included.
- FSDP2 also stores the gathered parameters in bf16 (`param_dtype`) and reduces gradients in fp32
  (`reduce_dtype`). The root unit does not cast its inputs (`cast_forward_inputs=False`), so the
  latent state reaches the model's skip `z + delta` in fp32, and its output is fp32
  (`output_dtype`). Blocks cast their (activation) inputs to bf16 as autocast would.
- Models keep the skip in the latent's dtype (core/models/pdet.py), losses are computed in fp32
  (core/steps/common.py), and the gradient norm and the loop's all_reduce are fp32.

`training.precision: auto` and `training.compile: auto` resolve per device: bf16 and
torch.compile on CUDA, fp32 eager on CPU (exactly the CPU behaviour before `auto` existed).
`entry.config.cli.parse_config` resolves them before anything else sees the config (and the in-process
entry points resolve again, see `resolve_for`), so the config hash, `config.json` in the run
folder and every consumer see the resolved values.
"""

from __future__ import annotations

import contextlib

import torch

from entry.config.recipe import resolve_config
from entry.config.schema import Config


def resolve_for(cfg: Config, device: torch.device) -> Config:
    """`resolve_config` for the device a process runs on. The in-process entry points
    (`entry.training.runner.execute_stage`, `entry.evaluation.scoring.evaluate_config`) call it on the config they are
    handed, so a caller that built its config with `load_config` gets the same recipe as a command."""
    return resolve_config(cfg, cuda=device.type == "cuda")


def check_resolved(precision: str) -> None:
    """Our invariant: consumers only ever see a resolved precision (parse_config resolves it)."""
    assert precision in ("fp32", "bf16"), f"unresolved training.precision {precision!r}"


def compute_autocast(device: torch.device, precision: str):
    """The context of every training forward: bf16 autocast for `precision == "bf16"`, on every
    layout (one device, DDP, FSDP2); nothing for fp32."""
    check_resolved(precision)
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def fsdp_policies(precision: str):
    """`(block_policy, root_policy)`: the FSDP2 MixedPrecisionPolicy of the blocks and of the root.

    bf16: parameters gathered in bf16, gradients reduced in fp32; the root keeps its inputs (the
    latent state) as they come and returns fp32, so the model's skip runs in fp32 (without it, a
    fresh operator returned its input rounded to bf16, off by up to 3.9e-3 at |z| ~ 1). fp32: no
    casts at all.
    """
    # Here, not at the top: every command imports this module, and FSDP's import (0.8 s, DTensor's) is
    # for a run that shards.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    check_resolved(precision)
    if precision != "bf16":
        return MixedPrecisionPolicy(), MixedPrecisionPolicy()
    block = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                output_dtype=torch.float32, cast_forward_inputs=False)
    return block, root


def enable_tf32(device: torch.device) -> None:
    """TF32 for fp32 matmuls on CUDA (frozen forwards, evaluation and fp32 runs); nothing elsewhere.

    A process-wide backend setting: 10 mantissa bits in the products, fp32 accumulation.
    """
    if device.type == "cuda":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
