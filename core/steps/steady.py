"""Steady stage step: a conditional prior ``z_coef -> z_sol`` for steady tasks (Darcy).

Legend: B batch, L tokens, D latent dim, K noise levels.

The same refiner objective as the diffusion stage (core/steps/common.py), with the
coefficient latent as the condition and the solution latent as the clean target. There is
no time step: the denoiser gets ``dt = 0``.

With a solution mean ``m`` [T, L, D] (the training mean of each task's solution latent) the
prior learns the deviation ``z_sol - m[task]`` and the sampler adds ``m[task]`` back: level 0,
which sees zeros, then starts from the training-mean solution instead of from nothing. On Darcy
the mean is most of the field (it alone scores nRMSE 0.34), and learning it took the prior's
first 200 steps (entry/steady.py measures it; bench/results/config-history.md has the runs).

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


def deviation_from_mean(z_sol_BLD: Tensor, task_id_B: Tensor, solution_mean_TLD: Tensor | None) -> Tensor:
    """``z_sol - m[task]``: what the prior learns (``z_sol`` itself when there is no mean). -> [B, L, D]."""
    if solution_mean_TLD is None:
        return z_sol_BLD
    return z_sol_BLD - solution_mean_TLD.to(z_sol_BLD.device, z_sol_BLD.dtype)[task_id_B]


def steady_step(model: nn.Module, params: dict[str, Tensor], batch: TensorDictBase, *,
                cfg: SteadyStepConfig, generator: torch.Generator,
                solution_mean: Tensor | None = None) -> tuple[Tensor, TensorDict]:
    """Refiner loss of a Denoiser ``(x_noisy, cond=z_coef, sigma, dt=0, task_id) -> z_sol_hat``; batch mean.

    With ``solution_mean`` [T, L, D] the target is the deviation from the task's mean. Metrics:
    ``denoised_mse`` (x-space error of the solution estimate) and ``level_mean``.
    """
    z_coef = batch["z_coef"]
    z_sol = deviation_from_mean(batch["z_sol"], batch["task_id"], solution_mean)
    keys = sample_keys(step_seed(generator), batch)
    dt_B = torch.zeros(z_sol.shape[0], device=z_sol.device, dtype=torch.float32)

    def fn(*args: Tensor) -> Tensor:
        return functional_call(model, params, args)

    loss_B, denoised_B, level_B = refiner_loss(fn, z_sol, z_coef, dt_B, batch["task_id"], keys,
                                               sigmas_K=refiner_sigmas(cfg.num_levels, cfg.sigma_min),
                                               sigma_data=cfg.sigma_data, continuous=cfg.continuous_levels)
    return loss_B.mean(), make_metrics(denoised_mse=denoised_B.mean(), level_mean=level_B.float().mean())


@torch.no_grad()
def steady_sample(denoiser: nn.Module, z_coef: Tensor, task_id: Tensor, *, num_levels: int, sigma_min: float,
                  generator: NoiseSource, solution_mean: Tensor | None = None) -> Tensor:
    """Solution latent from the coefficient latent: predict from zeros, then refine, then add the
    task's solution mean back (the one it was trained with: ``Denoiser.solution_mean``). -> [B, L, D].

    No grad; draws from (and advances) ``generator``; use the training config's values.
    """
    dt_B = torch.zeros(z_coef.shape[0], device=z_coef.device, dtype=torch.float32)
    deviation = refiner_sample(denoiser, z_coef, dt_B, task_id, sigmas_K=refiner_sigmas(num_levels, sigma_min),
                               generator=generator)
    if solution_mean is None:
        return deviation
    return deviation + solution_mean.to(deviation.device, deviation.dtype)[task_id]
