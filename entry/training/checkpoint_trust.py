"""Reading a checkpoint folder without running code from it.

A checkpoint folder is data, not code: whoever can write into it (a shared file system, a copied
run folder) must not be able to run code in the job that resumes from it. Its pickles are read as:
  rank<k>.pt      `torch.load(weights_only=True)` (the loop state is plain values)
  .metadata       a `pickle.Unpickler` that finds only the classes DCP's metadata is made of
                  (`DCP_METADATA_GLOBALS`), through `TrustedReader`, DCP's file-system reader
  *.distcp bytes  non-tensor values (the optimizer's hyper-parameters) with `weights_only=True`,
                  through `TrustedLoadPlanner` (DCP's default planner unpickles them unrestricted)
What the metadata may make DCP allocate is bounded too: a `.metadata` file is regular and at most
`MAX_METADATA_BYTES`, no call in it makes more bytes than the file holds (`bytes(N)`), and every read
it declares lies inside a regular file of the folder (no /dev/zero, no path out of the folder).
A pickle that names anything else is refused before that thing is called: `RefusedPickle` names
the file and what it asked for, so the caller can tell a refused file (exit 2, never fallen back
from) from a truncated one (the previous checkpoint is used).
"""

from __future__ import annotations

import io
import os
import pickle
import stat
import zipfile
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # how torch pickles a torch.layout: a lookup by name
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "int", "float", "str", "bytes", "bool"},
}
"""What a DCP `.metadata` pickle may name (plus `torch.<dtype>`): dataclasses, enums and containers
whose construction only stores its arguments (torch 2.13's metadata; see the module docstring)."""


class RefusedPickle(pickle.UnpicklingError):
    """A pickle names classes or functions a checkpoint may not contain; raised before any is called.
    `names` lists them, `file` is the file that holds the pickle (None until known)."""

    def __init__(self, names: list[str], file: Path | None = None):
        super().__init__(f"refused to unpickle {', '.join(names)}")
        self.names, self.file = names, file

    def explain(self) -> str:
        """The user's line: the file, what it names, that nothing ran and what to do."""
        return (f"checkpoint file {self.file} holds objects a checkpoint may not contain "
                f"({', '.join(self.names[:3])}); nothing it names was run. Check where that folder came "
                f"from, then move it away (or pass --resume never) to resume without it")


def _allowed_in_metadata(module: str, name: str) -> bool:
    if name in DCP_METADATA_GLOBALS.get(module, ()):
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


MAX_METADATA_BYTES = 256 << 20
"""The largest `.metadata` file read (a billion-parameter model's sharded state has a few MB)."""


class _MetadataUnpickler(pickle.Unpickler):
    """The allow-list's unpickler; a call of an allowed builtin that would allocate more than
    `limit` bytes from a size alone (`bytes(N)`, `bytearray(N)`: N zeros) is refused unmade."""

    def __init__(self, stream: IO[bytes], limit: int):
        super().__init__(stream)
        self.limit = limit

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed_in_metadata(module, name):
            raise RefusedPickle([f"{module}.{name}"])
        found = super().find_class(module, name)
        return self._bounded(found) if module == "builtins" and name in ("bytes", "bytearray") else found

    def _bounded(self, make):
        def bounded(*args, **kwargs):
            if args and isinstance(args[0], int) and not isinstance(args[0], bool) and args[0] > self.limit:
                raise RefusedPickle([f"builtins.{make.__name__}({args[0]}): more than the {self.limit} bytes "
                                     f"the file holds"])
            return make(*args, **kwargs)

        return bounded


def load_metadata(stream: IO[bytes], *, limit: int = MAX_METADATA_BYTES) -> Metadata:
    """Unpickle a DCP `.metadata` stream with the allow-list; returns the `Metadata`. Raises
    `RefusedPickle` for a name outside it or a call that would allocate more than `limit` bytes
    (the file's size), pickle's or Python's errors for a damaged stream."""
    metadata = _MetadataUnpickler(stream, limit).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def load_dcp(state: dict[str, Any], folder: str | Path) -> None:
    """`dcp.load(state)` from the checkpoint `folder` (in place, a collective under FSDP2) through
    `TrustedReader` and `TrustedLoadPlanner`. Raises `RefusedPickle` naming the refused file, or
    what DCP raises for an unreadable one."""
    reader, planner = TrustedReader(folder), TrustedLoadPlanner(folder)
    try:
        read_metadata_early(reader)
        dcp.load(state, storage_reader=reader, planner=planner)
    except BaseException:  # DCP's CheckpointException is a BaseException; it wraps (or drops) our refusal
        refused = reader.refused or planner.refused
        if refused is not None:
            raise refused from None
        raise


def read_metadata_early(reader: TrustedReader) -> Metadata | None:
    """The checkpoint's metadata read ahead of `dcp.load`, or None when it is unreadable; raises
    `RefusedPickle` now for a planted `.metadata`: inside `dcp.load` the refusal would come with two
    logged tracebacks (DCP then looks for per-rank metadata our checkpoints never hold). Other read
    errors are left to `dcp.load`, which reads the file again and fails on every rank together (a
    rank leaving early on its own would break the collectives the others are in); a refusal is the
    same on every rank, as all read the same bytes."""
    try:
        return reader.read_metadata()
    except RefusedPickle:
        raise
    except Exception:  # noqa: BLE001 - unreadable: DCP's own read reports it, collectively
        return None


