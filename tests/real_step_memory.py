"""`python -m tests.real_step_memory CFG OUT` (plain or under torchrun): measure one real operator
training step's memory on this rank, independently of entry.distributed.memory_sim, for tests/test_plan.py.

Builds the operator as training does (`place_model`, `optimizer_for`), runs one step to allocate
the optimizer state, then profiles a second step with torch's CPU memory profiler. Writes
`OUT/rank<k>.json`: parameter, gradient and optimizer bytes (distinct storages of this rank's
tensors) and the activation peak (highest memory during forward + backward above its start).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tensordict import TensorDict


def _bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def _profiled_peak(prof) -> int:
    """Highest net bytes the CPU allocator handed out during the profiled region, from the profiler's
    allocation records in time order (export_memory_timeline, the public view, fails on FSDP2's
    in-place storage resizes)."""
    from torch._C._profiler import _EventType

    allocations, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(allocations):
        live += size
        peak = max(peak, live)
    return peak


def _batch(cfg, b: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    z = lambda: torch.randn(b, cfg.latent.tokens, cfg.latent.dim, generator=g)  # noqa: E731
    return TensorDict({"z_t": z(), "z_next": z(), "dt": torch.full((b,), 0.01),
                       "task_id": torch.zeros(b, dtype=torch.long), "sample_id": torch.arange(b),
                       "t": torch.zeros(b, dtype=torch.long)}, batch_size=[b])


def main(argv: list[str]) -> int:
    from torch.profiler import ProfilerActivity, profile

    from core.steps.operator import OperatorStepConfig, operator_step
    from entry.config.load import load_config
    from entry.distributed.precision import compute_autocast, resolve_for
    from entry.distributed.process_group import close_distributed, init_distributed
    from entry.distributed.sharding import gradient_sync
    from entry.models.build import build_operator
    from entry.stages.stage_build import optimizer_for, place_model

    cfg = load_config(argv[0])
    out = Path(argv[1])
    info = init_distributed(backend="gloo", timeout_s=120)
    cfg = resolve_for(cfg, info.device)
    try:
        model = place_model(lambda: build_operator(cfg), cfg, info)
        optimizer, _ = optimizer_for(model, cfg.operator, info)
        params = [p for p in model.parameters() if p.requires_grad]
        accum = cfg.training.accum_steps
        micro = cfg.operator.batch_size // info.world_size // accum
        step_cfg = OperatorStepConfig()

        def forward_backward(batch):
            for m in range(accum):
                with gradient_sync(model, m == accum - 1):
                    with compute_autocast(info.device, cfg.training.precision):  # forward only, as the loop
                        loss, _ = operator_step(model, dict(model.named_parameters()),
                                                batch[m * micro:(m + 1) * micro], cfg=step_cfg,
                                                generator=torch.Generator().manual_seed(0))
                    (loss / accum).backward()

        forward_backward(_batch(cfg, micro * accum, info.rank))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        batch = _batch(cfg, micro * accum, 100 + info.rank)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            forward_backward(batch)
        gradients = _bytes([p.grad for p in params])
        optimizer.step()
        optimizer_bytes = _bytes([v for s in optimizer.state.values() for v in s.values()])
        (out / f"rank{info.rank}.json").write_text(json.dumps({
            "parameters": _bytes(params), "gradients": gradients, "optimizer": optimizer_bytes,
            "activation_peak": _profiled_peak(prof), "micro_batch": micro}))
    finally:
        close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
