# long file: one benchmark: three input paths timed side by side in one interleaved loop over shared set-up
"""`python -m bench.epoch_time --config CFG [--set k=v] [--rounds 3] [--epochs-timed 1] [--max-steps N]
[--profile DIR] [--out DIR]`

Epoch time of the operator stage, three ways in one run, on the same data and model
(also under torchrun: every rank times its own shard, rank 0 writes the result):

- `pipeline`: what training runs: latent cache -> torchdata loader -> `entry.stages.operator.build`'s
  model (the config's precision, compile and parallel settings) and step (forward, backward,
  gradient clip, the loop's non-finite agreement, optimizer step), batches moved with
  `.to(device, non_blocking=True)`.
- `bound`: compute only: the same steps on batches already resident on the device.
- `baseline`: a map-style `torch.utils.data.DataLoader` (num_workers 0, one sample per
  `__getitem__`) over `FieldTrajectoryPairs`, both fields encoded on the fly by the frozen
  encoder, fp32, no compile, a plain module (no FSDP, no gradient sync), its step the training
  step itself (`train_step`) without gradient clipping or collectives.

The first `--warmup-steps` steps (compilation included) are timed apart and excluded. Then
`--rounds R` rounds each time the three sections one after the other (`--epochs-timed` epochs
each), so a slow spell of a shared machine hits all three alike instead of one section: every
section reports its seconds per step as min / median / max over the rounds, every ratio
(pipeline / bound, baseline / pipeline) is taken within each round and reported the same way,
and `spread_exceeds_effect` says when a ratio's max - min is larger than its distance from 1
(the measurement then does not tell the two apart). Epoch times use the median round.
With `--max-steps N` each epoch is cut to N steps and the epoch time is extrapolated from
the time per step (`extrapolated: true`). Data wait: time blocked in `next(loader)` over the
section's time. FLOPs: `FlopCounterMode` over one forward+backward of the plain module;
MFU against the device's bf16 dense peak. Missing data, encoder weights or cache are made
here; a freshly initialised encoder costs the same time as a trained one (the JSON says so).
Writes `<out>/<device>-<YYYY-MM-DD>-epoch_time.json` and prints a table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import sys
import time
from pathlib import Path

import orjson
import torch
from tensordict import TensorDict
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from bench.nvml import GpuSampler
from bench.provenance import record_stamp
from entry.config.cli import exits_on_user_error, parse_config
from entry.config.load import ConfigError, config_hash
from entry.config.schema import Config
from entry.data.cache_plan import cache_plan, encoder_weights, open_cache
from entry.data.files import ensure_data
from entry.data.latent_cache import build_cache
from entry.distributed.process_group import DistInfo, close_distributed, init_distributed, rank0_published
from entry.models.build import build_autoencoder, build_operator
from entry.stages.operator import build
from entry.storage.run_folder import environment, run_dir_for, setup_logging
from entry.training.runner import loop_settings
from entry.stages.parts import StageParts
from entry.training.step import LoopSettings, StepPhase, accumulate_gradients, train_step
from pipelines.fields import FieldTrajectoryPairs
from pipelines.latent_cache import CacheError

PEAK_BF16_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100 SXM": 989e12, "A100": 312e12}
PROFILE_STEPS = 5
NO_GPU_NOTE = "no GPU: peak memory, MFU and NVML utilisation are absent (null)"


def _extra_args(p) -> None:
    p.add_argument("--rounds", type=int, default=3, help="rounds of the three sections, interleaved")
    p.add_argument("--epochs-timed", type=int, default=1, help="timed epochs per section and round")
    p.add_argument("--max-steps", type=int, default=None, help="cut every timed epoch to N steps")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed pipeline steps first (compile)")
    p.add_argument("--profile", type=Path, default=None, help="write a chrome trace of a few pipeline steps here")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="result folder")


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(bf16 dense peak FLOP/s, device name or why unknown)."""
    return (None, "no GPU") if device.type != "cuda" else peak_for_name(torch.cuda.get_device_name(device))