def _regular_size(path: Path, cap: int | None = None) -> int:
    """The size of `path`, a regular file (a link to one counts) of at most `cap` bytes; otherwise
    `RefusedPickle` naming it: a device (/dev/zero) or a pipe would be read without end. A missing
    file raises `FileNotFoundError` (unreadable, not refused)."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise RefusedPickle([f"a read of {path.name}, which is not a regular file"], path)
    if cap is not None and st.st_size > cap:
        raise RefusedPickle([f"{st.st_size} bytes of metadata, more than the {cap} a checkpoint's hold"], path)
    return st.st_size


def check_reads(metadata: Metadata, folder: Path) -> None:
    """Check the reads the metadata declares (`storage_data`: file, offset, length) before DCP makes
    them, as it sizes its buffers by them: one that leaves the checkpoint `folder` or names a file
    that is not regular is refused (`RefusedPickle`: planted); one past a file's end is a
    `ValueError` (unreadable: a truncated file, so the previous checkpoint is used)."""
    sizes: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if name not in sizes:
            if Path(name).is_absolute() or os.path.normpath(name).split(os.sep)[0] in ("..", "."):
                raise RefusedPickle([f"a read of {name}, outside the checkpoint folder"], folder / ".metadata")
            sizes[name] = _regular_size(folder / name)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise RefusedPickle([f"a read of {name} at offset {offset!r} of length {length!r}"], folder / ".metadata")
        if offset + length > sizes[name]:
            raise ValueError(f"{folder / name} holds {sizes[name]} bytes, but its metadata reads {length} at {offset}")


class TrustedReader(FileSystemReader):
    """DCP's `FileSystemReader` whose `read_metadata` uses `load_metadata`; `refused` keeps the
    `RefusedPickle` once a refusal happened. Takes the checkpoint folder."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        self.refused: RefusedPickle | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (the global file, or with `rank=` that rank's own, as DCP asks),
        once every read it declares lies within a regular file of the folder (`check_reads`)."""
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            size = _regular_size(Path(path), MAX_METADATA_BYTES)
            with self.fs.create_stream(path, "rb") as stream:
                metadata = load_metadata(stream, limit=size)
            check_reads(metadata, Path(self.path))
        except RefusedPickle as e:
            e.file = e.file or Path(path)
            self.refused = e
            raise
        # What FileSystemReader.read_metadata does after unpickling (torch 2.13).
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TrustedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, unpickling non-tensor values with `weights_only=True`; `refused`
    keeps the `RefusedPickle` once a refusal happened. Takes the checkpoint folder."""

    def __init__(self, folder: str | Path):
        super().__init__()
        self.folder = Path(folder)
        self.refused: RefusedPickle | None = None

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """Unpickle one non-tensor value with `weights_only=True` and hand it to DCP's planner."""
        try:
            obj = load_weights_only(value)
        except RefusedPickle as e:
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            e.file, self.refused = self.folder / getattr(info, "relative_path", "?"), e
            raise
        # DefaultLoadPlanner.load_bytes unpickles with weights_only=False and places the value
        # (also in flattened state dicts): what reaches it is the vetted value, saved again here.
        vetted = io.BytesIO()
        torch.save(obj, vetted)
        vetted.seek(0)
        super().load_bytes(read_item, vetted)


def load_weights_only(file: str | Path | IO[bytes]) -> Any:
    """`torch.load(file, weights_only=True)` on the CPU. Raises `RefusedPickle` naming what the file
    holds beyond weights_only's allow-list, or torch's error for a truncated or garbage file."""
    if isinstance(file, (str, Path)):
        _regular_size(Path(file))  # a link to /dev/zero would be read without end
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception:
        names = _unsafe_globals(file)
        if names:
            raise RefusedPickle(names, Path(file) if isinstance(file, (str, Path)) else None) from None
        raise


def _unsafe_globals(file: str | Path | IO[bytes]) -> list[str]:
    """What a file that weights_only refused names beyond its allow-list, found without running it
    ([] when it is not a whole pickle: truncated or garbage)."""
    if hasattr(file, "seek"):
        file.seek(0)
    try:
        if zipfile.is_zipfile(file):
            if hasattr(file, "seek"):
                file.seek(0)
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(file))  # static disassembly
        if hasattr(file, "seek"):
            file.seek(0)
            return _named_globals(file)
        with open(file, "rb") as f:
            return _named_globals(f)
    except Exception:  # noqa: BLE001 - not a whole checkpoint: unreadable, not refused
        return []


class _Inert:
    """What `_GlobalScan` returns for every name: calling, building or filling it does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


class _GlobalScan(pickle.Unpickler):
    def __init__(self, stream: IO[bytes]):
        super().__init__(stream)
        self.names: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        self.names.append(f"{module}.{name}")
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        return None


def _named_globals(stream: IO[bytes]) -> list[str]:
    """Every class or function the whole pickles at the start of a non-zip file name (a file of
    the legacy torch format is several pickles); none of them is called."""
    names: list[str] = []
    while True:
        scan = _GlobalScan(stream)
        try:
            scan.load()
        except Exception:  # noqa: BLE001 - the end of the pickles, or garbage: what is whole counts
            return sorted(set(names))
        names += scan.names
