"""Neural network modules: grid encoder/decoder, conditioning, the pdet_unet operator, the denoiser."""

from core.models.conditioning import AdaLNZero, ConditionEmbedding, fourier_embedding, modulate
from core.models.denoiser import Denoiser
from core.models.grid_codec import GridDecoder, GridEncoder, cell_centres
from core.models.layers import morton_permutation
from core.models.pdet import PDETBlock, PDETUNet, TokenMerge, TokenSplit, WindowAttention

__all__ = [
    "AdaLNZero", "ConditionEmbedding", "Denoiser", "GridDecoder", "GridEncoder", "PDETBlock", "PDETUNet",
    "TokenMerge", "TokenSplit", "WindowAttention", "cell_centres", "fourier_embedding", "modulate",
    "morton_permutation",
]
