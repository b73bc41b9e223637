"""How much memory this process may still take, and how much of it one read of data may use.

Every reader that chooses between loading data whole and reading it in slices asks `read_budget`,
so a file larger than the memory a process has (a small machine, a container's limit, an address-
space cap) is streamed instead of loaded. What bounds a process here, whichever is tightest:

* the machine: ``MemAvailable`` of ``/proc/meminfo`` (Linux; ``sysconf`` elsewhere);
* a container: its memory cgroup's limit less its usage (v2 ``memory.max``, v1 ``memory.limit_in_bytes``);
* an address-space cap (``ulimit -v``, RLIMIT_AS) less the process's current ``VmSize``.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

READ_BYTES = 256 << 20
"""The most one read of data (a split loaded whole, a block of trajectories encoded at once) takes
on a machine with memory to spare: 256 MiB keeps eight ranks of one node under 2 GiB each."""

SAMPLE_LIMIT_ENV = "US_MAX_SAMPLE_BYTES"
"""Environment variable that sets the largest sample a file may declare, in bytes (default: half
the memory available when the file is opened)."""

READ_SHARE = 8
"""A read takes at most this fraction (1/8) of the memory still available: the model, the
optimizer, the read's copies (float32 conversion, a batch) and other ranks need the rest."""


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _cgroup_available() -> int | None:
    """Headroom of the process's memory cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            names, root = ("memory.max", "memory.current"), Path("/sys/fs/cgroup")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            names, root = ("memory.limit_in_bytes", "memory.usage_in_bytes"), Path("/sys/fs/cgroup/memory")
        else:
            continue
        # Inside a container the cgroup's own folder is often mounted as the root.
        for folder in (root / path.lstrip("/"), root):
            try:
                limit, used = ((folder / n).read_text().strip() for n in names)
            except OSError:
                continue
            if limit == "max" or int(limit) >= 1 << 60:  # no limit
                return None
            return max(int(limit) - int(used), 0)
    return None


def _address_space_available() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(soft - int(line.split()[1]) * 1024, 0)
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory() -> int | None:
    """Bytes this process may still allocate: the tightest of the machine's available memory, its
    cgroup's headroom and its address-space headroom; None when none of them is known."""
    known = [v for v in (_meminfo_available(), _cgroup_available(), _address_space_available()) if v is not None]
    return min(known) if known else None


def read_budget() -> int:
    """Bytes one read of data may take: `READ_BYTES`, or 1/`READ_SHARE` of the available memory
    when that is smaller."""
    available = available_memory()
    return READ_BYTES if available is None else min(READ_BYTES, available // READ_SHARE)


def sample_limit() -> tuple[int | None, str]:
    """(the largest sample, one trajectory, a data file may declare, in bytes, or None for no bound;
    what sets it): `SAMPLE_LIMIT_ENV`, else half the memory available. Every reader takes at least
    one whole sample at a time, so a larger one ends in a MemoryError or minutes of paging."""
    if os.environ.get(SAMPLE_LIMIT_ENV):
        return int(os.environ[SAMPLE_LIMIT_ENV]), f"{SAMPLE_LIMIT_ENV}={os.environ[SAMPLE_LIMIT_ENV]}"
    available = available_memory()
    if available is None:
        return None, "no bound"
    return available // 2, f"half the {available / 2**30:.1f} GiB of memory available; {SAMPLE_LIMIT_ENV} sets another"
