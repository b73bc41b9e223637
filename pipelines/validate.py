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

from pipelines.layouts import DataError
from pipelines.task_data import task_description, task_name
from pipelines.tasks import TaskSpec, get_task, parse_file_name

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


def _param(path: Path, spec: TaskSpec | None, desc) -> float | None:
    """A generated task's PDE parameter: from PDEBench's file name, else the file's attribute."""
    parsed = parse_file_name(path.name)
    if parsed is not None and (spec is None or parsed[0] is spec):
        return parsed[1]
    if spec is None or spec.storage == "declared":
        return None
    return desc.parameters.get(spec.pdebench_attr)


def _check_pdebench_shapes(path: Path, spec: TaskSpec) -> None:
    """PDEBench's keys and shapes for a scalar task's or Darcy's file, as strictly as PDEBench's own
    loader needs them (``t-coordinate`` [T + 1]): the reader is lenient where this check is not. Reads
    shapes only."""
    from pipelines.layouts.h5 import float_dataset, open_h5

    with open_h5(path) as f:
        shapes = {key: tuple(float_dataset(f, key, path).shape) for key in spec.keys}
    tensor = shapes["tensor"]
    if spec.spatial_dims == 1 and len(tensor) != 3 or spec.spatial_dims == 2 and (len(tensor) != 4 or tensor[1] != 1):
        raise DataError(f"{path}: 'tensor' must be {'[N, T, X]' if spec.spatial_dims == 1 else '[N, 1, X, Y]'}, "
                        f"got shape {tensor}")
    want = ({"x-coordinate": tensor[2:3], "t-coordinate": (tensor[1] + 1,)} if spec.spatial_dims == 1 else
            {"nu": (tensor[0], *tensor[2:]), "x-coordinate": tensor[2:3], "y-coordinate": tensor[3:4]})
    for key, shape in want.items():
        if shapes[key] != shape:
            raise DataError(f"{path}: {key!r} has shape {shapes[key]}, expected {shape} to match 'tensor' {tensor}")


def validate_file(path, *, task: str | TaskSpec | None = None) -> FileReport:
    """Check that `path` is a readable data file of `task` (a generated task's name, a `TaskSpec`
    such as a declared file's, or None: any layout that recognises it) with finite values.

    Raises:
        DataError: naming the file and the problem (layout errors come from `pipelines.layouts`).
    """
    import h5py

    path = Path(path)
    spec = get_task(task) if isinstance(task, str) else task
    named = spec or (parse_file_name(path.name) or (None,))[0]  # a PDEBench name says the task
    if named is not None and named.storage == "tensor" and path.is_file():
        _check_pdebench_shapes(path, named)
    desc = task_description(path, spec)
    report = dict(path=path, task=task_name(path, spec, desc), param=_param(path, spec, desc),
                  n_samples=desc.trajectories)
    if spec is not None and spec.storage == "declared":
        validate_dataset(path, layout=spec.source_layout, options=json.loads(spec.source_options or "{}"))
        return FileReport(**report, fields=())
    if desc.layout != "pdebench" or desc.reader_state["variant"] not in ("scalar", "darcy"):
        validate_dataset(path, layout=desc.layout)  # a 2D flow: its layout's checks, one channel at a time
        return FileReport(**report, fields=())
    # PDEBench's scalar and Darcy files: every dataset of the file scanned whole, as stored.
    try:
        with h5py.File(path, "r") as f:
            keys = [k for k in ("tensor", "nu", "x-coordinate", "y-coordinate", "t-coordinate") if k in f]
            fields = tuple(_scan(path, key, f[key]) for key in keys)
            for stats in fields:
                if stats.n_nan or stats.n_inf:
                    raise DataError(f"{path}: dataset {stats.key!r} has {stats.n_nan} NaN and {stats.n_inf} "
                                    f"Inf values")
            for stats in fields:
                if stats.key.endswith("-coordinate") and stats.shape[0] > 1:
                    if not np.all(np.diff(np.asarray(f[stats.key][:], dtype=np.float64)) > 0):
                        raise DataError(f"{path}: {stats.key!r} is not strictly increasing")
    except OSError as err:
        raise DataError(f"{path}: cannot read data (truncated or corrupt file?): {err}") from None
    return FileReport(**report, fields=fields)


VALIDATION_FACT = "validation/2"
"""Key of a cached validation; bump the number when `validate_file` starts checking more."""


def validated(path, *, task: str | TaskSpec | None = None, refresh: bool = False) -> str:
    """`validate_file`'s report line, computed once per version of the file and cached beside it
    (`pipelines.file_facts`; a changed file is validated again); `refresh` validates anyway.

    Raises:
        DataError: as `validate_file` (a failed validation is never cached).
    """
    from pipelines.file_facts import cached_fact

    if isinstance(task, TaskSpec) and task.storage == "declared":  # how it is read is part of what was checked
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
