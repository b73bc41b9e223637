"""Neural network modules: grid encoder/decoder, conditioning, the operators (``pdet_unet``, ``transformer``),
the denoiser, the FNO peer, and the registry that builds any of them by name (``core.models.registry``).

Every model module is imported here: a model registers itself when its module is imported, and
this package's ``__init__`` runs before any of its modules, so the registry is always complete."""

from core.models.autoencoder import Autoencoder, grid_autoencoder
from core.models.conditioning import AdaLNZero, ConditionEmbedding, fourier_embedding, modulate
from core.models.denoiser import Denoiser
from core.models.fno import FNO1d, FNO2d
from core.models.grid_codec import GridDecoder, GridEncoder, cell_centres
from core.models.layers import morton_permutation
from core.models.pdet import PDETBlock, PDETUNet, TokenMerge, TokenSplit, WindowAttention
from core.models.registry import build, describe, names, rebuild, register
from core.models.transformer import TransformerOperator

__all__ = [
    "AdaLNZero", "Autoencoder", "ConditionEmbedding", "Denoiser", "FNO1d", "FNO2d", "GridDecoder",
    "GridEncoder", "PDETBlock", "PDETUNet", "TokenMerge", "TokenSplit", "TransformerOperator", "WindowAttention",
    "build", "cell_centres", "describe", "fourier_embedding", "grid_autoencoder", "modulate", "morton_permutation",
    "names", "rebuild", "register",
]