def peak_for_name(name: str) -> tuple[float | None, str]:
    """Peak of a CUDA device name from PEAK_BF16_FLOPS (None with a note when not in the table)."""
    key = ("H200" if "H200" in name else "H100 PCIe" if "H100" in name and "PCIe" in name
           else "H100 SXM" if "H100" in name and ("SXM" in name or "HBM3" in name)
           else "A100" if "A100" in name else None)
    if key is None:
        return None, f"{name}: bf16 peak unknown (known: {', '.join(PEAK_BF16_FLOPS)}); MFU not computed"
    return PEAK_BF16_FLOPS[key], f"{name} as {key}"


def prepare(cfg: Config, info: DistInfo, logger) -> str:
    """Data, encoder weights and the dynamic/train cache, made where missing; returns the encoder note."""
    if info.is_main:
        ensure_data(cfg)
    rank0_published(info, wrote=True)
    weights = encoder_weights(cfg)
    note = f"trained weights {weights}"
    if not weights.is_file():
        note = (f"freshly initialised encoder (seed {cfg.training.seed}) saved as {weights}: "
                f"its weights do not change the timing")
        if info.is_main:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.training.seed)
                model = build_autoencoder(cfg)
            weights.parent.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), weights)
    rank0_published(info, wrote=True)
    try:
        open_cache(cache_plan(cfg, "dynamic", "train"))
    except CacheError as e:
        logger.info(f"building the latent cache ({e})")
        if build_cache(cfg, info, logger, "dynamic", "train") is None:
            raise ConfigError("data.tasks: the benchmark needs at least one time-dependent task") from None
    return note


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued kernels (no-op off CUDA), so a clock read after it is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the section's kernels are done before the clock is read


def make_step(parts, settings: LoopSettings, info: DistInfo):
    """One optimizer step of the operator exactly as the training loop takes it
    (`entry.training.step.train_step`, with the loop settings the stage command would use)."""
    def step(batch, i: int) -> None:
        train_step(parts, batch, i, settings, info, micro=batch.batch_size[0], accum=1)

    return step


def timed(batches, step, n: int, device: torch.device, *, first: int = 0) -> dict:
    """Run `n` steps on `next(batches)`; seconds, data-wait seconds and peak memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync_device(device)
    wait, t0 = 0.0, time.perf_counter()
    for i in range(n):
        a = time.perf_counter()
        batch = next(batches)
        wait += time.perf_counter() - a
        step(batch.to(device, non_blocking=True), first + i)
    sync_device(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"seconds": seconds, "wait": wait, "peak_memory_gib": peak, "start": t0}


def spread(values: list[float]) -> dict:
    """`{"rounds": values, "min", "median", "max"}` (the median of an even count is the mean of the middle two)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {"rounds": list(values), "min": ordered[0], "median": median, "max": ordered[-1]}


def ratio(numerators: list[float], denominators: list[float]) -> dict:
    """A ratio taken within each round, its spread, and whether the spread hides the effect:
    `spread_exceeds_effect` when max - min exceeds |median - 1|."""
    out = spread([a / b for a, b in zip(numerators, denominators, strict=True)])
    out["spread_exceeds_effect"] = out["max"] - out["min"] > abs(out["median"] - 1)
    return out


