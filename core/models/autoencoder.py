"""The field autoencoder: a grid encoder and decoder trained together on reconstruction.

Legend: B batch, C channels, S spatial axes (X or X, Y), L tokens, D latent dim.
"""

from __future__ import annotations

from torch import Tensor, nn


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

    def forward(self, u: Tensor) -> tuple[Tensor, Tensor]:
        """u: [B, C, *S] -> (z [B, L, D], u_hat [B, C, *S]) on the input's own grid."""
        z = self.encoder(u)
        return z, self.decoder(z, tuple(u.shape[2:]))
