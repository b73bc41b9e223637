"""Final test scores of a trained run (collective: every rank calls `evaluate_config`).

Loads the exported weights of the run folder, rolls every test trajectory out autoregressively
in latent space from its last given frame, decodes, and scores with PDEBench's metrics
(core/metrics.py) and, for time-dependent tasks, lead-time windows, correlation time, spectrum
error and, with `evaluation.ensemble_members` > 1, ensemble scores of the refiners
(entry/evaluation/long_rollout.py). Ranks take contiguous shards of each task's test samples and
add their per-sample metric sums with `all_reduce` (the val split's instead with
`evaluation.split: val`); rank 0 writes `<run_dir>/eval.json` (`eval_val.json`, `eval_small.json`:
`entry.storage.run_folder.evaluation_file`), the plots under `<run_dir>/plots/`, a table on the
terminal, and the numbers to wandb when it is enabled. The command is `entry/evaluate.py`.

Legend: N samples, B batch, T time steps, C channels, S spatial axes, L tokens, D latent dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
import torch
import torch.distributed as dist
from torch import Tensor

from core.evaluation import Decode, Encode, MetricSums, StepFn, accumulate_reconstruction, accumulate_task
from entry.config.load import config_hash
from entry.config.schema import Config, TaskConfig
from entry.data.files import require_same_data, task_path
from entry.distributed.precision import resolve_for
from entry.distributed.process_group import DistInfo
from entry.evaluation.long_rollout import (KeepPrediction, RolloutSums, ensemble_fan, rollout_member,
                                          rollout_step_cost)
from entry.evaluation.plots import write_plots
from entry.evaluation.references import IdentityCodec, reference_models
from entry.evaluation.table import format_table
from entry.evaluation.task_frames import (EVAL_BATCH, SMALL_EVAL_SAMPLES, require_scored_rows, scored_steps, task_label,
                                          window)
from entry.evaluation.variants import STOCHASTIC, checked_data, load_models, required_weights, variants
from entry.storage.atomic import atomic_write_bytes
from entry.storage.run_folder import (MetricsSink, commit_label, evaluation_file, evaluation_suffix, published_selection,
                                      run_dir_for)
from pipelines.fields import SAMPLE_ID_STRIDE
from pipelines.task_data import open_task, read_trajectories


def all_reduce_sums(sums: MetricSums, info: DistInfo) -> None:
    """Combine the ranks' sums: exactly two collectives, whatever this rank's shard size."""
    if not info.distributed:
        return

    packed = torch.cat([sums.sums_KCT.flatten(), sums.count.reshape(1)])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    sums.sums_KCT.copy_(packed[:-1].view_as(sums.sums_KCT))
    sums.count.copy_(packed[-1])
    dist.all_reduce(sums.max_CT, op=dist.ReduceOp.MAX)  # errors are >= 0: an empty shard's zeros are neutral


def evaluate_task(task_cfg: TaskConfig, task_index: int, u_true_NTCS: Tensor, *, given_steps: int, dt: float,
                  encode: Encode | None = None, step_fn: StepFn | None = None, decode: Decode | None = None,
                  predict_fields: StepFn | None = None, coefficient_NCS: Tensor | None = None,
                  rollout_steps: int = 0, batch_size: int = EVAL_BATCH,
                  lead_windows: tuple[int, ...] = (10, 30)) -> dict:
    """Scores of one task and one model on one process (the command adds ranks around this).

    Pass the latent model (``encode(u_BCS) -> z``, ``step_fn(z_BLD, dt_B, task_id_B) -> z_next``,
    ``decode(z_BLD, grid_shape) -> u_BCS``), or ``predict_fields(u_BCS, dt_B, task_id_B) -> u_next``
    stepping in field space (oracles and baselines in tests). Returns ``MetricSums.summary()``,
    and for a time-dependent task the single rollout's ``RolloutSums.summary(lead_windows)``.
    """
    if predict_fields is not None:
        encode, step_fn, decode = (lambda u: u), predict_fields, (lambda z, grid: z)
    if encode is None or step_fn is None or decode is None:
        raise ValueError("pass encode, step_fn and decode, or predict_fields")
    steady = task_cfg.spec.steady
    t = 1 if steady else window(u_true_NTCS.shape[1], given_steps, rollout_steps)
    sums = MetricSums.zeros(u_true_NTCS.shape[2], t, 0 if steady else given_steps, steady, u_true_NTCS.device)
    long = None if steady else RolloutSums.zeros(u_true_NTCS.shape[2], t, given_steps, 1, u_true_NTCS.device)
    for s in range(0, u_true_NTCS.shape[0], batch_size):
        tap = KeepPrediction(sums)
        accumulate_task(tap, u_true_NTCS[s:s + batch_size, :t], encode=encode, step_fn=step_fn, decode=decode,
                        dt=dt, task_id=task_index,
                        coefficient_NCS=None if coefficient_NCS is None else coefficient_NCS[s:s + batch_size])
        if long is not None:
            long.add(tap.pred_BCTS[None], u_true_NTCS[s:s + batch_size, :t].transpose(1, 2))
    return sums.summary() | ({} if long is None else long.summary(lead_windows))


# ---------------------------------------------------------------------------------------- command


def _scored_rows(cfg: Config, i: int, small: bool, logger=None) -> tuple[np.ndarray, int]:
    """Task i's rows the evaluation scores (`evaluation.split`, capped), and the file's stored step count."""
    rows, steps = require_scored_rows(cfg, i, None if logger is None else logger.info)
    cap = cfg.evaluation.max_test_samples
    if small:
        cap = min(cap, SMALL_EVAL_SAMPLES) if cap else SMALL_EVAL_SAMPLES
    return (rows[:cap] if cap else rows), steps


def evaluate_config(cfg: Config, info: DistInfo, *, small: bool = False, logger=None) -> dict:
    """Evaluate every task and variant (collective: every rank calls it). Returns the eval.json tree
    on every rank (the speed record, `rollout_step_ms`, in rank 0's alone); rank 0 also writes it,
    the plots and the wandb logs.

    Per task the tree holds the error budget: ``codec`` (decode(encode(u)) of the scored frames,
    the floor under every latent model), ``references`` (persistence, or the training mean
    solution for steady tasks) and ``variants`` (our models), each with one-step and rollout nRMSE.
    """
    cfg = resolve_for(cfg, info.device)  # a config from load_config may still say auto (compile)
    run_dir = run_dir_for(cfg)
    weights = required_weights(cfg, run_dir)
    read = checked_data(cfg, run_dir, weights)  # the data fingerprints as the scoring starts
    rows_per_task = [_scored_rows(cfg, i, small, logger) for i in range(len(cfg.data.tasks))]
    models = load_models(cfg, weights, info)
    tree = {"config_hash": config_hash(cfg), "git_commit": commit_label(), "small": small,
            "split": cfg.evaluation.split, "world_size": info.world_size,
            "published": published_selection(run_dir, cfg.stages), "tasks": {}}
    plots: dict[str, dict[str, MetricSums]] = {}
    extents: dict[str, tuple[float, ...]] = {}
    for i in range(len(cfg.data.tasks)):
        rows, stored = rows_per_task[i]
        scored = score_task(cfg, i, rows, stored, models, info)
        key = task_label(cfg, i)
        channels = cfg.data.tasks[i].spec.channels
        codec_scores = per_field(scored.codec.summary(), channels)
        tree["tasks"][key] = {"n_test_samples": int(len(rows)), "given_steps": scored.given,
                              "time_stride": scored.stride, "channels": list(channels),
                              "codec": {"reconstruction_nrmse": codec_scores["nrmse"], **codec_scores},
                              "references": {name: per_field(sums.summary(), channels)
                                             for name, sums in scored.references.items()},
                              "variants": {name: per_field(sums.summary(), channels)
                                           | _long_summary(scored, name, cfg.evaluation.lead_windows)
                                           | _timed_and_fan(scored, name)
                                           for name, sums in scored.variants.items()}}
        plots[key] = scored.variants
        if scored.extent is not None:
            extents[key] = scored.extent
        if logger is not None:
            logger.info(f"evaluate: {key} done ({scored.on_this_rank} of {len(rows)} {cfg.evaluation.split} samples on "
                        f"this rank)")
    if info.is_main:
        require_same_data(cfg, read, "the evaluation started")  # or the scores mix two versions of it
        _write_evaluation(cfg, info, run_dir, tree, plots, extents, small)
    return tree


def _long_summary(scored: TaskScores, name: str, edges: tuple[int, ...]) -> dict:
    """The variant's lead-time, correlation, spectrum and ensemble scores ({} for steady tasks)."""
    return scored.long[name].summary(edges) if name in scored.long else {}


def _timed_and_fan(scored: TaskScores, name: str) -> dict:
    """``rollout_step_ms``, ``network_calls_per_step`` and ``ensemble_fan`` of the variant where this rank
    has them ({} otherwise)."""
    return ({"rollout_step_ms": scored.step_ms[name]} if name in scored.step_ms else {}) | (
        {"network_calls_per_step": scored.calls[name]} if name in scored.calls else {}) | (
        {"ensemble_fan": scored.fan[name]} if name in scored.fan else {})


def per_field(summary: dict, channels: tuple[str, ...]) -> dict:
    """`MetricSums.summary()` with its per-channel lists named: ``per_field[<channel>]`` holds that
    channel's nRMSE (PDEBench's) and VRMSE (The Well's) over the predicted steps."""
    out = {k: v for k, v in summary.items() if not k.endswith("_per_channel")}
    out["per_field"] = {name: {"nrmse": n, "vrmse": v} for name, n, v in
                        zip(channels, summary["nrmse_per_channel"], summary["vrmse_per_channel"], strict=True)}
    return out


@dataclass
class TaskScores:
    """One task's sums, all-reduced over ranks: the error budget's rows before `summary()`."""

    variants: dict[str, MetricSums]
    long: dict[str, RolloutSums]
    """Per variant of a time-dependent task: lead-time windows, correlation time, spectrum and
    ensemble scores (empty for steady tasks)."""
    references: dict[str, MetricSums]
    codec: MetricSums
    given: int
    stride: int
    on_this_rank: int
    extent: tuple[float, ...] | None
    """Physical extent of the plotted sample (rank 0), else None."""
    fan: dict[str, dict] = field(default_factory=dict)
    """Per variant of a time-dependent task, on rank 0: `ensemble_fan` of its first test sample."""
    step_ms: dict[str, float] = field(default_factory=dict)
    """Per variant of a time-dependent task, on rank 0 (eval.json's record; the others need none): ms of
    one latent rollout step per trajectory (`rollout_step_cost` on its first batch; none without any,
    or with `evaluation.time_rollout` false)."""
    calls: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per variant of a time-dependent task, on rank 0: each network's forward calls in one rollout
    step (`rollout_step_cost`, beside ``step_ms``)."""


def score_task(cfg: Config, i: int, rows: np.ndarray, stored: int, models: dict, info: DistInfo) -> TaskScores:
    """Score task ``i``'s test ``rows`` (this rank's contiguous share) with every variant, the trivial
    references and the codec alone; collective (every rank calls it, even with an empty share)."""
    task = cfg.data.tasks[i]
    ae = models["autoencoder"].for_task(i)  # the codec reads this task's fields
    steady = task.spec.steady
    g, stride, steps = scored_steps(cfg, i, stored)
    shard = np.array_split(rows, info.world_size)[info.rank]  # contiguous; may be empty
    models_i = variants(cfg, models, steady)
    refs = reference_models(cfg, i, steady, info.device)
    channels = len(task.spec.channels)
    new = lambda: MetricSums.zeros(channels, steps, g, steady, info.device)  # noqa: E731
    # K rollouts of a stochastic variant, one of the deterministic operator (its CRPS is its MAE).
    k_of = {} if steady else {name: cfg.evaluation.ensemble_members if name in STOCHASTIC else 1
                              for name in models_i}
    members = {k: variants(cfg, models, steady, member=k) for k in range(1, max(k_of.values(), default=1))}
    long = {name: RolloutSums.zeros(channels, steps, g, k, info.device) for name, k in k_of.items()}
    scores = TaskScores({name: new() for name in models_i}, long, {name: new() for name in refs}, new(), g,
                        stride, len(shard), None)
    with open_task(task_path(cfg, task), task.spec) as reader:
        for s in range(0, len(shard), EVAL_BATCH):
            data = read_trajectories(reader, shard[s:s + EVAL_BATCH], reduce_x=task.reduce_x, reduce_t=task.reduce_t)
            u = torch.from_numpy(data.u[:, ::stride][:, :steps]).to(info.device)
            coef = None if data.coefficient is None else torch.from_numpy(data.coefficient).to(info.device)
            dt = float(data.t[1] - data.t[0]) * stride if data.t is not None and len(data.t) > 1 else 0.0
            ids = torch.as_tensor(shard[s:s + EVAL_BATCH], dtype=torch.int64) + i * SAMPLE_ID_STRIDE
            keep = cfg.evaluation.plot_samples - s if info.is_main and cfg.logging.plots else 0  # kept for plots only
            for name, step_for in models_i.items():
                tap = KeepPrediction(scores.variants[name])
                accumulate_task(tap, u, encode=ae.encode, step_fn=step_for, decode=ae.decode,
                                dt=dt, task_id=i, coefficient_NCS=coef, keep=max(keep, 0), sample_id_N=ids)
                if name in long:  # member 0 is the rollout just scored; K = 1 samples nothing more
                    more = [rollout_member(u, g, encode=ae.encode, step_for=members[k][name], decode=ae.decode,
                                           dt=dt, task_id=i, sample_id_N=ids) for k in range(1, k_of[name])]
                    ensemble = torch.stack([tap.pred_BCTS, *more])
                    long[name].add(ensemble, u.transpose(1, 2))
                    if s == 0 and info.is_main:
                        scores.fan[name] = ensemble_fan(ensemble, u.transpose(1, 2), g)
            for name, predict in refs.items():
                accumulate_task(scores.references[name], u, encode=IdentityCodec.encode, step_fn=predict,
                                decode=IdentityCodec.decode, dt=dt, task_id=i, coefficient_NCS=coef)
            accumulate_reconstruction(scores.codec, u, encode=ae.encode, decode=ae.decode)
            if s == 0 and info.is_main:
                scores.extent = _extent(data, steps, stride)
            if s == 0 and not steady and info.is_main:
                z0 = ae.encode(u[:, g - 1])
                networks = {k: m for k, m in models.items() if k != "autoencoder"}
                for name, step_for in models_i.items():
                    seconds, scores.calls[name] = rollout_step_cost(step_for, networks, z0, dt=dt, task_id=i,
                                                                    sample_id_B=ids, timed=cfg.evaluation.time_rollout)
                    if seconds is not None:
                        scores.step_ms[name] = 1e3 * seconds
    # Same tasks, variants and shapes on every rank: the same collectives in the same order.
    for sums in [*scores.variants.values(), *scores.references.values(), scores.codec]:
        all_reduce_sums(sums, info)
    if info.distributed:
        for name in models_i:  # same order on every rank
            if name in long:
                long[name].all_reduce()
    return scores


def _write_evaluation(cfg: Config, info: DistInfo, run_dir: Path, tree: dict, plots: dict, extents: dict,
                      small: bool) -> None:
    """Rank 0: eval.json (`evaluation_file`: eval_val.json, eval_small.json), the table on stdout, the
    plots, the metrics and wandb logs."""
    suffix = evaluation_suffix(cfg, small)
    atomic_write_bytes(evaluation_file(run_dir, cfg, small), orjson.dumps(tree, option=orjson.OPT_INDENT_2))
    print(format_table(tree))
    pngs = write_plots(run_dir / "plots", plots, tree, extents=extents, suffix=suffix) if cfg.logging.plots else []
    sink = MetricsSink(run_dir, cfg, info, f"evaluate{suffix}")
    try:
        sink.log(0, _flat_scores(tree))
        if sink.wandb_run is not None:
            import wandb

            sink.wandb_run.log({f"{sink.stage}/plots/{p.stem}": wandb.Image(str(p)) for p in pngs})
    finally:
        sink.close(0)


def _extent(data, steps: int, stride: int) -> tuple[float, ...]:
    """Physical extent of a plotted sample: (x0, x1, t0, t1) for 1D, (y0, y1, x0, x1) for 2D and for
    3D (whose plot is the x-y plane through the middle of z)."""
    x = data.coords[0]
    if len(data.coords) >= 2:  # an image of one step, steady or not
        y = data.coords[1]
        return float(y[0]), float(y[-1]), float(x[0]), float(x[-1])
    t = data.t[::stride][:steps]
    return float(x[0]), float(x[-1]), float(t[0]), float(t[-1])


def _flat_scores(tree: dict) -> dict[str, float]:
    out = {}
    for task, t in tree["tasks"].items():
        out[f"{task}/codec/reconstruction_nrmse"] = t["codec"]["reconstruction_nrmse"]
        for group in ("references", "variants"):
            for variant, scores in t[group].items():
                out |= {f"{task}/{variant}/{k}": v for k, v in scores.items() if isinstance(v, float)}
                out |= {f"{task}/{variant}/{k}_{w}": v for w, per in scores.get("windows", {}).items()
                        for k, v in per.items() if isinstance(v, float)}
    return out


