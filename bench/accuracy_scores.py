"""What bench.accuracy scores, and how: each task's fields (train, validation, test), the scores of
a latent model and of the FNO on the test fields, inference time per rollout, the error budget
(codec reconstruction, a trivial reference) and time to a target validation nRMSE.
The comparison itself (what trains, on what budget) is bench/accuracy.py; its tables and plots
bench/accuracy_report.py."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import torch
from torch import Tensor

from bench.epoch_time import sync_device
from bench.fno_baseline import fno_one_step, fno_rollout
from core.evaluation import MetricSums, accumulate_reconstruction, accumulate_task
from core.rollout import decode_trajectory, rollout
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.files import task_path, task_split
from entry.evaluation.references import IdentityCodec, mean_solution_step, persistence_step
from entry.evaluation.task_frames import task_label
from entry.evaluation.variants import load_models, required_weights, variant_name, variants
from entry.stages.record import STAGES, upstream
from entry.storage.run_folder import run_dir_for
from pipelines.fields import SAMPLE_ID_STRIDE
from pipelines.task_data import open_task, read_trajectories

REFERENCE = Path(__file__).parent / "reference" / "pdebench.json"
PUBLISHED_SOURCE = "arXiv:2210.07182"
"""The published FNO values the targets use: the arXiv tables (the supplement's are recorded too)."""
VARIANT_STAGES = {variant_name(spec): tuple(s.name for s in STAGES if s.name in upstream([spec.name]) | {spec.name})
                  for spec in STAGES if spec.predict is not None}
"""Stages whose wall time a variant's training time counts (the consistency student needs the teacher)."""
TIMED_REPEATS = 3


@dataclass
class TaskFields:
    """One task's fields for the baseline and the scores: ``[N, T, C, *S]`` float32 on the CPU.

    Steady tasks are stored as two frames (coefficient, solution) with one given frame, so the
    FNO maps frame 0 to frame 1 exactly as it steps a time-dependent task.
    """

    key: str
    index: int
    steady: bool
    given: int
    dt: float
    train: Tensor
    val: Tensor
    test: Tensor


def read_rows(cfg: Config, i: int, rows: np.ndarray, steady: bool) -> tuple[Tensor, float]:
    task = cfg.data.tasks[i]
    with open_task(task_path(cfg, task), task.spec) as reader:
        d = read_trajectories(reader, rows, reduce_x=task.reduce_x, reduce_t=task.reduce_t)
    u = torch.from_numpy(d.u)
    if steady:
        return torch.stack([torch.from_numpy(d.coefficient), u[:, 0]], dim=1), 0.0
    dt = float(d.t[1] - d.t[0]) if d.t is not None and len(d.t) > 1 else 0.0
    return u, dt


def load_task_fields(cfg: Config, i: int) -> TaskFields:
    """Train, validation (the first `evaluation.val_samples`) and test fields of task ``i``."""
    task = cfg.data.tasks[i]
    steady = task.spec.steady
    parts = {}
    dt = 0.0
    for split in ("train", "val", "test"):
        rows, _ = task_split(cfg, i, split)
        if split == "val":
            rows = rows[:cfg.evaluation.val_samples]  # the rows validation during training scores
        if split == "test" and cfg.evaluation.max_test_samples:
            rows = rows[:cfg.evaluation.max_test_samples]
        if rows.size == 0:
            raise ConfigError(f"data.tasks[{i}] ({task.name}): the {split} split is empty; raise "
                              f"data.tasks[{i}].samples (or data.split.*_fraction)")
        parts[split], dt = read_rows(cfg, i, rows, steady)
    return TaskFields(task_label(cfg, i), i, steady, 1 if steady else task.initial_step, dt, **parts)


# ------------------------------------------------------------------------------------ reference


def reference_values(task: str, param: float) -> dict:
    """PDEBench FNO values for one task: ``published`` (arXiv table, given steps scored) and
    ``stretch`` (re-trained, predicted steps only), each ``{nrmse, convention, source, verified}``
    or absent."""
    entries = orjson.loads(REFERENCE.read_bytes())["entries"]
    out = {}
    for e in entries:
        if e["model"] != "FNO" or e["task"] != task or not math.isclose(e["param"], param):
            continue
        slot = None
        if e["convention"] == "pdebench2022" and PUBLISHED_SOURCE in e["source"]:
            slot = "published"
        elif e["convention"] == "predicted_steps_only":
            slot = "stretch"
        if slot is not None:
            out[slot] = {k: e[k] for k in ("nrmse", "convention", "source", "verified")}
    return out


def time_to_reach(curve: list[tuple[float, float]], target: float | None) -> float | None:
    """First wall time of ``curve`` [(seconds, nRMSE)] at which nRMSE <= ``target`` (None: never)."""
    if target is None:
        return None
    for seconds, value in curve:
        if value <= target:
            return seconds
    return None


# ------------------------------------------------------------------------------------------ ours


def latent_models(cfg: Config, info):
    """(autoencoder, variant name -> latent step function) of the trained run, for every task kind."""
    models = load_models(cfg, required_weights(cfg, run_dir_for(cfg)), info)
    return models["autoencoder"], lambda steady, i: variants(cfg, models, steady)


def score_latent(fields: TaskFields, u_NTCS: Tensor, ae, step_fn, device: torch.device, keep: int = 0):
    """MetricSums of a latent model on ``u`` (steady: frame 0 is the coefficient)."""
    t = 1 if fields.steady else u_NTCS.shape[1]
    sums = MetricSums.zeros(u_NTCS.shape[2], t, 0 if fields.steady else fields.given, fields.steady, device)
    for s in range(0, u_NTCS.shape[0], 16):
        u = u_NTCS[s:s + 16].to(device)
        kw = dict(coefficient_NCS=u[:, 0], keep=max(keep - s, 0)) if fields.steady else dict(keep=max(keep - s, 0))
        ids = torch.arange(s, s + u.shape[0]) + fields.index * SAMPLE_ID_STRIDE  # noise per sample
        accumulate_task(sums, u[:, 1:] if fields.steady else u, encode=ae.encode, step_fn=step_fn,
                        decode=ae.decode, dt=fields.dt, task_id=fields.index, sample_id_N=ids, **kw)
    return sums


def time_latent_rollout(fields: TaskFields, u_BTCS: Tensor, ae, step_fn, device: torch.device) -> float:
    """Seconds per trajectory of encode -> rollout -> decode, batch of ``u``'s size, after a warm-up."""
    u = u_BTCS.to(device)
    b = u.shape[0]
    dt = torch.full((b,), fields.dt, device=device)
    tid = torch.full((b,), fields.index, dtype=torch.int64, device=device)
    grid = tuple(u.shape[3:])
    step = step_fn(torch.arange(b), torch.full((b,), -1))

    @torch.no_grad()
    def once():
        if fields.steady:
            return ae.decode(step(ae.encode(u[:, 0]), dt * 0, tid), grid)
        z = rollout(step, ae.encode(u[:, fields.given - 1]), dt, tid, u.shape[1] - fields.given)
        return decode_trajectory(ae.decode, z[:, 1:], grid)

    return time_per_item(once, b, device)


def time_per_item(fn, items: int, device: torch.device) -> float:
    fn()  # warm-up (lazy init, autotuning)
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(TIMED_REPEATS):
        fn()
    sync_device(device)
    return (time.perf_counter() - t0) / (TIMED_REPEATS * items)


# ------------------------------------------------------------------------------------------- FNO


def score_fno(model, fields: TaskFields, u_NTCS: Tensor, device: torch.device, keep: int = 0):
    """MetricSums of the FNO on ``u``: free rollout from the given frames, and one-step windows."""
    g = fields.given
    t = u_NTCS.shape[1] - g if fields.steady else u_NTCS.shape[1]
    sums = MetricSums.zeros(u_NTCS.shape[2], t, 0 if fields.steady else g, fields.steady, device)
    model.eval()
    with torch.no_grad():
        for s in range(0, u_NTCS.shape[0], 16):
            u = u_NTCS[s:s + 16].to(device)
            pred = fno_rollout(model, u, g)
            if fields.steady:  # score the solution frame only, as ours
                pred, u, one = pred[:, g:], u[:, g:], None
            else:
                one = fno_one_step(model, u, g)[:, 1:]
            sums.add(pred.transpose(1, 2), u.transpose(1, 2), None if one is None else one.transpose(1, 2))
            for j in range(min(max(keep - s, 0), u.shape[0])):
                sums.samples.append((pred[j].float().cpu(), u[j].float().cpu()))
    return sums


def time_fno_rollout(model, fields: TaskFields, u_BTCS: Tensor, device: torch.device) -> float:
    u = u_BTCS.to(device)
    with torch.no_grad():
        return time_per_item(lambda: fno_rollout(model, u, fields.given), u.shape[0], device)


# --------------------------------------------------------------------------------------- summary


def model_summary(sums, train_s: float | None, curve: list, target: float | None, infer_s: float) -> dict:
    return {"test": sums.summary(), "train_wall_s": train_s, "val_curve": curve,
            "val_nrmse_final": curve[-1][1] if curve else None,
            "time_to_published_s": time_to_reach(curve, target), "inference_s_per_rollout": infer_s}


def error_budget(f: TaskFields, ae, device: torch.device) -> dict:
    """What limits a latent model on the test frames: the codec's reconstruction nRMSE
    (decode(encode(u)) of the scored frames) and the trivial reference, scored as entry.evaluation.scoring
    scores it: persistence (the last given frame repeated) for time-dependent tasks, the
    training-mean solution (of the training fields already in memory) for steady ones."""
    u = f.test[:, 1:] if f.steady else f.test
    codec = MetricSums.zeros(u.shape[2], u.shape[1], 0 if f.steady else f.given, f.steady, device)
    for s in range(0, u.shape[0], 16):
        accumulate_reconstruction(codec, u[s:s + 16].to(device), encode=ae.encode, decode=ae.decode)
    if f.steady:
        name, predict = "mean_solution", mean_solution_step(f.train[:, 1].mean(0).to(device))
    else:
        name, predict = "persistence", persistence_step
    ref = score_latent(f, f.test, IdentityCodec, lambda ids, t: predict, device)
    return {"codec_reconstruction_nrmse": codec.summary()["nrmse"], "references": {name: ref.summary()}}


def score_ours(f: TaskFields, ae, variants: dict, stage_s: dict, curves: dict,
               target: float | None, device: torch.device) -> tuple[dict, str, dict]:
    """Score every variant of ours on task ``f``: -> (model name -> summary, the reported model
    (lowest validation nRMSE), model name -> (prediction, truth) of test sample 0)."""
    models, val_scores, samples = {}, {}, {}
    for name, step_fn in variants.items():
        train_s = sum(stage_s.get(s, 0.0) for s in VARIANT_STAGES[name])
        val = score_latent(f, f.val, ae, step_fn, device).summary()["nrmse"]
        val_scores[name] = val
        curve = list(curves.get(f.key, {}).get(name, []))
        if not curve or curve[-1][0] < train_s:  # the finished model, validated here
            curve.append((train_s, val))
        test = score_latent(f, f.test, ae, step_fn, device, keep=1)
        infer = time_latent_rollout(f, f.test[:16], ae, step_fn, device)
        models[f"ours/{name}"] = model_summary(test, train_s, curve, target, infer) | {"val_nrmse_selected": val}
        samples[f"ours/{name}"] = test.samples[0]
    return models, f"ours/{min(val_scores, key=val_scores.get)}", samples
