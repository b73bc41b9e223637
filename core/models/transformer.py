"""Plain transformer operator ``transformer``: a peer of ``pdet_unet`` with global attention.

Legend: B batch, L tokens, D latent dim, H hidden dim, N heads, E head dim.

Token embedding (a linear map D -> H), a learned position per token, the conditioning vector
(dt and task id, as ``pdet_unet``) added to every token, ``depth`` pre-norm layers (`core.models.layers.MixerBlock`) with
global attention over all L tokens, then a linear head predicting the step ``z_next - z``. No
windows, merges or adaLN: the baseline that tells what the PDE-Transformer's structure buys.
The head starts at zero, so a fresh operator returns z exactly (the persistence baseline);
``residual=False`` predicts ``z_next`` itself instead (the ablation of that identity start).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from core.models.conditioning import ConditionEmbedding
from core.models.layers import MixerBlock
from core.models.registry import register
from core.models.settings import SETTINGS, heads_divide, positive


@dataclass(**SETTINGS)
class TransformerSettings:
    """Plain transformer operator: global attention over all tokens (config ``operator.transformer``)."""

    hidden_dim: int = 64
    """Width of every layer."""
    depth: int = 4
    """Pre-norm encoder layers."""
    num_heads: int = 4
    """Attention heads per layer."""
    mlp_ratio: float = 4.0
    """MLP width relative to the layer width."""

    def __post_init__(self):
        positive(self, "hidden_dim", "depth", "num_heads", "mlp_ratio")
        heads_divide(self)


# `tokens`: its learned position table covers the longest latent of the config's tasks.
@register("operator", "transformer", settings=TransformerSettings, stack_args=("tokens",))
class TransformerOperator(nn.Module):
    """Latent operator ``(z_BLD, dt_B, task_id_B) -> z_next_BLD`` (the contract of ``PDETUNet``).

    Args:
        dim: D, latent token width (input and output).
        tokens: the most tokens L a latent may have (size of the learned position table).
        hidden_dim: H, width of every layer and of the conditioning vector.
        depth: encoder layers.
        num_heads: attention heads per layer.
        num_tasks: size of the task-id table.
        mlp_ratio: MLP hidden width / H.
        residual: return ``z + f(z)`` (True: the identity start) or ``f(z)`` alone (False).
    """

    def __init__(self, dim: int, tokens: int, hidden_dim: int, depth: int, num_heads: int, num_tasks: int,
                 mlp_ratio: float = 4.0, residual: bool = True) -> None:
        super().__init__()
        if tokens < 1 or depth < 1:
            raise ValueError(f"tokens and depth must be >= 1, got {tokens}, {depth}")
        self.dim, self.tokens, self.residual = dim, tokens, residual
        self.cond = ConditionEmbedding(hidden_dim, num_tasks)
        self.in_proj = nn.Linear(dim, hidden_dim)
        self.pos_LH = nn.Parameter(torch.empty(tokens, hidden_dim))
        nn.init.normal_(self.pos_LH, std=0.02)
        self.layers = nn.ModuleList(MixerBlock(hidden_dim, num_heads, mlp_ratio) for _ in range(depth))
        self.out_norm = nn.LayerNorm(hidden_dim)
        self.out_proj = nn.Linear(hidden_dim, dim)
        # Zero head: a fresh operator returns z exactly (the persistence baseline), as pdet_unet does.
        nn.init.zeros_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def blocks(self) -> list[MixerBlock]:
        """The encoder layers, each a unit for FSDP2 ``fully_shard`` (the position table stays in the root)."""
        return list(self.layers)

    def forward(self, z_BLD: Tensor, dt_B: Tensor, task_id_B: Tensor) -> Tensor:
        """z_BLD: [B, L, D] with L <= tokens, dt_B: [B], task_id_B: int64 [B] -> next latent [B, L, D]."""
        L = z_BLD.shape[1]
        if L > self.tokens:
            raise ValueError(f"{L} tokens given to a transformer operator built for at most {self.tokens}")
        c_BH = self.cond(dt_B, task_id_B)
        # In the weights' dtype: under FSDP2's bf16 policy the root receives the fp32 latent state uncast.
        x = self.in_proj(z_BLD.to(self.in_proj.weight.dtype))
        x = x + self.pos_LH[:L].to(x.dtype) + c_BH[:, None, :].to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        delta_BLD = self.out_proj(self.out_norm(x))
        # The skip in the latent state's own dtype (fp32), as pdet_unet's.
        return z_BLD + delta_BLD.to(z_BLD.dtype) if self.residual else delta_BLD
