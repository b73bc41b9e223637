"""Autoencoder stage step: per-sample reconstruction error of the fields, relative by default.

Legend: B batch, C channels, S spatial axes.

Batch keys: ``u`` [B, C, *S] (float), ``sample_id`` [B] (int64; unused: the step draws
no randomness, but every batch carries it); optional: ``task_id`` [B] (int64), ``task`` (the one task id
of all rows as a host int, non-tensor data: read without a device sync). A batch of pairs (a field
codec fitting new fields by the forecast, `autoencoder_step`'s ``operator``) holds ``u_t``,
``u_next`` [B, C, *S] and ``dt`` [B] in place of ``u``.
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
                     cfg: AutoencoderStepConfig, generator: torch.Generator | None = None,
                     operator: nn.Module | None = None) -> tuple[Tensor, TensorDict]:
    """Reconstruction loss of a codec (``model(u, task) -> (z, u_hat)``; ``task`` the batch's ``task``,
    the task id of all its rows as a host int, where it has one, else its ``task_id`` [B], else None).

    A batch of pairs (``u_t``, ``u_next``, ``dt``) adds the loss of the forecast through ``operator``
    (frozen: ``operator(z, dt, task_id) -> z_next``; required then): the codec's decoding of the
    operator's step from its encoding of u_t against u_next, the same per-sample loss, added to the
    reconstruction of u_t (a field codec, ``model(u, task, step=...)``: `core.models.field_codec`).

    Returns the batch mean of the per-sample loss (``cfg.loss``) and metrics ``mse`` (plain) and
    ``rel_mse`` (the squared relative error) of the reconstruction, both batch means, and with pairs
    ``forecast_rel_mse``. ``generator`` is accepted for the common step signature and not used.
    """
    paired = "u_next" in batch.keys()
    u = batch["u_t"] if paired else batch["u"]
    # The task tells a field codec which fields the batch holds (the others ignore it).
    task = batch.get_non_tensor("task", None)
    args = (u, batch.get("task_id", None) if task is None else task)
    if not paired:
        _, u_hat = functional_call(model, params, args)
        loss_B, metrics = _frame_loss(u_hat, u, cfg)
        return loss_B.mean(), make_metrics(**metrics)
    if operator is None:
        raise ValueError("a batch of pairs (u_t, u_next) needs the frozen operator= the forecast runs through")
    dt, task_id = batch["dt"], batch["task_id"]
    _, u_hat, next_hat = functional_call(model, params, args, {"step": lambda z: operator(z, dt, task_id)})
    loss_B, metrics = _frame_loss(u_hat, u, cfg)
    forecast_B, forecast = _frame_loss(next_hat, batch["u_next"], cfg)
    return (loss_B + forecast_B).mean(), make_metrics(**metrics, forecast_rel_mse=forecast["rel_mse"])


def _frame_loss(u_hat: Tensor, u: Tensor, cfg: AutoencoderStepConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Per frame, the loss ``cfg.loss`` of ``u_hat`` against ``u`` [B]; and the batch means of its plain
    and relative squared errors (``mse``, ``rel_mse``)."""
    mse_B = per_sample_mse(u_hat, u)
    rel_B = mse_B / (u.float().square().flatten(1).mean(1) + cfg.eps)
    if cfg.loss == "nrmse":
        loss_B = field_nrmse(u_hat, u)
    else:
        loss_B = rel_B if cfg.loss == "squared_relative" else mse_B
    return loss_B, {"mse": mse_B.mean(), "rel_mse": rel_B.mean()}


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
