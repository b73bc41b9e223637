"""Denoiser: the ``pdet_unet`` backbone conditioned on a latent and a noise level.

Legend: B batch, L tokens, D latent dim.

One module serves the diffusion residual (condition = operator prediction z_op), the
consistency student (same inputs, one or two steps) and the steady prior (condition =
coefficient latent). The noise is additive (variance exploding, ``core.noise.add_noise``):
``x_noisy = x + sigma * eps``. The network output is EDM-preconditioned (Karras et al.
2022) so that its target has unit scale at every sigma:

    D(x_noisy; sigma) = c_skip * x_noisy + c_out * F(c_in * x_noisy, cond, log(sigma) / 4)
    c_skip = sd^2 / (sigma^2 + sd^2), c_out = sigma * sd / sqrt(sigma^2 + sd^2),
    c_in = 1 / sqrt(sigma^2 + sd^2),  sd = sigma_data.

``D`` predicts the clean signal; the noise is ``(x_noisy - D) / sigma`` if a step needs
it. As sigma -> 0, c_skip -> 1 and c_out -> 0, so ``D(x; 0) = x``: the consistency
boundary condition holds by construction (approximately at sigma_min > 0).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from core.models.pdet import PDETBlock, PDETUNet

# Floor for log(sigma): sigma = 0 (no noise) would give -inf in the noise embedding.
_SIGMA_FLOOR = 1e-8


class Denoiser(nn.Module):
    """EDM-preconditioned ``PDETUNet`` (cond_noise=True, extra_in=D, residual=False).

    Args:
        dim: D, latent width of both the noisy input and the conditioning latent.
        hidden_dim, depths, num_heads, group_size, num_tasks, mlp_ratio: as ``PDETUNet``.
        sigma_data: typical scale (std) of the clean signal ``x``; for the diffusion
            residual stage, the std of ``z_next - op(z_t)``.
    """

    def __init__(self, dim: int, hidden_dim: int, depths: tuple[int, ...], num_heads: int, group_size: int,
                 num_tasks: int, mlp_ratio: float = 4.0, sigma_data: float = 1.0) -> None:
        super().__init__()
        if sigma_data <= 0:
            raise ValueError(f"sigma_data must be > 0, got {sigma_data}")
        self.sigma_data = sigma_data
        self.net = PDETUNet(dim, hidden_dim, depths, num_heads, group_size, num_tasks, mlp_ratio=mlp_ratio,
                            cond_noise=True, extra_in=dim, residual=False)

    def blocks(self) -> list[PDETBlock]:
        """The backbone's transformer blocks, for FSDP2 ``fully_shard``."""
        return self.net.blocks()

    def forward(self, x_noisy_BLD: Tensor, cond_BLD: Tensor, noise_B: Tensor, dt_B: Tensor,
                task_id_B: Tensor) -> Tensor:
        """Predict the clean signal.

        Args:
            x_noisy_BLD: [B, L, D] noisy signal ``x + sigma * eps``.
            cond_BLD: [B, L, D] conditioning latent (z_op or the coefficient latent).
            noise_B: [B] noise std sigma >= 0 (a 0-d tensor is broadcast).
            dt_B: [B] time step; task_id_B: int64 [B] task ids.
        Returns:
            [B, L, D] estimate of the clean ``x``.
        """
        B = x_noisy_BLD.shape[0]
        sigma_B = torch.as_tensor(noise_B, device=x_noisy_BLD.device).to(torch.float32).expand(B)
        sd2 = self.sigma_data**2
        var_B = sigma_B**2 + sd2
        c_skip = (sd2 / var_B)[:, None, None]
        c_out = (sigma_B * self.sigma_data * torch.rsqrt(var_B))[:, None, None]
        c_in = torch.rsqrt(var_B)[:, None, None]
        c_noise_B = torch.log(sigma_B.clamp_min(_SIGMA_FLOOR)) / 4
        f_BLD = self.net(c_in * x_noisy_BLD, dt_B, task_id_B, noise_B=c_noise_B, extra_BLD=cond_BLD)
        return c_skip * x_noisy_BLD + c_out * f_BLD
