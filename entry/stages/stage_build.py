"""Shared building blocks of the stages' builds: loaders over the latent cache, the earlier stages'
weights, models placed and sharded in the order docs/design.md fixes (distributed rule 1), and the
optimizer with its schedule."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from core.schedule import cosine_decay
from entry.config.load import ConfigError
from entry.config.schema import Config, StageConfig
from entry.data.cache_plan import cache_plan, open_cache
from entry.distributed.process_group import DistInfo
from entry.distributed.sharding import wrap_model
from entry.stages.source import NEW_FIELDS_ATTR, NEW_ROWS_ATTR, source_config, source_weights, start_from, task_rows
from entry.storage.run_folder import weights_file
from pipelines.datasets import LatentPairs
from pipelines.loader import build_loader
from pipelines.samplers import BatchSampler, DistributedIndexSampler, MultiTaskBatchSampler


def latent_pair_loader(cfg: Config, info: DistInfo, kind: str, split: str, *, global_batch: int,
                       horizon: int = 1, unroll: int = 1):
    """Loader of {z_t, z_next, dt, task_id, sample_id, ...} pairs from the latent cache
    (with ``unroll`` > 1 also ``z_seq``, the targets of an unrolled rollout).

    Single-task data use a distributed index sampler (disjoint shards, equal counts);
    several tasks use the multi-task sampler so every global batch has the configured mix.
    """
    plan = cache_plan(cfg, kind, split)
    dataset = LatentPairs(open_cache(plan), horizon_k=horizon, task_names=list(plan.task_names), unroll=unroll)
    per_rank = global_batch // info.world_size
    seed = cfg.training.seed
    if len(dataset.task_sizes) > 1:
        sampler = MultiTaskBatchSampler(dataset.task_sizes, global_batch=global_batch, rank=info.rank,
                                        world_size=info.world_size, strategy=cfg.data.task_sampling, seed=seed,
                                        weights=cfg.data.integer_task_weights())
    else:
        sampler = BatchSampler(DistributedIndexSampler(len(dataset), rank=info.rank, world_size=info.world_size,
                                                       seed=seed), per_rank, drop_last=True)
    if len(sampler) == 0:
        raise ConfigError(f"{kind}/{split} cache has {len(dataset)} pairs, fewer than one global batch of "
                          f"{global_batch}; lower the stage's batch_size or generate more samples")
    return build_loader(dataset, sampler, num_workers=cfg.training.num_workers,
                        prefetch_factor=cfg.training.prefetch_factor, pin_memory=info.device.type == "cuda")


def upstream_weights(run_dir: Path, stage: str) -> Path:
    """The exported weights of the earlier stage `stage` in `run_dir`; a `ConfigError` naming the
    command that makes them when they are missing."""
    path = weights_file(run_dir, stage)
    if not path.is_file():
        raise ConfigError(f"missing {stage} weights {path}: run `python -m entry.{stage} --config CFG` first "
                          f"(or entry.pipeline)")
    return path


def from_source(make: Callable[[], nn.Module], cfg: Config, stage: str) -> Callable[[], nn.Module]:
    """A maker of `make`'s model started from the weights the fine-tuning source run exported for
    `stage` (entry.stages.source: task rows mapped, measured statistics kept); `make` itself when
    the config fine-tunes nothing or the source did not train `stage`."""
    path = source_weights(cfg, stage)
    if path is None:
        return make
    rows = task_rows(source_config(cfg), cfg)
    # A frozen stage that trains at all trains only what its source lacks (entry.training.finetune.trains_new_only).
    return lambda: start_from(make(), path, rows, new_lr_scale=cfg.finetune.new_lr_scale,
                              new_only=stage in cfg.finetune.freeze)


def place_model(make: Callable[[], nn.Module], cfg: Config, info: DistInfo) -> nn.Module:
    """Build with the config's seed (identical initial weights on every rank), move to the
    device, compile each block, then shard or replicate (torchtitan's order; docs/design.md, distributed rule 1)."""
    return _placed(seeded(make, cfg), cfg, info)


def place_with_copy(make: Callable[[], nn.Module], cfg: Config, info: DistInfo, *,
                    copied: bool) -> tuple[nn.Module, nn.Module | None]:
    """`place_model`'s model and, with `copied`, a frozen copy of its starting weights placed and
    sharded exactly as it is, so that the copy's parameters line up with the model's shard for
    shard (a moving average's start, `ema_decay`, or a target network's); (model, None) without.
    `make` runs once: a fine-tuned model's source weights are read once, a codec's linear path is
    fitted once."""
    model = seeded(make, cfg)
    twin = copy.deepcopy(model) if copied else None
    placed = _placed(model, cfg, info)
    if twin is None:
        return placed, None
    # Frozen after wrapping: DDP refuses to wrap a module with nothing to train.
    return placed, _placed(twin, cfg, info).requires_grad_(False)


def seeded(make: Callable[[], nn.Module], cfg: Config) -> nn.Module:
    """`make()` under the config's seed, the global generator left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.training.seed)
        return make()


def _placed(model: nn.Module, cfg: Config, info: DistInfo) -> nn.Module:
    t = cfg.training
    return wrap_model(model, info, parallel=t.parallel, precision=t.precision, compile=t.compile,
                      cpu_offload=t.cpu_offload)


def optimizer_for(model: nn.Module, stage: StageConfig, info: DistInfo):
    """AdamW (fused on CUDA) and its warm-up + cosine schedule; (None, None) for a model with no
    trainable parameters (a codec that is its fitted linear path alone)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return None, None
    opt = torch.optim.AdamW(params, lr=stage.lr, weight_decay=stage.weight_decay, betas=(0.9, stage.adam_beta2),
                            fused=info.device.type == "cuda")
    scale_new_rows(opt, model)
    return opt, cosine_schedule(opt, steps=stage.steps, warmup=stage.warmup_steps)


def scale_new_rows(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Give what a fine-tuned model gained their own learning rate (`finetune.new_lr_scale`): the
    task-table rows (`entry.stages.source.NEW_ROWS_ATTR`) and a field codec's new field embeddings
    (`NEW_FIELDS_ATTR`); each step's update of those is scaled. AdamW's update (its decoupled
    weight decay too) is proportional to the learning rate, so this is a per-row learning rate;
    scaling the gradient would not be (Adam normalises it away). Under FSDP2 each rank scales the new
    rows its shard of the table holds (`local_rows`)."""
    marked = [(*local_rows(m.weight, rows), factor) for m in model.modules() if hasattr(m, NEW_ROWS_ATTR)
              for rows, factor in [getattr(m, NEW_ROWS_ATTR)]]
    # A new field's embedding is a whole parameter (rows None): its shards scale as the whole would.
    marked += [(m[key], None, factor) for m in model.modules() if hasattr(m, NEW_FIELDS_ATTR)
               for keys, factor in [getattr(m, NEW_FIELDS_ATTR)] for key in keys]
    if not marked:
        return
    before: dict[int, torch.Tensor] = {}

    def keep(opt, args, kwargs) -> None:
        for i, (weight, rows, _) in enumerate(marked):
            before[i] = (weight.detach() if rows is None else weight.detach()[rows.to(weight.device)]).clone()

    @torch.no_grad()
    def scale(opt, args, kwargs) -> None:
        for i, (weight, rows, factor) in enumerate(marked):
            if rows is None:
                weight.copy_(before[i] + factor * (weight - before[i]))
                continue
            rows = rows.to(weight.device)
            weight[rows] = before[i] + factor * (weight[rows] - before[i])

    optimizer.register_step_pre_hook(keep)
    optimizer.register_step_post_hook(scale)


def local_rows(weight: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor of ``weight``'s rows this process steps, the rows ``rows`` of the whole table that it
    holds, numbered within it): ``weight`` and ``rows`` themselves, or under FSDP2 (a DTensor sharded
    on dim 0 over a 1-D mesh, split as `torch.chunk` splits it: ceil(rows / ranks) a rank, the last
    ones shorter or empty) this rank's shard and the new rows that fall in it."""
    if not isinstance(weight, DTensor):
        return weight, rows
    if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ConfigError(f"finetune.new_lr_scale: a task table placed as {weight.placements} has no per-row "
                          f"learning rate here; set finetune.new_lr_scale=1")
    shard = weight.to_local()  # a view of the parameter's local rows: writing it steps them
    start = weight.device_mesh.get_local_rank() * -(-weight.shape[0] // weight.device_mesh.size())
    held = rows[(rows >= start) & (rows < start + shard.shape[0])]
    return shard, held - start


class CosineSchedule(torch.optim.lr_scheduler.LambdaLR):
    """Linear warm-up over ``warmup`` steps, then cosine decay (`core.schedule.cosine_decay`) to 10% of
    the peak at step ``steps``, or sooner: at the end of a time budget, once the loop sets ``time_spent`` (the fraction of
    `LoopSettings.max_train_s` the stage will have used by the end of the step it starts;
    `LoopSettings.anneal_to_time`). The decay follows whichever of the two runs out first, so a
    stage that its time budget stops ends annealed, as the peers of bench.race do."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, steps: int, warmup: int):
        self.time_spent: float | None = None

        def factor(i: int) -> float:
            if warmup and i < warmup:
                return (i + 1) / warmup
            progress = (i - warmup) / max(1, steps - warmup)
            if self.time_spent is not None:
                progress = max(progress, self.time_spent)
            return cosine_decay(progress, floor=0.1)

        super().__init__(optimizer, factor)


def cosine_schedule(optimizer: torch.optim.Optimizer, *, steps: int, warmup: int) -> CosineSchedule:
    """Linear warm-up then cosine decay to 10% of the peak (`CosineSchedule`)."""
    return CosineSchedule(optimizer, steps=steps, warmup=warmup)
