"""Steady stage step: a conditional prior ``z_coef -> z_sol`` for steady tasks (Darcy).

Legend: B batch, L tokens, D latent dim, K noise levels.

The same refiner objective as the diffusion stage (core/steps/common.py), with the
coefficient latent as the condition and the solution latent as the clean target. There is
no time step: the denoiser gets ``dt = 0``.

Batch keys: ``z_coef``, ``z_sol`` [B, L, D]; ``task_id`` [B] int64; ``sample_id`` [B] int64.
"""

from __future__ import annotations


import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn
from torch.func import functional_call

from core.noise import refiner_sigmas
from core.steps.common import NoiseSource, RefinerStepConfig, make_metrics, refiner_loss, refiner_sample, sample_keys, step_seed


SteadyStepConfig = RefinerStepConfig
"""Settings of the steady prior (see `RefinerStepConfig`)."""


def steady_step(model: nn.Module, params: dict[str, Tensor], batch: TensorDictBase, *,
                cfg: SteadyStepConfig, generator: torch.Generator) -> tuple[Tensor, TensorDict]:
    """Refiner loss of a Denoiser ``(x_noisy, cond=z_coef, sigma, dt=0, task_id) -> z_sol_hat``; batch mean.

    Metrics: ``denoised_mse`` (x-space error of the solution estimate) and ``level_mean``.
    """
    z_coef, z_sol = batch["z_coef"], batch["z_sol"]
    keys = sample_keys(step_seed(generator), batch)
    dt_B = torch.zeros(z_sol.shape[0], device=z_sol.device, dtype=torch.float32)

    def fn(*args: Tensor) -> Tensor:
        return functional_call(model, params, args)

    loss_B, denoised_B, level_B = refiner_loss(fn, z_sol, z_coef, dt_B, batch["task_id"], keys,
                                               sigmas_K=refiner_sigmas(cfg.num_levels, cfg.sigma_min),
                                               sigma_data=cfg.sigma_data)
    return loss_B.mean(), make_metrics(denoised_mse=denoised_B.mean(), level_mean=level_B.float().mean())


@torch.no_grad()
def steady_sample(denoiser: nn.Module, z_coef: Tensor, task_id: Tensor, *, num_levels: int, sigma_min: float,
                  generator: NoiseSource) -> Tensor:
    """Solution latent from the coefficient latent: predict from zeros, then refine. -> [B, L, D].

    No grad; draws from (and advances) ``generator``; use the training config's values.
    """
    dt_B = torch.zeros(z_coef.shape[0], device=z_coef.device, dtype=torch.float32)
    return refiner_sample(denoiser, z_coef, dt_B, task_id, sigmas_K=refiner_sigmas(num_levels, sigma_min),
                          generator=generator)
