"""Models a user would pick from a library, trained by `bench.accuracy` beside ours and our FNO.

neuraloperator's FNO (package ``neuraloperator``, optional extra ``peers``): the library's
`neuralop.models.FNO` with its defaults except what the task fixes (modes, channels), stepped
exactly as our PDEBench-style FNO is (the last ``initial_step`` frames stacked as channels in,
the next frame out), so `bench.fno_baseline.train_fno` trains it with PDEBench's loss, optimiser
and schedule on the same files, split and budget.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor, nn

NEURALOP_FNO = {"n_modes_per_axis": 12, "hidden_channels": 32, "n_layers": 4}
"""neuraloperator FNO settings: PDEBench's 12 modes per axis, the library's documented example
width (32) and its default depth (4); everything else is the library's default."""


def neuralop_available() -> bool:
    """Whether the optional ``neuraloperator`` package is installed (``pip install -e .[peers]``)."""
    return importlib.util.find_spec("neuralop") is not None


def build_neuralop_fno(u_NTCS: Tensor, initial_step: int, *, seed: int = 0) -> nn.Module:
    """neuraloperator's FNO mapping ``[B, C * initial_step, *S] -> [B, C, *S]``, initialised
    from ``seed`` only (the caller's RNG state is untouched).

    Raises:
        ModuleNotFoundError: ``neuraloperator`` is not installed.
    """
    from neuralop.models import FNO

    spatial = u_NTCS.ndim - 3
    channels = u_NTCS.shape[2]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FNO(n_modes=(NEURALOP_FNO["n_modes_per_axis"],) * spatial, in_channels=channels * initial_step,
                   out_channels=channels, hidden_channels=NEURALOP_FNO["hidden_channels"],
                   n_layers=NEURALOP_FNO["n_layers"])


def neuralop_config(model: nn.Module) -> dict:
    """What the result file records about the peer: package version, settings, parameter count."""
    import neuralop

    return {"package": "neuraloperator", "version": getattr(neuralop, "__version__", "unknown"),
            **NEURALOP_FNO, "parameters": sum(p.numel() for p in model.parameters())}
