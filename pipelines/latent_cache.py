# long file: one on-disk format: writer, reader and checks share its layout and manifest
"""Latent cache: a memory-mapped TensorDict on disk, written once and atomically.

Layout of a finished cache folder ``<out>/``::

    meta.json          tensordict's own metadata (shapes, dtypes; no timestamps)
    <key>.memmap       raw bytes of each array, batch dimension first
    manifest.json      written LAST: the caller's fields (config_hash, encoder_hash,
                       data_fingerprints, ...), plus "shapes", "dtypes", "files"
                       (bytes, sha256 and sampled sha256 of every other file),
                       "format_version" and "complete": true. orjson with sorted keys, no
                       creation time, so building twice from the same inputs gives
                       identical bytes.

Writing goes to ``<out>.tmp-<tag>`` next to the target (same file system, so renames are
atomic), and only a folder whose manifest says ``complete`` is renamed into place. A
crash at any earlier point leaves no ``<out>`` (or the previous one, intact); a crash
between the two renames of a replacement leaves no ``<out>`` at all, which ``load_cache``
refuses like any missing cache. Leftover ``*.tmp-*`` / ``*.old-*`` folders of a killed
writer are removed by ``remove_leftovers``, which only a caller that knows no other writer
is alive may call (entry.cache holds a lock on the cache while it builds).

Every load checks sizes and a sampled hash (64 blocks of 4 KiB spread over each file, so a
file overwritten with other content of the same size is refused at once); ``verify="sha256"``
re-hashes every byte (``entry.cache --verify``, ``pipelines.validate --deep``).

Distributed build (the entry layer owns ranks and barriers)::

    tmp = temp_dir_for(out, tag=run_id)                 # same name on every rank
    rank 0: td = allocate_cache(tmp, specs)
    barrier
    rank k: td = open_allocated(tmp) (rank 0 keeps its td); write_rows(td, start_k, chunk)...
    barrier
    rank 0: finalize_cache(tmp, out, manifest)

Only CPU tensors can be stored: a tensor on any other device (cuda, meta, ...) is refused
when it is handed in, before anything is written.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import torch
from tensordict import TensorDict, TensorDictBase

from pipelines.atomic import atomic_write_bytes, publish
from pipelines.cache_error import CacheError
from pipelines.file_facts import file_sha256

__all__ = [
    "CacheError", "MANIFEST_NAME", "FORMAT_VERSION", "temp_dir_for",
    "allocate_cache", "reserve_space", "open_allocated", "write_rows", "finalize_cache", "write_cache",
    "load_cache", "check_cache", "remove_leftovers", "sampled_sha256", "manifest_difference",
]

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 2
"""2: every file's manifest entry also has "sampled_sha256" (version 1 caches are rebuilt)."""
_RESERVED = ("complete", "format_version", "shapes", "dtypes", "files")
SAMPLE_BLOCKS, SAMPLE_BYTES = 64, 4096

Specs = Mapping[str, tuple[Sequence[int], torch.dtype]]
Chunk = Mapping[str, torch.Tensor] | TensorDictBase


def sampled_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's size and of `SAMPLE_BLOCKS` blocks of `SAMPLE_BYTES` spread evenly over
    it, first and last included (the whole file when it is smaller): 256 KiB read at most, so it is
    cheap enough for every load, and it changes when a file is replaced by other content."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(p, "rb") as f:
        if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
            h.update(f.read())
        else:
            for i in range(SAMPLE_BLOCKS):
                f.seek(i * (size - SAMPLE_BYTES) // (SAMPLE_BLOCKS - 1))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def temp_dir_for(out_dir: str | os.PathLike, tag: str | int | None = None) -> Path:
    """``<out>.tmp-<tag>`` next to ``out_dir`` (tag defaults to this process's pid)."""
    out = Path(out_dir)
    return out.with_name(f"{out.name}.tmp-{os.getpid() if tag is None else tag}")


def _check_cpu(key: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"latent cache key {key!r}: expected a torch.Tensor, got {type(value).__name__}")
    if value.device.type != "cpu":
        raise ValueError(f"latent cache stores CPU tensors only: {key!r} is on "
                         f"{value.device}; call .cpu() before handing it to the cache")


def _check_specs(specs: Specs) -> int:
    if not specs:
        raise ValueError("specs must name at least one array")
    leading = {key: int(shape[0]) if len(shape) else None for key, (shape, _) in specs.items()}
    if None in leading.values() or len(set(leading.values())) != 1:
        raise ValueError(f"every array needs the same leading (trajectory) dimension, got {leading}")
    for key, (_, dtype) in specs.items():
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"specs[{key!r}] dtype must be a torch.dtype, got {dtype!r}")
    return next(iter(leading.values()))


