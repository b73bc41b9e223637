"""GPU utilisation and memory sampled through NVML in a background thread.

    with GpuSampler(device) as gpu:
        ...                       # the timed section
    gpu.result()                  # {"available", "util_pct_mean", "util_pct_min", ...}

`pynvml` (the `nvidia-ml-py` package, in the `gpu` extra: `pip install -e '.[gpu]'`) is imported
lazily: without it, without a GPU, or when NVML cannot start, the figures are null and `note`
says why in plain words (the section still runs). A sampler can be entered again (the rounds of a
benchmark): its figures then cover every period it was active. NVML's utilisation is the
fraction of its own sample period (1/6 s to 1 s, driver-dependent) in which any kernel ran,
so short sections read coarse; polling at 20 Hz keeps every NVML update.
"""

from __future__ import annotations

import os
import threading
import time

import torch

DEFAULT_HZ = 20.0


class GpuSampler:
    """Context manager polling utilisation (%) and used memory (bytes) of one GPU at `hz`."""

    def __init__(self, device: torch.device, *, hz: float = DEFAULT_HZ):
        if hz < 10:
            raise ValueError(f"hz must be >= 10 (the benchmark's resolution), got {hz}")
        self.device, self.period = device, 1.0 / hz
        self.util: list[int] = []
        self.memory: list[int] = []
        self.note: str | None = None
        self._nvml, self._handle = None, None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._seconds = 0.0

    def __enter__(self) -> GpuSampler:
        self._t0 = time.perf_counter()
        self._stop.clear()
        if self.device.type != "cuda":
            self.note = "no GPU: utilisation not sampled"
            return self
        try:
            import pynvml  # lazy: CPU installs run without it

            pynvml.nvmlInit()
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(index))
            self._nvml = pynvml
        except ImportError:
            self.note = ("GPU utilisation not sampled: pynvml is not installed (pip install -e '.[gpu]' "
                         "installs nvidia-ml-py)")
            return self
        except Exception as e:  # NVMLError when the driver refuses
            self.note = f"GPU utilisation not sampled: NVML did not start ({type(e).__name__}: {e})"
            return self
        self._thread = threading.Thread(target=self._poll, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        nv = self._nvml
        while not self._stop.is_set():
            try:
                self.util.append(nv.nvmlDeviceGetUtilizationRates(self._handle).gpu)
                self.memory.append(nv.nvmlDeviceGetMemoryInfo(self._handle).used)
            except Exception as e:  # a failing read ends sampling, never the benchmark
                self.note = f"NVML read failed ({type(e).__name__}: {e})"
                return
            self._stop.wait(self.period)

    def __exit__(self, *exc: object) -> None:
        self._seconds += time.perf_counter() - self._t0
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutdown failures change no figure
                pass

    def result(self) -> dict:
        """Mean/min/max utilisation (%), max used memory (GiB; all processes on the GPU), samples, Hz."""
        seconds = max(self._seconds, 1e-9)
        if not self.util:
            return {"available": False, "util_pct_mean": None, "util_pct_min": None, "util_pct_max": None,
                    "memory_used_gib_max": None, "samples": 0, "note": self.note or "no samples taken"}
        return {"available": True, "util_pct_mean": sum(self.util) / len(self.util),
                "util_pct_min": min(self.util), "util_pct_max": max(self.util),
                "memory_used_gib_max": max(self.memory) / 2**30, "samples": len(self.util),
                "sample_hz": len(self.util) / seconds, "note": self.note}


def _physical_index(index: int) -> int:
    """NVML counts every GPU; CUDA counts those in CUDA_VISIBLE_DEVICES (integer lists only)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if ids and all(v.isdigit() for v in ids) and index < len(ids):
        return int(ids[index])
    return index
