"""Autoencoder stage step: per-sample reconstruction error of the fields, relative by default.

Legend: B batch, C channels, S spatial axes.

Batch keys: ``u`` [B, C, *S] (float), ``sample_id`` [B] (int64; unused: the step draws
no randomness, but every batch carries it); optional: ``task_id`` [B] (int64), ``task`` (the one task id
of all rows as a host int, non-tensor data: read without a device sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn
from torch.func import functional_call

from core.metrics import RECONSTRUCTION_LOSSES
from core.steps.common import make_metrics, per_sample_mse


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoencoderStepConfig:
    """Settings of the reconstruction loss."""

    loss: str = "squared_relative"
    """What each frame contributes, one of `core.metrics.RECONSTRUCTION_LOSSES`: "squared_relative",
    its MSE over its fields' mean square (a squared whole-frame nRMSE: tasks whose fields differ by
    orders of magnitude weigh the same); "nrmse", each field's nRMSE, not squared, mean over the
    frame's fields (`field_nrmse`); "mse", the plain MSE. Near a good linear path a squared error's
    gradients are small and heavy-tailed: on 2D Navier-Stokes a conv codec's correction trained
    150 s with AdamW on the normalised MSE did not move from PCA, where "nrmse" (scale-free per
    frame) halved its MSE."""
    eps: float = 1e-8
    """Added to the mean square in the relative loss (an all-zero field stays finite)."""

    def __post_init__(self):
        if self.loss not in RECONSTRUCTION_LOSSES:
            raise ValueError(f"loss must be one of {RECONSTRUCTION_LOSSES}, got {self.loss!r}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


def autoencoder_step(model: nn.Module, params: dict[str, Tensor], batch: TensorDictBase, *,
                     cfg: AutoencoderStepConfig, generator: torch.Generator | None = None
                     ) -> tuple[Tensor, TensorDict]:
    """Reconstruction loss of a codec (``model(u, task) -> (z, u_hat)``; ``task`` the batch's ``task``,
    the task id of all its rows as a host int, where it has one, else its ``task_id`` [B], else None).

    Returns the batch mean of the per-sample loss (``cfg.loss``) and metrics ``mse`` (plain) and
    ``rel_mse`` (the squared relative error), both batch means. ``generator`` is accepted for the common step
    signature and not used.
    """
    u = batch["u"]
    # The task tells a field codec which fields the batch holds (the others ignore it).
    task = batch.get_non_tensor("task", None)
    _, u_hat = functional_call(model, params, (u, batch.get("task_id", None) if task is None else task))
    mse_B = per_sample_mse(u_hat, u)
    rel_B = mse_B / (u.float().square().flatten(1).mean(1) + cfg.eps)
    if cfg.loss == "nrmse":
        loss_B = field_nrmse(u_hat, u)
    else:
        loss_B = rel_B if cfg.loss == "squared_relative" else mse_B
    return loss_B.mean(), make_metrics(mse=mse_B.mean(), rel_mse=rel_B.mean())


def field_nrmse(u_hat: Tensor, u: Tensor) -> Tensor:
    """Per frame, the mean over its fields of each field's nRMSE (RMS error over RMS value, not
    squared). u_hat, u [B, C, *S] -> [B], in u's dtype (at least float32). A field that is zero on
    a frame has no relative error and is left out of that frame's mean (a frame whose fields are all
    zero scores 0); the gradient stays finite where the error is zero."""
    dtype = torch.promote_types(u.dtype, torch.float32)
    err_BC = (u_hat.to(dtype) - u.to(dtype)).flatten(2).square().mean(2)
    ms_BC = u.detach().to(dtype).flatten(2).square().mean(2)
    present = ms_BC > 0
    ratio = (err_BC + 1e-30) / torch.where(present, ms_BC, 1.0)  # 1e-30: sqrt's gradient at zero error
    return ratio.sqrt().where(present, 0).sum(1) / present.sum(1).clamp_min(1)
