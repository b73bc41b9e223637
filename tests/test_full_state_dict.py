"""Exported weights of a placed model: FSDP2's shards (uneven and empty ones included) and DDP's
replica gather into exactly the plain model's state dict, on rank 0 only."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from entry.distributed.process_group import DistInfo
from entry.distributed.sharding import full_state_dict, wrap_model
from tests.tiny_run import free_port

pytestmark = [pytest.mark.distributed]


class _Blocks(nn.Module):
    """Rows 1, 5 and 7 over 2 or 3 ranks: shards of unequal length, and empty ones."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 1), nn.Linear(1, 5), nn.Linear(5, 7)])
        self.norm = nn.LayerNorm(7)
        self.register_buffer("scale", torch.arange(3.0))

    def blocks(self):
        return list(self.layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) * self.scale.sum()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Blocks()


def _rank(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    info = DistInfo(rank, world, rank, torch.device("cpu"), "gloo", 0)
    got = {}
    for parallel in ("fsdp", "ddp"):
        model = wrap_model(_model(), info, parallel=parallel, precision="fp32")
        got[parallel] = full_state_dict(model, info)
    if rank == 0:
        torch.save(got, out)
    else:
        assert all(v is None for v in got.values()), "a rank other than 0 kept a full copy"
    dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_placed_model_gathers_to_the_plain_state_dict(tmp_path, world):
    port = free_port()
    # fork: a spawned child would import the test module again (seconds per rank).
    mp.start_processes(_rank, args=(world, port, str(tmp_path / "sd.pt")), nprocs=world, start_method="fork")
    want = _model().state_dict()
    for parallel, got in torch.load(tmp_path / "sd.pt").items():
        assert got.keys() == want.keys(), parallel
        for key, value in want.items():
            assert got[key].device.type == "cpu" and torch.equal(got[key], value), (parallel, key)


def test_one_process_returns_its_own_tensors():
    info = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)
    model = _model()
    got = full_state_dict(model, info)
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
