"""Results of a long benchmark, one JSON line per model and seed, so a re-run reuses what a crashed
or interrupted one finished (`reuse_or_run`) instead of training it again.

A line is appended in one ``O_APPEND`` write and synced; a torn last line (a crash mid-write) is
skipped with a warning, and the next record starts on a fresh line.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson

__all__ = ["finished", "record", "records", "reuse_or_run"]


def _records(path: Path) -> list[dict]:
    """The readable records of a result file; a torn line (a crash mid-write) is skipped, with a warning."""
    if not path.is_file():
        return []
    found, torn = [], []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            found.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            torn.append(number)
    if torn:
        warnings.warn(f"{path}: ignored unreadable line(s) {torn} (a run that crashed while writing)", stacklevel=3)
    return [r for r in found if isinstance(r, dict)]


def records(result_path: str | os.PathLike) -> list[dict]:
    """Every readable record ``{"model", "seed", "payload"}`` of the JSON-lines file, in file order
    ([] when it does not exist; a torn line is skipped with a warning)."""
    return _records(Path(result_path))


def finished(result_path: str | os.PathLike, model_name: str, seed: int) -> dict | None:
    """The payload recorded for ``(model_name, seed)`` in the JSON-lines file (the latest, if
    several), or None when that model and seed have not finished."""
    hits = [r for r in _records(Path(result_path)) if r.get("model") == model_name and r.get("seed") == seed]
    return hits[-1].get("payload") if hits else None


def record(result_path: str | os.PathLike, model_name: str, seed: int, payload: Mapping[str, Any]) -> None:
    """Append one finished result as one JSON line, in one write, synced to disk."""
    path = Path(result_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = orjson.dumps({"model": model_name, "seed": seed, "payload": dict(payload)}) + b"\n"
    if path.is_file() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # a torn last line: start a fresh one rather than extend it
                line = b"\n" + line
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # O_APPEND: one write lands whole at the end, even beside another writer
        os.fsync(fd)
    finally:
        os.close(fd)


def reuse_or_run(result_path: str | os.PathLike, model_name: str, seed: int, run: Callable[[], Mapping]) -> dict:
    """The recorded payload of ``(model_name, seed)`` if it finished before; else ``run()``'s, recorded."""
    found = finished(result_path, model_name, seed)
    if found is not None:
        return found
    payload = dict(run())
    record(result_path, model_name, seed, payload)
    return payload
