"""Run ``python -m entry.pipeline`` in this process and write its peak memory as JSON.

``python -m tests.peak_memory OUT.json --config ...``: the pipeline's own arguments follow the output
path; on exit (success or not) OUT.json holds ``{"VmPeak": bytes, "VmHWM": bytes}`` from
``/proc/self/status`` (Linux): the peak address space and the peak resident memory.
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
    try:
        runpy.run_module("entry.pipeline", run_name="__main__", alter_sys=True)
    finally:
        with open(out, "w") as f:
            json.dump(peak_memory(), f)
