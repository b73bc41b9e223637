"""The field autoencoder: a grid encoder and decoder trained together on reconstruction.

Legend: B batch, C channels, S spatial axes (X or X, Y), L tokens, D latent dim.
"""

from __future__ import annotations

from torch import Tensor, nn

from core.models.grid_codec import GridDecoder, GridEncoder
from core.models.registry import register


class Autoencoder(nn.Module):
    """Holds ``encoder`` (``u_BCS -> z_BLD``) and ``decoder`` (``(z_BLD, grid_shape) -> u_BCS``).

    The two halves stay separate attributes so later stages can export and load them alone
    (the latent cache needs only the encoder, the operator's decoded loss only the decoder).
    """

    def __init__(self, encoder: nn.Module, decoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def encode(self, u: Tensor) -> Tensor:
        """u: [B, C, *S] -> z: [B, L, D]."""
        return self.encoder(u)

    def decode(self, z: Tensor, grid_shape: tuple[int, ...]) -> Tensor:
        """z: [B, L, D] -> u: [B, C, *grid_shape]."""
        return self.decoder(z, tuple(grid_shape))

    def for_task(self, task_id: int) -> Autoencoder:
        """The codec for task ``task_id`` of the run: itself (it reads the config's one field set;
        the field codec, ``core.models.field_codec``, binds the task's dataset)."""
        return self

    def forward(self, u: Tensor, task_id_B: Tensor | int | None = None) -> tuple[Tensor, Tensor]:
        """u: [B, C, *S] -> (z [B, L, D], u_hat [B, C, *S]) on the input's own grid. ``task_id_B`` (ids
        [B], or one id on the host) is accepted for the contract of codecs that read fields by task (and
        not used: one field set)."""
        z = self.encoder(u)
        return z, self.decoder(z, tuple(u.shape[2:]))


@register("codec", "grid")
def grid_autoencoder(channels: int, dim: int, tokens: dict[str, int], modes: dict[str, int], hidden: int = 64,
                     linear: str = "local") -> Autoencoder:
    """The grid codec (``core.models.grid_codec``) as an ``Autoencoder``, from plain JSON arguments.

    Args:
        channels: C, field channels.
        dim: D, latent token width.
        tokens: ``{"d": L_d}``, tokens per spatial dimension the codec serves ("1", "2"; JSON keys
            are strings); its keys are the codec's ``ndims``.
        modes: ``{"d": m}``, cosine modes per axis of that dimension's cells (same keys).
        hidden: width of the learned correction (0: the fitted linear path alone).
        linear: scope of the fitted linear path, "local" or "global".
    Returns:
        ``Autoencoder(GridEncoder, GridDecoder)`` with the linear path unfitted (weights carry it).
    """
    per_dim = {int(d): n for d, n in tokens.items()}
    if sorted(per_dim) != sorted(int(d) for d in modes):
        raise ValueError(f"tokens and modes must name the same dimensions, got {sorted(tokens)} and {sorted(modes)}")
    kw = dict(hidden=hidden, ndims=tuple(sorted(per_dim)), modes={int(d): m for d, m in modes.items()}, linear=linear)
    return Autoencoder(GridEncoder(channels, per_dim, dim, **kw), GridDecoder(channels, per_dim, dim, **kw))
