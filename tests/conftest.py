"""Shared pytest fixtures: deterministic torch settings and a fresh temporary run folder."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Keep CPU tests predictable on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _torch_threads():
    import torch

    torch.set_num_threads(1)
    yield


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` (`cuda(gpus=2)` for two) are skipped, with the reason, without enough GPUs."""
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is None:
            continue
        needed = marker.kwargs.get("gpus", 1)
        if found < needed:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {needed} CUDA GPU{'s' if needed > 1 else ''}, this machine has {found} "
                       f"(a GPU owner runs these with bench/gpu_owner.sh)"))
