"""Check PDEBench files: layout, shapes, value ranges, NaN/Inf; and latent cache folders.

``python -m pipelines.validate [--deep] PATH...`` prints one line per file; any problem
(missing file, missing or misnamed dataset, shape mismatch, NaN/Inf, truncated or corrupt
HDF5) prints ``error: <file>: <problem>`` and the command exits with status 2. It never
writes. A PATH that is a latent cache folder (``pipelines.latent_cache``) is checked
against its manifest: sizes and sampled hashes, and with ``--deep`` every byte's sha256
and every value finite. HDF5 files are always scanned in full.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines.latent_cache import MANIFEST_NAME, CacheError, check_cache
from pipelines.pdebench_io import DataError, PDEBenchFile

__all__ = ["FileReport", "FieldStats", "check_stored", "validate_file", "validated", "main"]

_SCAN_BYTES = 64 << 20  # read at most this much per chunk when scanning values


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldStats:
    """Value summary of one dataset."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    min: float
    max: float
    n_nan: int
    n_inf: int


@dataclass(frozen=True, kw_only=True, slots=True)
class FileReport:
    """What `validate_file` found in one (valid) file; ``str()`` is one readable line."""

    path: Path
    task: str
    param: float | None
    n_samples: int
    fields: tuple[FieldStats, ...]

    def __str__(self) -> str:
        param = "?" if self.param is None else str(float(self.param))
        parts = [f"{self.path}: {self.task} param={param} N={self.n_samples}"]
        for s in self.fields:
            text = f"{s.key}{list(s.shape)} {s.dtype}"
            if s.key in ("tensor", "nu"):
                text += f" [{s.min:.4g}, {s.max:.4g}] nan={s.n_nan} inf={s.n_inf}"
            parts.append(text)
        return " | ".join(parts)


def _scan(path: Path, key: str, dataset) -> FieldStats:
    """Min, max and NaN/Inf counts of `dataset`, read a block of samples at a time."""
    shape = tuple(dataset.shape)
    per_sample = max(1, int(np.prod(shape[1:], dtype=np.int64)) * dataset.dtype.itemsize) if len(shape) > 1 else 1
    step = max(1, _SCAN_BYTES // per_sample) if len(shape) > 1 else max(1, shape[0])
    lo, hi, n_nan, n_inf = np.inf, -np.inf, 0, 0
    try:
        for start in range(0, shape[0], step):
            block = np.asarray(dataset[start:start + step])
            nan = np.isnan(block)
            inf = np.isinf(block)
            n_nan += int(nan.sum())
            n_inf += int(inf.sum())
            finite = block[~(nan | inf)]
            if finite.size:
                lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
    except OSError as err:
        raise DataError(f"{path}: cannot read {key!r} (truncated or corrupt file?): {err}") from None
    return FieldStats(key=key, shape=shape, dtype=str(dataset.dtype), min=lo, max=hi, n_nan=n_nan, n_inf=n_inf)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def check_stored(path: Path, key: str, dataset) -> None:
    """Refuse a dataset that declares more data than the file stores (an unfiltered dataset whose
    chunks were never written, or were cut off): reading it would scan the declared size, up to
    hundreds of GB of fill values, and train on zeros. Compressed, external and virtual datasets
    store less than they declare by design and are not checked here."""
    if dataset.external or dataset.is_virtual or dataset.id.get_create_plist().get_nfilters():
        return
    declared = int(np.prod(dataset.shape, dtype=np.float64)) * dataset.dtype.itemsize
    stored = dataset.id.get_storage_size()
    if stored < declared:
        raise DataError(f"{path}: dataset {key!r} declares {list(dataset.shape)} {dataset.dtype} = {_gib(declared)}, "
                        f"but the file stores {_gib(stored)} of it (samples never written, or a cut file); "
                        f"regenerate it or name another file")


def validate_file(path, *, task: str | None = None) -> FileReport:
    """Check that `path` is a readable PDEBench file with finite values.

    Raises:
        DataError: naming the file and the problem (layout errors come from `PDEBenchFile`).
    """
    path = Path(path)
    with PDEBenchFile(path, task=task) as handle:
        lay = handle.layout
        for key in lay.task.keys:  # before the scan, which would read every declared byte
            check_stored(path, key, handle.dataset(key))
        fields = tuple(_scan(path, key, handle.dataset(key)) for key in lay.task.keys)
        for stats in fields:
            if stats.n_nan or stats.n_inf:
                raise DataError(f"{path}: dataset {stats.key!r} has {stats.n_nan} NaN and {stats.n_inf} Inf values")
        for stats in fields:
            if stats.key.endswith("-coordinate") and stats.shape[0] > 1:
                coord = np.asarray(handle.dataset(stats.key)[:], dtype=np.float64)
                if not np.all(np.diff(coord) > 0):
                    raise DataError(f"{path}: {stats.key!r} is not strictly increasing")
    return FileReport(path=path, task=lay.task.name, param=lay.param, n_samples=lay.n_samples, fields=fields)


VALIDATION_FACT = "validation/1"
"""Key of a cached validation; bump the number when `validate_file` starts checking more."""


def validated(path, *, task: str | None = None, refresh: bool = False) -> str:
    """`validate_file`'s report line, computed once per version of the file and cached beside it
    (`pipelines.file_facts`; a changed file is validated again); `refresh` validates anyway.

    Raises:
        DataError: as `validate_file` (a failed validation is never cached).
    """
    from pipelines.file_facts import cached_fact

    return cached_fact(path, f"{VALIDATION_FACT}/{task or ''}", lambda: str(validate_file(path, task=task)),
                       refresh=refresh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.validate", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", metavar="PATH", help="PDEBench HDF5 files")
    parser.add_argument("--task", default=None, help="task name, for files whose name is not PDEBench's")
    parser.add_argument("--deep", action="store_true",
                        help="latent cache folders: re-hash every byte and check every value is finite")
    args = parser.parse_args(argv)
    failed = 0
    for path in args.paths:
        try:
            if (Path(path) / MANIFEST_NAME).is_file():
                print(check_cache(path, deep=args.deep), flush=True)
            else:
                print(validate_file(path, task=args.task), flush=True)
        except (DataError, CacheError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            failed += 1
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
