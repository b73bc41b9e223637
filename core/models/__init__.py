"""Neural network modules: the codecs (``grid``, ``conv``), conditioning, the operators (``pdet_unet``,
``transformer``), the denoiser, the peers (FNO, U-Net, plain transformer), and the registry that builds
any of them by name (``core.models.registry``).

Every module of this package is imported here (the names below, then any other module found beside
them): a model registers itself when its module is imported, and this package's ``__init__`` runs
before any of its modules, so the registry is always complete, and a new model is one new file."""

import importlib
import pkgutil

from core.models.autoencoder import Autoencoder, grid_autoencoder
from core.models.conditioning import AdaLNZero, ConditionEmbedding, fourier_embedding, modulate
from core.models.conv_codec import ConvDecoder, ConvEncoder, conv_autoencoder, fit_linear
from core.models.denoiser import Denoiser
from core.models.fno import FNO1d, FNO2d
from core.models.grid_codec import GridDecoder, GridEncoder, cell_centres
from core.models.layers import morton_permutation
from core.models.pdet import PDETBlock, PDETUNet, TokenMerge, TokenSplit, WindowAttention
from core.models.plain_transformer import PlainTransformer
from core.models.registry import build, describe, names, rebuild, register
from core.models.transformer import TransformerOperator
from core.models.unet import UNet1d, UNet2d

# A model module not imported above registers itself here: pkgutil lists the package's modules
# through the import system's own finder, the lookup an import by name makes.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "AdaLNZero", "Autoencoder", "ConditionEmbedding", "ConvDecoder", "ConvEncoder", "Denoiser", "FNO1d", "FNO2d",
    "GridDecoder", "GridEncoder", "PDETBlock", "PDETUNet", "PlainTransformer", "TokenMerge", "TokenSplit",
    "TransformerOperator", "UNet1d", "UNet2d", "WindowAttention", "build", "cell_centres", "conv_autoencoder",
    "describe", "fit_linear", "fourier_embedding", "grid_autoencoder", "modulate", "morton_permutation", "names",
    "rebuild", "register",
]
