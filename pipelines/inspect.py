"""See what will be trained: ``python -m pipelines.inspect PATH [--layout L] [--options YAML]``.

Prints each task's description that PATH (a file, a folder or a glob) resolves to: fields and
their channels, dimension and grid, time steps, parameters, trajectories per split, size on disk
and per-channel statistics (streamed one trajectory at a time). A file that cannot be used prints
``error: <file>: <why>`` on one line and exits 2; nothing is ever written.

Examples::

    python -m pipelines.inspect data/2D_diff-react_NA_NA.h5
    python -m pipelines.inspect data/shear_flow --layout the_well --trajectories 8
    python -m pipelines.inspect sim.h5 --layout hdf5 --options '{fields: [{key: u, axes: n t x y}]}'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from pipelines.layouts import DataError, DatasetDescription, describe, layout_names
from pipelines.layouts.statistics import ChannelStats, channel_statistics
from pipelines.shown import cut, shown, shown_path
from pipelines.user_yaml import load_yaml, yaml_problem

__all__ = ["main", "format_description"]


def _span(values) -> str:
    return f"{float(values[0]):.4g} .. {float(values[-1]):.4g}" if len(values) else "empty"


def format_description(desc: DatasetDescription, stats: tuple[ChannelStats, ...] | None) -> str:
    """The lines `main` prints for one task."""
    splits = {s.split for s in desc.sources}
    per_split = ", ".join(f"{k}: {len(desc.split_rows(k))}" for k in ("train", "valid", "test") if k in splits)
    grid = " x ".join(str(n) for n in desc.grid.shape)
    axes = "; ".join(f"{a} {_span(c)}{'' if p is None else ' periodic' if p else ' bounded'}"
                     for a, c, p in zip(desc.grid.axes, desc.grid.coords, desc.grid.periodic, strict=True))
    lines = [
        f"task {desc.identity}  (layout {desc.layout}, {len(desc.sources)} file(s), "
        f"{desc.size_bytes / 2**20:.1f} MiB)",
        f"  grid        {desc.dims}D, {grid}  ({axes})",
        f"  time        {'steady' if desc.steady else f'{desc.steps} steps, t {_span(desc.times)}'}",
        f"  trajectories {desc.trajectories}" + (f"  ({per_split})" if per_split else ""),
        f"  parameters  {', '.join(f'{k}={v:g}' for k, v in desc.parameters.items()) or 'none'}"
        + (f"; per trajectory: {', '.join(desc.per_trajectory)}" if desc.per_trajectory else ""),
        "  fields      " + "; ".join(f"{f.name} ({f.kind}: {', '.join(f.components)})" for f in desc.fields),
    ]
    if desc.constants:
        lines.append("  inputs      " + "; ".join(f"{f.name} ({f.kind}: {', '.join(f.components)})"
                                                  for f in desc.constants))
    if stats:
        lines.append(f"  {'channel':<16}{'mean':>12}{'std':>12}{'min':>12}{'max':>12}{'NaN/Inf':>9}")
        lines += [f"  {s.name:<16}{s.mean:>12.4g}{s.std:>12.4g}{s.min:>12.4g}{s.max:>12.4g}{s.nonfinite:>9d}"
                  for s in stats]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.inspect", description=__doc__.split("\n")[0])
    p.add_argument("path", help="an HDF5 file, a folder or a glob")
    p.add_argument("--layout", choices=layout_names(), default="auto")
    p.add_argument("--options", default=None,
                   help="layout options as YAML/JSON text or a YAML file (layout hdf5: fields, axes)")
    p.add_argument("--trajectories", type=int, default=0,
                   help="statistics over the first K trajectories only (default 0: all)")
    p.add_argument("--no-stats", action="store_true", help="describe from metadata only")
    return p


def _names_file(text: str) -> bool:
    """Whether `text` names a file (else it is the options' YAML itself)."""
    try:
        return Path(text).is_file()
    except OSError:  # a name the system cannot look up (longer than NAME_MAX or PATH_MAX): no file's
        return False


def _options(text: str | None) -> dict:
    """The layout options `--options` gives: YAML (or JSON) text, or the file it names, read by the
    config's strict, capped loader (`pipelines.user_yaml`); a `DataError` of one line otherwise."""
    if text is None:
        return {}
    source = text
    if _names_file(text):
        try:
            source = Path(text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"--options: cannot read {shown_path(text)} as YAML text ({cut(str(err))})") from None
    try:
        loaded = load_yaml(source)
    except yaml.YAMLError as err:
        raise DataError(f"--options: not valid YAML: {yaml_problem(err)}") from None
    if not isinstance(loaded, dict):
        raise DataError(f"--options: expected a mapping such as '{{fields: [...]}}', got {type(loaded).__name__} "
                        f"{shown(loaded)}")
    return loaded


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        for desc in describe(args.path, args.layout, options=_options(args.options)):
            stats = None
            if not args.no_stats:
                k = args.trajectories or desc.trajectories
                stats = channel_statistics(desc, range(min(k, desc.trajectories)))
            print(format_description(desc, stats), flush=True)
            for s in stats or ():
                if s.nonfinite:
                    raise DataError(f"{desc.sources[0].path}: channel {s.name!r} holds {s.nonfinite} NaN/Inf "
                                    f"values; a surrogate cannot train on them: regenerate or clean the file")
    except DataError as err:
        print(f"error: {str(err).splitlines()[0][:500]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
