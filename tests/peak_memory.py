"""Run ``python -m entry.pipeline`` in this process and write its peak memory as JSON.

``python -m tests.peak_memory OUT.json [--read-bytes N] --config ...``: the pipeline's own arguments
follow; ``--read-bytes`` stands for a machine whose memory allows one read of data N bytes
(`pipelines.memory.READ_BYTES`), whatever this one has. On exit (success or not) OUT.json holds
``{"VmPeak": bytes, "VmHWM": bytes}`` from ``/proc/self/status`` (Linux): the peak address space and
the peak resident memory.
"""

from __future__ import annotations

import json
import runpy
import sys


def peak_memory() -> dict[str, int]:
    """{"VmPeak": ..., "VmHWM": ...} of this process, in bytes."""
    with open("/proc/self/status") as f:
        lines = [line.split(":", 1) for line in f if line.startswith(("VmPeak", "VmHWM"))]
    return {key: int(value.split()[0]) * 1024 for key, value in lines}


if __name__ == "__main__":
    out = sys.argv.pop(1)
    if sys.argv[1:2] == ["--read-bytes"]:
        import pipelines.memory

        pipelines.memory.READ_BYTES = int(sys.argv[2])
        del sys.argv[1:3]
    try:
        runpy.run_module("entry.pipeline", run_name="__main__", alter_sys=True)
    finally:
        with open(out, "w") as f:
            json.dump(peak_memory(), f)
