"""Autoencoder stage step: per-sample relative reconstruction error of the fields.

Legend: B batch, C channels, S spatial axes.

Batch keys: ``u`` [B, C, *S] (float), ``sample_id`` [B] (int64; unused: the step draws
no randomness, but every batch carries it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn
from torch.func import functional_call

from core.steps.common import make_metrics, per_sample_mse


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoencoderStepConfig:
    """Settings of the reconstruction loss."""

    relative: bool = True
    """Divide each sample's MSE by its field's mean square (a squared nRMSE). Tasks whose
    fields differ by orders of magnitude then weigh the same, and the loss matches the
    PDEBench nRMSE the stack is scored on. False: plain MSE."""
    eps: float = 1e-8
    """Added to the mean square in the relative loss (an all-zero field stays finite)."""

    def __post_init__(self):
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


def autoencoder_step(model: nn.Module, params: dict[str, Tensor], batch: TensorDictBase, *,
                     cfg: AutoencoderStepConfig, generator: torch.Generator | None = None
                     ) -> tuple[Tensor, TensorDict]:
    """Reconstruction loss of ``Autoencoder`` (``model(u) -> (z, u_hat)``).

    Returns the batch mean of the per-sample loss and metrics ``mse`` (plain) and
    ``rel_mse`` (relative), both batch means. ``generator`` is accepted for the common step
    signature and not used.
    """
    u = batch["u"]
    _, u_hat = functional_call(model, params, (u,))
    mse_B = per_sample_mse(u_hat, u)
    rel_B = mse_B / (u.float().square().flatten(1).mean(1) + cfg.eps)
    loss_B = rel_B if cfg.relative else mse_B
    return loss_B.mean(), make_metrics(mse=mse_B.mean(), rel_mse=rel_B.mean())
