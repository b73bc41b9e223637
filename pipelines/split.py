"""Deterministic train / validation / test split of one file's samples.

The test set follows PDEBench's single-file loaders (``FNODatasetSingle`` and
``UNetDatasetSingle`` in ``pdebench/models/{fno,unet}/utils.py``):
``test_idx = int(num_samples * test_ratio)``; test = the FIRST ``test_idx`` samples,
training = the rest. Its training scripts then pick checkpoints on that test set; we do
not: model selection uses a validation slice drawn from the training part by a seeded
permutation, and nothing before the final evaluation reads the test indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Split", "split_indices", "split_of_sources"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Split:
    """Sorted int64 sample indices of one file; the three sets are disjoint and cover it."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    """Final evaluation only: never used for training or model selection."""


def split_indices(n: int, *, test_fraction: float = 0.1, val_fraction: float = 0.1, seed: int = 0) -> Split:
    """Split samples ``0 .. n - 1``.

    Args:
        n: samples in the file (>= 0).
        test_fraction: test = the first ``int(n * test_fraction)`` samples (PDEBench's
            truncation, so a file of fewer than 10 samples has no test set at 0.1).
        val_fraction: validation size is ``int(n_rest * val_fraction)`` of the remaining
            ``n_rest`` samples, but at least 1 when ``val_fraction > 0`` and ``n_rest >= 2``
            (model selection needs one sample, and training keeps at least one).
        seed: seeds ``np.random.default_rng`` for the validation permutation.

    Returns:
        `Split` with sorted index arrays (sorted so that h5py can read them directly).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    for name, frac in (("test_fraction", test_fraction), ("val_fraction", val_fraction)):
        if not 0.0 <= frac < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {frac}")
    n_test = int(n * test_fraction)
    rest = np.arange(n_test, n, dtype=np.int64)
    n_val = int(rest.size * val_fraction)
    if val_fraction > 0 and n_val == 0 and rest.size >= 2:
        n_val = 1
    perm = np.random.default_rng(seed).permutation(rest.size)
    val = np.sort(rest[perm[:n_val]])
    train = np.sort(rest[perm[n_val:]])
    return Split(train=train, val=val, test=np.arange(n_test, dtype=np.int64))


WELL_SPLITS = {"train": "train", "val": "valid", "test": "test"}
"""Our split names and The Well's folder names."""


def split_of_sources(rows_of: dict[str, list[int]]) -> Split | None:
    """The split a dataset's files already have (The Well's ``train``/``valid``/``test`` folders:
    `rows_of` maps each folder name to its global trajectory indices), or None unless all three
    hold trajectories (a lone ``train`` folder is split as one file is)."""
    rows = {ours: np.asarray(sorted(rows_of.get(theirs, ())), dtype=np.int64) for ours, theirs in WELL_SPLITS.items()}
    if any(r.size == 0 for r in rows.values()):
        return None
    return Split(**rows)
