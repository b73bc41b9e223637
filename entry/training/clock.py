"""The training clock: wall seconds spent training a stage, validation left out, across resumed attempts."""

from __future__ import annotations

import time

import torch


class TrainClock:
    """Wall seconds spent training, continued from `start_s` (a resumed attempt's count).

    On CUDA every reading synchronises the device first: kernels still queued would otherwise be
    counted after the reading (in validation time, say) instead of in the training they belong to.
    """

    def __init__(self, device: torch.device, start_s: float):
        self.device, self.total = device, start_s
        self._since = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a CPU-GPU sync point, once per reading
        return time.perf_counter()

    def seconds(self) -> float:
        """Training seconds up to now."""
        now = self._now()
        self.total += now - self._since
        self._since = now
        return self.total

    def skip(self) -> None:
        """Leave the time since the last reading out of the count (it was spent validating)."""
        self._since = self._now()