def section(rounds: list[list[dict]], gpu: GpuSampler, *, steps_per_epoch: int, batch: int, flops: float | None,
            peak: float | None, origin: float = 0.0) -> dict:
    """Figures of one timed section from its `timed` results, one list of epochs per round.

    `s_per_step` is the min / median / max over rounds; `epoch_s`, samples/s and MFU use the median;
    `round_start_s` is when each round of the section began, in seconds after `origin`.
    """
    runs = [r for epochs in rounds for r in epochs]
    seconds, wait = sum(r["seconds"] for r in runs), sum(r["wait"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    per_step = spread([sum(r["seconds"] for r in epochs) / sum(r["steps"] for r in epochs) for epochs in rounds])
    median = per_step["median"]
    mems = [r["peak_memory_gib"] for r in runs if r["peak_memory_gib"] is not None]
    return {"timed_steps": steps, "timed_s": seconds, "s_per_step": per_step,
            "steps_per_epoch": steps_per_epoch, "epoch_s": median * steps_per_epoch,
            "extrapolated": steps != steps_per_epoch * len(runs), "samples_per_s": batch / median,
            "data_wait_fraction": wait / seconds, "peak_memory_gib": max(mems) if mems else None,
            "mfu": flops / median / peak if flops and peak else None, "gpu_util": gpu.result(),
            "round_start_s": [epochs[0]["start"] - origin for epochs in rounds]}


def count_flops(parts: StageParts, model, batch, settings: LoopSettings, info: DistInfo) -> float:
    """FLOPs of one forward+backward of `model` on `batch` (matmuls, convolutions, attention), taken
    as the training step takes them (`entry.training.step.accumulate_gradients`, one micro-batch)."""
    with FlopCounterMode(display=False) as counter:
        accumulate_gradients(parts, model, batch, batch.batch_size[0], 1, 0, settings, info, StepPhase())
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def baseline_parts(cfg: Config, info: DistInfo, per_rank: int, parts: StageParts):
    """(the baseline's `StageParts`: a plain fp32 operator, its AdamW at a constant rate, the stage's
    step and frozen inputs, a map-style DataLoader over field pairs; the frozen encoder)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.training.seed)
        model = build_operator(cfg).to(info.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.operator.lr, weight_decay=cfg.operator.weight_decay)
    constant = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    ae = build_autoencoder(cfg)
    plan = cache_plan(cfg, "dynamic", "train")
    ae.load_state_dict(torch.load(plan.encoder, map_location="cpu", weights_only=True))
    encoder = ae.encoder.requires_grad_(False).to(info.device).eval()
    data = torch.utils.data.ConcatDataset([
        FieldTrajectoryPairs(t.path, t.rows[info.rank::info.world_size], reduce_x=t.reduce_x,
                             reduce_t=t.reduce_t, horizon=cfg.operator.horizon, task_id=t.index, task=t.spec)
        for t in plan.tasks])
    loader = torch.utils.data.DataLoader(data, batch_size=per_rank, shuffle=True, drop_last=True, num_workers=0,
                                         collate_fn=torch.cat,  # items are TensorDicts of one sample
                                         generator=torch.Generator().manual_seed(cfg.training.seed))
    base = StageParts("operator", model, parts.step_fn, parts.step_cfg, loader, opt, constant, frozen=parts.frozen)
    return base, encoder


SECTIONS = ("pipeline", "bound", "baseline")


def make_base_step(base: StageParts, encoder, settings: LoopSettings, info: DistInfo):
    """The plain baseline's step: encode the fields on the fly, then the training step
    (`entry.training.step.train_step`) of the plain module in fp32, unclipped, and in its rank's own
    view (world size 1: each rank trains its own replica on its shard, so no collective, as before)."""
    plain = dataclasses.replace(settings, autocast=contextlib.nullcontext, grad_clip=0.0)
    alone = DistInfo(0, 1, 0, info.device, None, info.restart_count)

    def base_step(batch, i: int) -> None:
        with torch.no_grad():
            z_t, z_next = encoder(batch["u_t"]), encoder(batch["u_next"])
        td = TensorDict({"z_t": z_t, "z_next": z_next, "dt": batch["dt"], "t": batch["t"],
                         "task_id": batch["task_id"], "sample_id": batch["sample_id"]}, batch_size=[z_t.shape[0]])
        train_step(base, td, i, plain, alone, micro=z_t.shape[0], accum=1)

    return base_step


def interleaved_rounds(run_epoch: dict, n_rounds: int, epochs: int, device: torch.device):
    """Time every section's epochs round by round (section -> (epoch fn, steps)): a slow spell of a
    shared machine falls on all three sections of a round. -> (section -> rounds of epoch timings,
    section -> its GpuSampler, the wall clock origin)."""
    gpus = {name: GpuSampler(device) for name in SECTIONS}
    rounds: dict[str, list[list[dict]]] = {name: [] for name in SECTIONS}
    origin = time.perf_counter()
    for r in range(n_rounds):
        for name in SECTIONS:
            epoch_fn, steps = run_epoch[name]
            with gpus[name]:
                rounds[name].append([{**epoch_fn(r * epochs + e), "steps": steps} for e in range(epochs)])
    return rounds, gpus, origin


def run(cfg: Config, args, info: DistInfo) -> dict:
    run_dir = run_dir_for(cfg)
    logger = setup_logging(run_dir, info, "epoch_time")
    encoder_note = prepare(cfg, info, logger)
    dev, per_rank = info.device, cfg.operator.batch_size // info.world_size
    peak, peak_note = peak_flops(dev)
    parts = build(cfg, info, run_dir, logger)
    settings = loop_settings(cfg, cfg.operator, info, "operator")
    step = make_step(parts, settings, info)
    loader, epochs = parts.loader, args.epochs_timed
    n_epoch = len(loader)
    n = min(n_epoch, args.max_steps or n_epoch)
    out: dict = {"encoder": encoder_note, "peak_bf16_flops": peak, "peak_note": peak_note,
                 "world_size": info.world_size, "batch_size": cfg.operator.batch_size, "per_rank_batch": per_rank,
                 "rounds": args.rounds}
    try:
        loader.set_epoch(0)
        warm = min(args.warmup_steps, n_epoch)
        w = timed(iter(loader), step, warm, dev)
        out["warmup"] = {"steps": warm, "seconds": w["seconds"], "note": "first steps, compilation included"}

        base, encoder = baseline_parts(cfg, info, per_rank, parts)
        loader.set_epoch(1)
        batches = iter(loader)
        resident = [next(batches).to(dev, non_blocking=True) for _ in range(n)]
        flops = count_flops(parts, base.model, resident[0], settings, info)
        out["parameters"] = sum(p.numel() for p in base.model.parameters())
        out["flops_per_step"] = flops
        out["flops_note"] = "forward+backward of one per-rank batch, plain fp32 module (FlopCounterMode)"
        del batches

        base_step = make_base_step(base, encoder, settings, info)
        n_base_epoch = len(base.loader)
        n_base = min(n_base_epoch, args.max_steps or n_base_epoch)
        base_warm = min(2, n_base_epoch)
        base_w = timed(iter(base.loader), base_step, base_warm, dev)

        def pipeline_epoch(k: int) -> dict:
            loader.set_epoch(1 + k)
            return timed(iter(loader), step, n, dev, first=warm + k * n)

        run_epoch = {"pipeline": (pipeline_epoch, n),
                     "bound": (lambda k: timed(iter(resident), step, n, dev, first=warm + k * n), n),
                     "baseline": (lambda k: timed(iter(base.loader), base_step, n_base, dev), n_base)}
        rounds, gpus, origin = interleaved_rounds(run_epoch, args.rounds, epochs, dev)
        del resident
        for name, steps_per_epoch in (("pipeline", n_epoch), ("bound", n_epoch), ("baseline", n_base_epoch)):
            out[name] = section(rounds[name], gpus[name], steps_per_epoch=steps_per_epoch, batch=per_rank,
                                flops=flops, peak=peak, origin=origin)
        out["baseline"]["warmup"] = {"steps": base_warm, "seconds": base_w["seconds"]}

        if args.profile is not None:
            out["profile"] = profile_pipeline(parts, step, info, args.profile)
    finally:
        loader.close()

    out["ratios"] = epoch_ratios(out)
    return out


def epoch_ratios(out: dict) -> dict:
    """Pipeline / bound and baseline / pipeline epoch times, each taken within a round."""
    epoch_s = {name: [x * out[name]["steps_per_epoch"] for x in out[name]["s_per_step"]["rounds"]]
               for name in SECTIONS}
    return {"pipeline_over_bound": ratio(epoch_s["pipeline"], epoch_s["bound"]),
            "baseline_over_pipeline": ratio(epoch_s["baseline"], epoch_s["pipeline"])}


def profile_pipeline(parts, step, info: DistInfo, folder: Path) -> str:
    """Chrome trace of PROFILE_STEPS pipeline steps into `folder`; returns its path."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    folder.mkdir(parents=True, exist_ok=True)
    parts.loader.set_epoch(10**6)
    n = min(PROFILE_STEPS, len(parts.loader))
    with profile(activities=acts) as prof:
        timed(iter(parts.loader), step, n, info.device, first=10**6)
    path = folder / f"pipeline-rank{info.rank}.json"
    prof.export_chrome_trace(str(path))
    return str(path)


def print_table(r: dict) -> None:
    print(f"{'section':<10}{'epoch s':>10}{'s/step min / median / max':>30}{'steps':>8}{'samples/s':>12}"
          f"{'data wait':>11}{'peak GiB':>10}{'MFU':>8}{'GPU util %':>12}")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for name in SECTIONS:
        s, q = r[name], r[name]["s_per_step"]
        per_step = f"{q['min']:.4f} / {q['median']:.4f} / {q['max']:.4f}"
        print(f"{name:<10}{s['epoch_s']:>10.3f}{per_step:>30}{s['steps_per_epoch']:>8}{s['samples_per_s']:>12.1f}"
              f"{s['data_wait_fraction']:>11.1%}{fmt(s['peak_memory_gib'], '.2f'):>10}{fmt(s['mfu'], '.1%'):>8}"
              f"{fmt(s['gpu_util']['util_pct_mean'], '.0f'):>12}")
    print(f"{r['rounds']} interleaved rounds; epoch s from the median round")
    for key, label in (("pipeline_over_bound", "pipeline / bound"), ("baseline_over_pipeline", "baseline / pipeline")):
        q = r["ratios"][key]
        verdict = (f"spread {q['max'] - q['min']:.2f} is larger than the effect {abs(q['median'] - 1):.2f}: "
                   f"not resolved on this machine" if q["spread_exceeds_effect"] else "spread smaller than the effect")
        print(f"{label}: median {q['median']:.2f}x (min {q['min']:.2f}, max {q['max']:.2f}); {verdict}")
    print(f"warm-up {r['warmup']['seconds']:.2f} s ({r['warmup']['steps']} steps); "
          f"{r['flops_per_step'] / 1e9:.3f} GFLOP/step")
    for note in (r["gpu_note"], r["gpu_util_note"]):
        if note:
            print(note)


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _extra_args)
    if (args.rounds < 1 or args.epochs_timed < 1 or args.warmup_steps < 0
            or (args.max_steps is not None and args.max_steps < 1)):
        raise ConfigError("--rounds, --epochs-timed and --max-steps need integers >= 1, --warmup-steps >= 0")
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s)
    try:
        if cfg.operator.batch_size % info.world_size:
            raise ConfigError(f"operator.batch_size ({cfg.operator.batch_size}) must be divisible by the world "
                              f"size ({info.world_size})")
        date = datetime.date.today().isoformat()
        gpu = info.device.type == "cuda"
        report = {"benchmark": "epoch_time", **record_stamp(info.device), "date": date,
                  "config": args.config, "overrides": list(args.overrides), "config_hash": config_hash(cfg),
                  "precision": cfg.training.precision, "compile": cfg.training.compile,
                  "environment": environment(), "gpu": gpu,
                  "gpu_note": None if gpu else NO_GPU_NOTE, "epochs_timed": args.epochs_timed,
                  "max_steps": args.max_steps, **run(cfg, args, info)}
        # On a GPU, say plainly when utilisation could not be sampled (pynvml missing, NVML refused).
        report["gpu_util_note"] = (report["pipeline"]["gpu_util"]["note"]
                                   if gpu and not report["pipeline"]["gpu_util"]["available"] else None)
        if info.is_main:
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"{report['device']}-{date}-epoch_time.json"
            path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
            print_table(report)
            print(f"wrote {path}")
        return 0
    finally:
        logging.shutdown()
        close_distributed()


if __name__ == "__main__":
    sys.exit(main())