def allocate_cache(tmp_dir: str | os.PathLike, specs: Specs) -> TensorDict:
    """Creates zero-filled memory-mapped arrays ``{key: [N, ...]}`` in a new ``tmp_dir``.

    Args:
        tmp_dir: folder to create (must not exist); use :func:`temp_dir_for`.
        specs: ``{key: (shape, dtype)}``, all shapes with the same leading N.

    Returns:
        A writable TensorDict with batch size [N] backed by ``tmp_dir``.
    """
    n = _check_specs(specs)
    tmp = Path(tmp_dir)
    tmp.mkdir(parents=True, exist_ok=False)
    # expanded scalars: no memory is allocated; memmap_like creates sparse zero files
    template = TensorDict({k: torch.zeros((), dtype=dt).expand(*shape) for k, (shape, dt) in specs.items()},
                          batch_size=[n])
    return template.memmap_like(prefix=str(tmp), existsok=False)


def reserve_space(tmp_dir: str | os.PathLike) -> int:
    """Give every array file of an allocated cache its disk blocks now; returns the bytes reserved.

    `allocate_cache` makes sparse files, and writing through a memory map into a file system
    that is full kills the process with SIGBUS, with no message. Reserving first turns a full
    disk into a `CacheError` naming the folder, the size needed and the space free.
    """
    tmp = Path(tmp_dir)
    files = [p for p in sorted(tmp.iterdir()) if p.is_file() and p.suffix == ".memmap"]
    need = sum(p.stat().st_size for p in files)
    for p in files:
        fd = os.open(p, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size:
                os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            free = shutil.disk_usage(tmp).free
            raise CacheError(f"no space for the latent cache in {tmp.parent}: it needs {need / 2**30:.2f} GiB, "
                             f"{free / 2**30:.2f} GiB are free ({os.strerror(e.errno)}); free space there or "
                             f"set training.cache_dir to a larger file system") from None
        finally:
            os.close(fd)
    return need


def open_allocated(tmp_dir: str | os.PathLike) -> TensorDict:
    """Opens an allocated (unfinished) cache for writing, for ranks other than the allocator."""
    return TensorDict.load_memmap(str(tmp_dir), mode="r+")


def write_rows(td: TensorDictBase, start: int, chunk: Chunk) -> int:
    """Copies ``chunk`` (CPU tensors ``{key: [n, ...]}``) into rows ``[start, start + n)``.

    Returns:
        ``start + n``, the next free row.
    """
    items = dict(chunk.items())
    for key, value in items.items():  # refuse before writing anything
        _check_cpu(key, value)
    if set(items) != set(td.keys()):
        raise ValueError(f"chunk keys {sorted(items)} differ from cache keys {sorted(td.keys())}")
    sizes = {k: v.shape[0] if v.ndim else None for k, v in items.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise ValueError(f"chunk arrays need one common leading dimension, got {sizes}")
    n = next(iter(sizes.values()))
    if start < 0 or start + n > td.batch_size[0]:
        raise ValueError(f"rows [{start}, {start + n}) fall outside the cache's {td.batch_size[0]} rows")
    for key, value in items.items():
        dest = td[key]
        if value.shape[1:] != dest.shape[1:] or value.dtype != dest.dtype:
            raise ValueError(f"chunk {key!r} is {value.dtype}{list(value.shape[1:])} per row, "
                             f"cache expects {dest.dtype}{list(dest.shape[1:])}")
        dest[start : start + n].copy_(value)
    return start + n


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize_cache(tmp_dir: str | os.PathLike, out_dir: str | os.PathLike,
                   manifest: Mapping[str, Any]) -> Path:
    """Seals ``tmp_dir`` with a complete manifest, then renames it to ``out_dir``.

    An existing ``out_dir`` is renamed away first (``<out>.old-<pid>``), the new folder is
    renamed in, and the old one is deleted.

    Args:
        tmp_dir: an allocated and fully written cache folder.
        out_dir: final location.
        manifest: JSON-serialisable fields describing what was encoded (config_hash,
            encoder_hash, data_fingerprints, ...); must not use the reserved keys
            ``complete``, ``format_version``, ``shapes``, ``dtypes``, ``files``.
    """
    tmp, out = Path(tmp_dir), Path(out_dir)
    clash = [k for k in manifest if k in _RESERVED]
    if clash:
        raise ValueError(f"manifest keys {clash} are reserved and written by finalize_cache")
    td = TensorDict.load_memmap(str(tmp), mode="r")
    files = {}
    for p in sorted(tmp.iterdir()):
        if p.name == MANIFEST_NAME or not p.is_file():
            continue
        _fsync(p)  # flushes pages dirtied through the memory map as well
        files[p.name] = {"bytes": p.stat().st_size, "sha256": file_sha256(p), "sampled_sha256": sampled_sha256(p)}
    full = dict(manifest)
    full.update(
        format_version=FORMAT_VERSION,
        shapes={k: list(v.shape) for k, v in td.items()},
        dtypes={k: str(v.dtype) for k, v in td.items()},
        files=files,
        complete=True,
    )
    del td
    data = orjson.dumps(full, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)
    atomic_write_bytes(tmp / MANIFEST_NAME, data)
    old = None
    if out.exists():
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.replace(out, old)  # moved aside, not published: removed once the new folder is in place
    publish(tmp, out)
    if old is not None:
        shutil.rmtree(old)
    return out


def write_cache(out_dir: str | os.PathLike,
                chunks: Iterable[Chunk] | Callable[[], Iterable[Chunk]],
                manifest: Mapping[str, Any], *, specs: Specs) -> Path:
    """Single-process build: allocate, write ``chunks`` in order, finalize.

    Args:
        out_dir: final cache folder (replaced atomically if it exists).
        chunks: iterable (or zero-argument callable returning one) of per-task chunks
            ``{key: CPU tensor [n_i, ...]}``, written at consecutive rows; their n_i must
            add up to the N of ``specs``.
        manifest: see :func:`finalize_cache`.
        specs: ``{key: (shape, dtype)}`` of the whole cache.

    On any exception the temporary folder is removed and nothing is renamed into place.
    """
    tmp = temp_dir_for(out_dir)
    if tmp.exists():  # left by an earlier process that had our pid
        shutil.rmtree(tmp)
    try:
        td = allocate_cache(tmp, specs)
        rows = 0
        for chunk in chunks() if callable(chunks) else chunks:
            rows = write_rows(td, rows, chunk)
        if rows != td.batch_size[0]:
            raise ValueError(f"chunks filled {rows} of the {td.batch_size[0]} rows in specs")
        del td
        return finalize_cache(tmp, out_dir, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _first_difference(have: Any, want: Any, path: str) -> str | None:
    if isinstance(want, Mapping) and isinstance(have, Mapping):
        for k in sorted(set(want) | set(have), key=str):
            if k not in have:
                return f"{path}.{k} (missing in the cache, expected {want[k]!r})"
            if k not in want:
                return f"{path}.{k} (in the cache as {have[k]!r}, not expected)"
            diff = _first_difference(have[k], want[k], f"{path}.{k}")
            if diff:
                return diff
        return None
    if have != want:
        return f"{path} (cache has {have!r}, expected {want!r})"
    return None


def manifest_difference(manifest: Mapping[str, Any], expected: Mapping[str, Any]) -> str | None:
    """The first field of `expected` (in key order, nested fields dotted) that `manifest` records
    otherwise, with both values; None when it records every one of them alike."""
    for key in sorted(expected):
        diff = _first_difference(manifest.get(key, "<absent>"), expected[key], key)
        if diff:
            return diff
    return None


def _checked_manifest(root: Path, expected_manifest: Mapping[str, Any], refuse) -> tuple[dict, dict]:
    """The manifest's ``files`` and ``shapes`` tables after it proved complete, of this format and
    equal to ``expected_manifest`` where that has a field; else ``refuse(reason)`` is raised."""
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise refuse("has no manifest (missing or not finished)")
    try:
        manifest = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise refuse(f"has an unreadable manifest ({e})") from None
    if manifest.get("complete") is not True:
        raise refuse("is incomplete (manifest lacks \"complete\": true)")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise refuse(f"has format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    diff = manifest_difference(manifest, expected_manifest)
    if diff:
        raise refuse(f"does not match: manifest field {diff}")
    files, shapes = manifest.get("files"), manifest.get("shapes")
    if not isinstance(files, dict) or not isinstance(shapes, dict) or not files:
        raise refuse("has a malformed manifest (no \"files\" / \"shapes\" tables)")
    return files, shapes


def _check_files(root: Path, files: dict, verify: str, refuse) -> None:
    """Every file of the manifest present, of its size, and (verify) of its sampled or full sha256."""
    for name, info in sorted(files.items()):
        f = root / name
        if not f.is_file():
            raise refuse(f"is missing file {name}")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise refuse(f"is truncated or corrupt: {name} has {size} bytes, manifest says {info['bytes']}")
        if verify == "sampled" and sampled_sha256(f) != info.get("sampled_sha256"):
            raise refuse(f"is corrupt: {name} has the manifest's size but other content (sampled sha256 differs)")
        if verify == "sha256" and file_sha256(f) != info["sha256"]:
            raise refuse(f"is corrupt: sha256 of {name} differs from the manifest")


def load_cache(cache_dir: str | os.PathLike, expected_manifest: Mapping[str, Any],
               rebuild_hint: str, *, verify: str = "sha256") -> TensorDict:
    """Opens a finished cache read-only after checking it against ``expected_manifest``.

    Args:
        cache_dir: folder written by :func:`write_cache` / :func:`finalize_cache`.
        expected_manifest: fields that must equal the cache's (config_hash, encoder_hash,
            data_fingerprints, and optionally shapes / dtypes as ``{key: [..]}`` /
            ``{key: "torch.float32"}``); nested mappings are compared exactly.
        rebuild_hint: the command that rebuilds the cache, quoted in every refusal.
        verify: ``"sha256"`` (default: re-hash every file, catches any corruption),
            ``"sampled"`` (sizes and the sampled hash: catches truncation and a file replaced
            by other content, reads 256 KiB per file), or ``"size"`` (byte sizes only).

    Returns:
        The memory-mapped TensorDict (CPU, batch size [N]); writes to it do not reach disk.

    Raises:
        CacheError: naming the reason and ``rebuild_hint``.
    """
    if verify not in ("sha256", "sampled", "size"):
        raise ValueError(f"verify must be 'sha256', 'sampled' or 'size', got {verify!r}")
    root = Path(cache_dir)

    def refuse(reason: str) -> CacheError:
        return CacheError(f"latent cache {root} {reason}; rebuild it with: {rebuild_hint}")

    files, shapes = _checked_manifest(root, expected_manifest, refuse)
    _check_files(root, files, verify, refuse)
    try:
        td = TensorDict.load_memmap(str(root), mode="r")
    except Exception as e:  # noqa: BLE001 - any failure to map means an unusable cache
        raise refuse(f"cannot be memory-mapped ({type(e).__name__}: {e})") from e
    for key, shape in shapes.items():
        if key not in td.keys() or list(td[key].shape) != shape:
            raise refuse(f"has array {key!r} that disagrees with its manifest shape {shape}")
    return td


def check_cache(cache_dir: str | os.PathLike, *, deep: bool) -> str:
    """Check a finished cache on its own (no expected identity): manifest, sizes and sampled
    hashes, and with `deep` every file's full sha256 and every floating value finite.

    Returns one line describing the cache. Raises `CacheError` naming the problem.
    """
    td = load_cache(cache_dir, {}, "the command that built it (python -m entry.cache)",
                    verify="sha256" if deep else "sampled")
    if deep:
        for key, value in td.items():
            if value.is_floating_point():
                bad = sum(int((~torch.isfinite(value[i:i + 256])).sum()) for i in range(0, value.shape[0], 256))
                if bad:
                    raise CacheError(f"latent cache {cache_dir}: {key!r} has {bad} non-finite values; rebuild it "
                                     f"with python -m entry.cache --config CFG")
    shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in td.items())
    return f"{cache_dir}: latent cache ok ({'full sha256 and finite values' if deep else 'sampled'}): {shapes}"


def remove_leftovers(out_dir: str | os.PathLike) -> list[Path]:
    """Delete the ``<out>.tmp-*`` and ``<out>.old-*`` folders dead writers left; returns them.

    Only for a caller that knows no other writer of ``out_dir`` is alive (it holds the lock all
    writers take): a live writer's temporary folder looks the same.
    """
    out = Path(out_dir)
    found = sorted(p for pattern in (f"{out.name}.tmp-*", f"{out.name}.old-*") for p in out.parent.glob(pattern)
                   if p.is_dir()) if out.parent.is_dir() else []
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found
