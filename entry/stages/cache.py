"""The latent cache's record (`SPEC`): every trajectory encoded once by the trained autoencoder,
read by the stages that train on latent pairs. It trains nothing; entry.cache builds it
(entry.data.latent_cache)."""

from __future__ import annotations

from entry.stages.spec import BASE_SECTIONS, StageSpec, always

SPEC = StageSpec("cache", ("autoencoder",), ("autoencoder",), BASE_SECTIONS, always)
"""Reads the autoencoder's weights; its result depends on the data, the latent and the codec."""
