"""Closing the process group (entry.distributed.process_group.close_distributed) on two gloo ranks: a rank
leaving normally waits for its peer before tearing the group down; a rank leaving on an exception does not,
and its peer learns of it at its own close."""

from __future__ import annotations

import os
import time

import orjson
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from entry.distributed.process_group import close_distributed
from tests.tiny_run import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

LATE_S = 1.0
"""How long after its peer rank 1 reaches its own close when rank 0 leaves normally."""
WAIT_S = 60.0
"""How long rank 1 waits for a failing rank 0 to have left its close before reaching its own."""


def _rank(rank: int, port: int, out: str, raising: bool) -> None:
    """Rank 0 closes at once (inside a `finally`, on its way out normally or on an exception); rank 1 closes
    LATE_S later, or (rank 0 raising) once rank 0 has left its close. Each writes when it reached and left
    its close."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.barrier()  # both start the clock together
    if rank == 1 and not raising:
        time.sleep(LATE_S)
    if rank == 1 and raising:  # a rank 0 that waited for its peer never writes: rank 1 gives up and says so
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(f"{out}-0.json") and time.monotonic() < deadline:
            time.sleep(0.01)
    reached, raised = time.monotonic(), ""
    try:
        try:
            if rank == 0 and raising:
                raise RuntimeError("rank 0 fails")
        finally:
            close_distributed()
    except RuntimeError as e:  # rank 0's own, or rank 1's barrier failing on its closed peer
        raised = "own" if str(e) == "rank 0 fails" else "peer"
    left = time.monotonic()
    with open(f"{out}-{rank}.tmp", "wb") as f:
        f.write(orjson.dumps({"reached": reached, "left": left, "initialized": dist.is_initialized(),
                             "raised": raised}))
    os.replace(f"{out}-{rank}.tmp", f"{out}-{rank}.json")  # whole when rank 1 sees it


def _run(tmp_path, raising: bool) -> list[dict]:
    out = str(tmp_path / "close")
    # fork: CLOCK_MONOTONIC is one clock for the whole machine, so the ranks' times compare.
    mp.start_processes(_rank, args=(free_port(), out, raising), nprocs=2, start_method="fork")
    return [orjson.loads(open(f"{out}-{r}.json", "rb").read()) for r in (0, 1)]


def test_a_rank_leaving_normally_closes_only_after_its_peer_reached_its_close(tmp_path):
    first, late = _run(tmp_path, raising=False)
    assert first["left"] >= late["reached"]
    assert not first["initialized"] and not late["initialized"]
    assert first["raised"] == late["raised"] == ""


def test_a_rank_leaving_on_an_exception_does_not_wait_for_its_peer(tmp_path):
    failed, late = _run(tmp_path, raising=True)
    assert failed["left"] < late["reached"]
    assert (failed["raised"], late["raised"]) == ("own", "peer")
    assert not failed["initialized"] and not late["initialized"]
