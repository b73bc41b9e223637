"""Each training stage's step settings as the config gives them (a build adds what it measures,
e.g. the denoiser's sigma_data): read by the stage record (entry.stages.record), the builds and
the evaluation's samplers, so that a probe, a training step and a prediction use the same."""

from __future__ import annotations

from core.steps import (AutoencoderStepConfig, ConsistencyStepConfig, DiffusionStepConfig, OperatorStepConfig,
                        SteadyStepConfig)
from entry.config.load import ConfigError
from entry.config.schema import Config


def autoencoder_step_config(cfg: Config) -> AutoencoderStepConfig:
    """The autoencoder step's settings (its reconstruction loss)."""
    return AutoencoderStepConfig(loss=cfg.autoencoder.loss)


def operator_step_config(cfg: Config) -> OperatorStepConfig:
    """The operator step's settings; a `ConfigError` for a decoded loss, which the latent-cache
    loader cannot feed (its batches hold latents, not the decoded target fields the loss needs)."""
    op = cfg.operator
    if op.decoded_loss_weight > 0:
        raise ConfigError("operator.decoded_loss_weight > 0 is not supported: the latent-cache loader gives the "
                          "step no decoded target fields; set --set operator.decoded_loss_weight=0")
    return OperatorStepConfig(decoded_loss_weight=op.decoded_loss_weight, input_noise=op.input_noise,
                              unroll_grad=op.unroll_grad)


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
