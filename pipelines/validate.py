"""Check data files: layout, shapes, value ranges, NaN/Inf; and latent cache folders.

``python -m pipelines.validate [--deep] [--layout L] PATH...`` prints one line per file (the three
scalar tasks' files) or per task (any other layout of `pipelines.layouts`: PDEBench's 2D/3D files,
The Well's folders, a user's HDF5 with ``--layout hdf5`` is not supported here: it needs the
config's field keys, use ``pipelines.inspect --options``); any problem
(missing file, missing or misnamed dataset, shape mismatch, NaN/Inf, truncated or corrupt
HDF5) prints ``error: <file>: <problem>`` and the command exits with status 2. It never
writes. A PATH that is a latent cache folder (``pipelines.latent_cache``) is checked
against its manifest: sizes and sampled hashes, and with ``--deep`` every byte's sha256
and every value finite. HDF5 files are always scanned in full.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines.pdebench_io import DataError, PDEBenchFile
from pipelines.tasks import TaskSpec

__all__ = ["FileReport", "FieldStats", "validate_file", "validate_dataset", "validated", "main"]

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
        # A declared dataset's parameters are part of its task name; a generated task has one.
        param = "" if self.param is None else f" param={float(self.param)}"
        parts = [f"{self.path}: {self.task}{param} N={self.n_samples}"]
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


def validate_file(path, *, task: str | TaskSpec | None = None) -> FileReport:
    """Check that `path` is a readable data file of `task` (a generated task's name, a `TaskSpec`
    such as a declared file's, or None: inferred) with finite values.

    Raises:
        DataError: naming the file and the problem (layout errors come from `PDEBenchFile`).
    """
    path = Path(path)
    with PDEBenchFile(path, task=task) as handle:
        lay = handle.layout
        if lay.task.layout == "declared":
            validate_dataset(path, layout=lay.task.source_layout, options=json.loads(lay.task.source_options or "{}"))
        elif lay.task.layout != "tensor":  # a 2D flow: its layout's checks, one channel at a time
            validate_dataset(path, layout="pdebench")
        if lay.task.layout != "tensor":
            return FileReport(path=path, task=lay.task.name, param=lay.param, n_samples=lay.n_samples, fields=())
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


VALIDATION_FACT = "validation/2"
"""Key of a cached validation; bump the number when `validate_file` starts checking more."""


def validated(path, *, task: str | TaskSpec | None = None, refresh: bool = False) -> str:
    """`validate_file`'s report line, computed once per version of the file and cached beside it
    (`pipelines.file_facts`; a changed file is validated again); `refresh` validates anyway.

    Raises:
        DataError: as `validate_file` (a failed validation is never cached).
    """
    from pipelines.file_facts import cached_fact

    if isinstance(task, TaskSpec) and task.layout == "declared":  # how it is read is part of what was checked
        what = f"{task.name}/{task.source_layout}/{hashlib.sha256(task.source_options.encode()).hexdigest()[:12]}"
    else:
        what = (task.name if isinstance(task, TaskSpec) else task) or ""
    return cached_fact(path, f"{VALIDATION_FACT}/{what}", lambda: str(validate_file(path, task=task)),
                       refresh=refresh)


def _is_legacy_task_file(path: Path) -> bool:
    """A file of the three scalar tasks (PDEBench's ``tensor`` layouts) or of no known layout: checked by
    `validate_file`."""
    import h5py

    from pipelines.layouts import the_well
    from pipelines.layouts.pdebench import variant

    if not path.is_file():
        return False
    try:
        with h5py.File(path, "r") as f:
            # A file of no layout we know is reported against PDEBench's keys, by `validate_file`.
            return variant(f) in ("scalar", "darcy") or (variant(f) is None and not the_well.recognises(f))
    except OSError:
        return True  # `validate_file` names the file and why it cannot be opened


def validate_dataset(path, *, layout: str = "auto", options: dict | None = None) -> str:
    """Check every task that `path` (a file, a folder or a glob, any layout of `pipelines.layouts`)
    holds: its description reads, every declared dataset is stored, every value is finite. Returns
    one line per task.

    Raises:
        DataError: naming the file and the key.
    """
    from pipelines.layouts import describe
    from pipelines.layouts.statistics import channel_statistics

    lines = []
    for desc in describe(path, layout, options=options):  # every dataset's size checked (layouts.sizes)
        stats = channel_statistics(desc)
        for s in stats:
            if s.nonfinite:
                raise DataError(f"{desc.sources[0].path}: channel {s.name!r} has {s.nonfinite} NaN/Inf values")
        ranges = " ".join(f"{s.name}[{s.min:.4g}, {s.max:.4g}]" for s in stats)
        lines.append(f"{path}: {desc.identity} ({desc.layout}) N={desc.trajectories} T={desc.steps} "
                     f"grid={'x'.join(map(str, desc.grid.shape))} | {ranges}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.validate", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", metavar="PATH", help="PDEBench HDF5 files")
    parser.add_argument("--task", default=None, help="task name, for files whose name is not PDEBench's")
    parser.add_argument("--layout", default="auto", help="layout of files other than the three scalar tasks")
    parser.add_argument("--deep", action="store_true",
                        help="latent cache folders: re-hash every byte and check every value is finite")
    args = parser.parse_args(argv)
    failed = 0
    for path in args.paths:
        try:
            print(_report(path, args), flush=True)
        except (DataError, ValueError, *_cache_errors()) as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            failed += 1
    return 2 if failed else 0


def _report(path: str, args: argparse.Namespace) -> str:
    """What `main` prints for one PATH: a latent cache folder's check, a scalar task's file's, or a
    dataset's. The cache's module imports torch (seconds), so only a folder pays for it: a data
    file's answer, a refusal from its metadata included, stays as fast as h5py."""
    if Path(path).is_dir():
        from pipelines.latent_cache import MANIFEST_NAME, check_cache

        if (Path(path) / MANIFEST_NAME).is_file():
            return check_cache(path, deep=args.deep)
    if args.task is not None or _is_legacy_task_file(Path(path)):
        return str(validate_file(path, task=args.task))
    return validate_dataset(path, layout=args.layout)


def _cache_errors() -> tuple[type[Exception], ...]:
    """`CacheError` once a cache folder was checked (its module loaded), else nothing more to catch."""
    module = sys.modules.get("pipelines.latent_cache")
    return (module.CacheError,) if module is not None else ()


if __name__ == "__main__":
    sys.exit(main())
