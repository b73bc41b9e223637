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

``sigma_data`` must match the signal: the operator's latent residual is ~100x smaller than
the latents, and with sd = 1 on it c_skip, c_out and c_in are all off by that factor. It is
a persistent buffer (``SIGMA_DATA_KEY``), so exported weights carry the value they were
trained with and a Denoiser loaded from them uses it, whatever it was built with.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from core.models.pdet import PDETBlock, PDETUNet
from core.models.registry import register

# Floor for log(sigma): sigma = 0 (no noise) would give -inf in the noise embedding.
_SIGMA_FLOOR = 1e-8

SIGMA_DATA_KEY = "edm_sigma_data"
"""State-dict key (buffer name) of the Denoiser's sigma_data, a float32 0-d tensor."""

SOLUTION_MEAN_KEY = "prior_solution_mean"
"""State-dict key (buffer name) of the steady prior's solution mean: float32 [T, L, D], the
training mean of each task's solution latent, which the prior learns its deviation from; empty
[0] when it has none. The forward pass does not read it: the steady step and sampler do."""


@register("denoiser", "pdet_unet")
class Denoiser(nn.Module):
    """EDM-preconditioned ``PDETUNet`` (cond_noise=True, extra_in=D, residual=False).

    Args:
        dim: D, latent width of both the noisy input and the conditioning latent.
        hidden_dim, depths, num_heads, group_size, num_tasks, mlp_ratio, token_conv: as ``PDETUNet``.
        sigma_data: typical scale (RMS) of the clean signal ``x``; for the diffusion
            residual stage, that of ``z_next - op(z_t)``. Stored as a float32 buffer; loading
            weights replaces it with theirs (weights saved before it was stored keep this value).
        solution_mean: the steady prior's [T, L, D] training mean of the solutions (see
            ``SOLUTION_MEAN_KEY``); None for none. Loading weights replaces it with theirs.
    """

    def __init__(self, dim: int, hidden_dim: int, depths: tuple[int, ...], num_heads: int, group_size: int,
                 num_tasks: int, mlp_ratio: float = 4.0, sigma_data: float = 1.0, token_conv: bool = False,
                 solution_mean: Tensor | None = None) -> None:
        super().__init__()
        if sigma_data <= 0:
            raise ValueError(f"sigma_data must be > 0, got {sigma_data}")
        self.dim, self.num_tasks = dim, num_tasks
        self.register_buffer(SIGMA_DATA_KEY, torch.tensor(float(sigma_data), dtype=torch.float32))
        self.register_buffer(SOLUTION_MEAN_KEY, torch.zeros(0))
        self.set_solution_mean(solution_mean)
        self.net = PDETUNet(dim, hidden_dim, depths, num_heads, group_size, num_tasks, mlp_ratio=mlp_ratio,
                            cond_noise=True, extra_in=dim, residual=False, token_conv=token_conv)

    def set_solution_mean(self, solution_mean: Tensor | None) -> None:
        """Store the steady prior's [T, L, D] solution mean (a float32 copy; None: none). Separate from
        the constructor so a model built from its plain-JSON description (core.models.registry) can
        take one; loading weights replaces it anyway."""
        if solution_mean is not None and (solution_mean.ndim != 3 or solution_mean.shape[0] != self.num_tasks
                                          or solution_mean.shape[2] != self.dim):
            raise ValueError(f"solution_mean must be [tasks={self.num_tasks}, L, dim={self.dim}], "
                             f"got {tuple(solution_mean.shape)}")
        mean = torch.zeros(0) if solution_mean is None else solution_mean.detach()
        setattr(self, SOLUTION_MEAN_KEY, mean.to(torch.float32).clone())

    @property
    def sigma_data(self) -> float:
        """The stored sigma_data as a Python float (reads the buffer: a device sync on CUDA)."""
        return float(getattr(self, SIGMA_DATA_KEY))

    @property
    def solution_mean(self) -> Tensor | None:
        """The stored [T, L, D] solution mean, or None when the prior has none."""
        mean = getattr(self, SOLUTION_MEAN_KEY)
        return mean if mean.numel() else None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Weights exported before sigma_data was stored lack the key; they were all trained
        # with the value the Denoiser is built with (1.0 then), so keep it instead of failing
        # a strict load. ``load_state_dict`` hands us its own shallow copy to amend.
        key = prefix + SIGMA_DATA_KEY
        if key not in state_dict:
            state_dict[key] = getattr(self, SIGMA_DATA_KEY).detach().clone()
        # The solution mean: weights saved before it existed have none (the empty buffer); stored
        # weights bring their own shape, which a Denoiser built only to load them cannot know.
        key = prefix + SOLUTION_MEAN_KEY
        mine = getattr(self, SOLUTION_MEAN_KEY)
        if key not in state_dict:
            state_dict[key] = torch.zeros(0, device=mine.device)
        if state_dict[key].shape != mine.shape:
            setattr(self, SOLUTION_MEAN_KEY, torch.empty(state_dict[key].shape, dtype=mine.dtype, device=mine.device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

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
        # The buffer tensor, not the float property: no host sync, and torch.compile sees an input.
        sd = getattr(self, SIGMA_DATA_KEY).float()
        sd2 = sd**2
        var_B = sigma_B**2 + sd2
        c_skip = (sd2 / var_B)[:, None, None]
        c_out = (sigma_B * sd * torch.rsqrt(var_B))[:, None, None]
        c_in = torch.rsqrt(var_B)[:, None, None]
        c_noise_B = torch.log(sigma_B.clamp_min(_SIGMA_FLOOR)) / 4
        f_BLD = self.net(c_in * x_noisy_BLD, dt_B, task_id_B, noise_B=c_noise_B, extra_BLD=cond_BLD)
        # The skip in fp32 (the precision contract): the network's output may be bf16.
        return c_skip * x_noisy_BLD + c_out * f_BLD.float()
