"""Each training stage's step settings as the config gives them (a build adds what it measures,
e.g. the denoiser's sigma_data): read by the stage record (entry.stages.record), the builds and
the evaluation's samplers, so that a probe, a training step and a prediction use the same."""

from __future__ import annotations

from core.steps import (AutoencoderStepConfig, ConsistencyStepConfig, DiffusionStepConfig, OperatorStepConfig,
                        SteadyStepConfig)
from entry.config.schema import Config


def autoencoder_step_config(cfg: Config) -> AutoencoderStepConfig:
    """The autoencoder step's settings (its reconstruction loss)."""
    return AutoencoderStepConfig(loss=cfg.autoencoder.loss)


def operator_step_config(cfg: Config) -> OperatorStepConfig:
    """The operator step's settings: latent loss only. The step's decoded loss
    (`OperatorStepConfig.decoded_loss_weight`) is not a config key: the latent-cache loader's
    batches hold latents, not the decoded target fields that loss needs."""
    op = cfg.operator
    return OperatorStepConfig(input_noise=op.input_noise, unroll_grad=op.unroll_grad)


def diffusion_step_config(cfg: Config) -> DiffusionStepConfig:
    """The residual denoiser's step settings (its sigma_data is the build's)."""
    return DiffusionStepConfig(num_levels=cfg.diffusion.noise_levels, sigma_min=cfg.diffusion.sigma_min,
                               continuous_levels=cfg.diffusion.continuous_levels)


def consistency_step_config(cfg: Config) -> ConsistencyStepConfig:
    """The consistency student's step settings (its sigma_data is the teacher's)."""
    return ConsistencyStepConfig(sigma_min=cfg.diffusion.sigma_min)


def steady_step_config(cfg: Config) -> SteadyStepConfig:
    """The steady prior's step settings, also its sampler's (levels, sigma_min)."""
    return SteadyStepConfig(num_levels=cfg.steady.noise_levels)
