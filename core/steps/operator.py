"""Operator stage step: one latent time step ``(z_t, dt, task) -> z_next``.

Legend: B batch, L tokens, D latent dim, C channels, S spatial axes.

Batch keys: ``z_t``, ``z_next`` [B, L, D]; ``dt`` [B] float; ``task_id`` [B] int64;
``sample_id`` [B] int64 (and ``t`` [B] when present, see core/steps/common.py); optional
``u_next`` [B, C, *S], the decoded target field for the field-space loss; optional
``z_seq`` [B, R, L, D], the targets of an R-step unrolled rollout (``z_seq[:, 0] == z_next``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn
from torch.func import functional_call

from core.steps.common import STREAM_INPUT_NOISE, make_metrics, per_sample_mse, sample_keys, sample_normal, step_seed


@dataclass(frozen=True, kw_only=True, slots=True)
class OperatorStepConfig:
    """Settings of the operator loss."""

    input_noise: float = 0.0
    """Std of Gaussian noise added to ``z_t`` in training (robustness to the operator's own
    rollout errors); 0 disables it. Drawn per sample from (generator seed, sample key)."""
    decoded_loss_weight: float = 0.0
    """Weight of ``mse(decoder(pred), u_next)``; needs ``u_next`` in the batch and the frozen
    ``decoder=`` module. 0 disables it."""
    unroll_grad: str = "full"
    """With ``z_seq`` in the batch: "full" back-propagates through the whole rollout;
    "pushforward" detaches each step's input (Brandstetter et al. 2022): the model learns
    from inputs its own rollout produced, at the cost of one step's graph at a time."""

    def __post_init__(self):
        if self.unroll_grad not in ("full", "pushforward"):
            raise ValueError(f"unroll_grad must be 'full' or 'pushforward', got {self.unroll_grad!r}")
        if self.input_noise < 0:
            raise ValueError(f"input_noise must be >= 0, got {self.input_noise}")
        if self.decoded_loss_weight < 0:
            raise ValueError(f"decoded_loss_weight must be >= 0, got {self.decoded_loss_weight}")


def operator_step(model: nn.Module, params: dict[str, Tensor], batch: TensorDictBase, *,
                  cfg: OperatorStepConfig, generator: torch.Generator,
                  decoder: nn.Module | None = None, task_weight: Tensor | None = None) -> tuple[Tensor, TensorDict]:
    """Latent MSE per sample (+ weighted decoded-field MSE); returns the batch mean.

    With ``task_weight`` [T] each sample's loss is multiplied by its task's weight (the metrics
    stay unweighted): a multi-task model then weighs every task's error in units of its own.

    With ``z_seq`` [B, R, L, D] in the batch the operator is rolled out R steps from ``z_t``
    (its own predictions fed back) and the latent MSE is the mean over the R steps; the
    decoded loss, when enabled, scores the first step. ``decoder`` is a frozen module called with its own parameters. Gradients must flow
    through it into the prediction, so it is not run under ``no_grad``; instead its
    parameters must not require grad (``entry`` loads frozen networks that way), which
    this step checks. Metrics: ``latent_mse`` and, when enabled, ``decoded_mse``.
    """
    z_t, z_next = batch["z_t"], batch["z_next"]
    if cfg.input_noise > 0:
        keys = sample_keys(step_seed(generator), batch)
        z_t = z_t + cfg.input_noise * sample_normal(keys, STREAM_INPUT_NOISE, tuple(z_t.shape[1:]), dtype=z_t.dtype)
    pred = functional_call(model, params, (z_t, batch["dt"], batch["task_id"]))
    latent_B = per_sample_mse(pred, z_next)
    if "z_seq" in batch.keys():
        z_seq = batch["z_seq"]
        step_losses, z = [latent_B], pred
        for r in range(1, z_seq.shape[1]):
            z_in = z.detach() if cfg.unroll_grad == "pushforward" else z
            z = functional_call(model, params, (z_in, batch["dt"], batch["task_id"]))
            step_losses.append(per_sample_mse(z, z_seq[:, r]))
        latent_B = torch.stack(step_losses).mean(0)
    if cfg.decoded_loss_weight == 0:
        return weighted(latent_B, batch["task_id"], task_weight).mean(), make_metrics(latent_mse=latent_B.mean())
    if "u_next" not in batch.keys():
        raise ValueError("operator decoded_loss_weight > 0 needs 'u_next' in the batch (decoded target fields)")
    if decoder is None:
        raise ValueError("operator decoded_loss_weight > 0 needs the frozen decoder= module")
    if any(p.requires_grad for p in decoder.parameters()):
        raise ValueError("the frozen decoder's parameters require grad; call decoder.requires_grad_(False)")
    u_next = batch["u_next"]
    decoded_B = per_sample_mse(decoder(pred, tuple(u_next.shape[2:])), u_next)
    loss_B = latent_B + cfg.decoded_loss_weight * decoded_B
    return (weighted(loss_B, batch["task_id"], task_weight).mean(),
            make_metrics(latent_mse=latent_B.mean(), decoded_mse=decoded_B.mean()))


def weighted(loss_B: Tensor, task_id_B: Tensor, task_weight_T: Tensor | None) -> Tensor:
    """Each sample's loss times its task's weight (the loss itself without weights). -> [B]."""
    if task_weight_T is None:
        return loss_B
    return loss_B * task_weight_T.to(loss_B.device, loss_B.dtype)[task_id_B]
