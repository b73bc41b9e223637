"""Build the stage models from a config (the config-to-constructor mapping lives here, not in core)."""

from __future__ import annotations

from torch import nn

from entry.config_schema import Config, PDETConfig

FIELD_CHANNELS = 1  # every PDEBench task here has one field channel (Darcy: coefficient or solution)


def build_autoencoder(cfg: Config) -> nn.Module:
    """Grid encoder + decoder mapping fields of any task to [L, D] tokens and back."""
    from core.models.autoencoder import Autoencoder
    from core.models.grid_codec import GridDecoder, GridEncoder

    from pipelines.tasks import get_task

    lat = cfg.latent
    # One stem per spatial dimension the config's tasks use (2D needs tokens = a power of 4).
    ndims = tuple(sorted({get_task(t.name).spatial_dims for t in cfg.data.tasks}))
    return Autoencoder(GridEncoder(FIELD_CHANNELS, lat.tokens, lat.dim, hidden=lat.hidden, ndims=ndims),
                       GridDecoder(FIELD_CHANNELS, lat.tokens, lat.dim, hidden=lat.hidden, ndims=ndims))


def _pdet_kwargs(p: PDETConfig) -> dict:
    return dict(hidden_dim=p.hidden_dim, depths=tuple(p.depths), num_heads=p.num_heads,
                group_size=p.group_size, mlp_ratio=p.mlp_ratio)


def build_operator(cfg: Config) -> nn.Module:
    """The latent time-stepping operator (`pdet_unet`)."""
    from core.models.pdet import PDETUNet

    return PDETUNet(cfg.latent.dim, num_tasks=len(cfg.data.tasks), **_pdet_kwargs(cfg.operator.pdet))


def build_denoiser(cfg: Config, pdet: PDETConfig, *, sigma_data: float = 1.0) -> nn.Module:
    """A denoiser on the shared backbone (diffusion residual, consistency student, steady prior).

    ``sigma_data`` is the EDM scale of the signal it denoises (the diffusion stage's measured
    residual RMS; 1 for the steady prior's solution latents). Loading weights replaces it with
    the stored value, so a model built only to load weights can keep the default.
    """
    from core.models.denoiser import Denoiser

    return Denoiser(cfg.latent.dim, num_tasks=len(cfg.data.tasks), sigma_data=sigma_data, **_pdet_kwargs(pdet))
