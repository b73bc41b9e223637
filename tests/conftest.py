"""Shared pytest fixtures: deterministic torch settings and a fresh temporary run folder; a session
that does not select the `cuda` tests hides the machine's GPUs, so the CPU tests run on the CPU
everywhere."""

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


def gpus_for_the_session(markexpr: str) -> bool:
    """Whether a pytest session with this `-m` expression may use the machine's GPUs: only when it
    selects the `cuda` tests (`python -m pytest -m cuda`, as bench/gpu_owner.sh runs them)."""
    # Selected: `cuda` appears under an even number of `not`s, counting those before a bracket.
    negated, pending = [False], False  # per bracket depth: under an odd count; a `not` waiting
    for word in markexpr.replace("(", " ( ").replace(")", " ) ").split():
        if word == "not":
            pending = not pending
        elif word == "(":
            negated.append(negated[-1] ^ pending)
            pending = False
        elif word == ")":
            if len(negated) > 1:
                negated.pop()
        else:
            if word == "cuda" and not negated[-1] ^ pending:
                return True
            pending = False
    return False


_GPUS_HIDDEN = pytest.StashKey[bool]()


def pytest_configure(config):
    # The other tests hold CPU numbers and CPU backends (gloo, one process per rank on one device):
    # on a GPU machine, device "auto" would move them to CUDA, and two ranks onto one GPU under
    # NCCL. Hidden before torch initialises CUDA, here and in every process the tests start (they
    # inherit the environment).
    if not gpus_for_the_session(config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        config.stash[_GPUS_HIDDEN] = True


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` (`cuda(gpus=2)` for two) are skipped, with the reason, without enough GPUs
    or in a session that hid them (`pytest_configure`)."""
    import torch

    if config.stash.get(_GPUS_HIDDEN, False):
        for item in items:
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(pytest.mark.skip(
                    reason="needs CUDA GPUs: a session that does not select `-m cuda` runs on the CPU alone, "
                           "hiding any GPU the machine has (`python -m pytest -m cuda` runs these on a GPU machine; "
                           "bench/gpu_owner.sh does)"))
        return
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
