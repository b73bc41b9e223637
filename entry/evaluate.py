"""`torchrun --nproc_per_node=N -m entry.evaluate --config CFG [--set k=v] [--small]`: final test scores.

Also runs as plain `python -m entry.evaluate`. Loads the exported weights of the run folder,
rolls every test trajectory out autoregressively in latent space from its last given frame,
decodes, and scores with PDEBench's metrics (core/metrics.py). Ranks take contiguous shards
of each task's test samples and add their per-sample metric sums with `all_reduce`; rank 0
writes `<run_dir>/eval.json` (`eval_small.json` with `--small`), the plots under
`<run_dir>/plots/`, a table on the terminal, and the numbers to wandb when it is enabled.

Legend: N samples, B batch, T time steps, C channels, S spatial axes, L tokens, D latent dim.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
import torch
from torch import Tensor
from torch.distributed.elastic.multiprocessing.errors import record

from entry.cli import exits_on_user_error, parse_config
from entry.config import ConfigError, config_hash
from entry.config_schema import Config, TaskConfig
from entry.distributed import DistInfo, close_distributed, init_distributed
from entry.models import FIELD_CHANNELS

SMALL_EVAL_SAMPLES = 4
"""Test samples per task in the pipeline's quick evaluation (`--small`)."""
EVAL_BATCH = 16
"""Trajectories rolled out together (bounds decode memory on long rollouts)."""
MEAN_KEYS = ("rmse", "nrmse", "brmse")
"""Per-sample values averaged over samples (PDEBench: mean over the batch)."""
RMS_KEYS = ("crmse", "frmse_low", "frmse_mid", "frmse_high")
"""Values PDEBench takes as RMS over samples: we add squares, so shards combine exactly."""
_ROWS = MEAN_KEYS + RMS_KEYS + ("one_step_nrmse",)

Encode = Callable[[Tensor], Tensor]
StepFn = Callable[[Tensor, Tensor, Tensor], Tensor]
Decode = Callable[[Tensor, tuple[int, ...]], Tensor]


@dataclass
class MetricSums:
    """Per-sample metric sums of one task and variant, mergeable over batches and ranks.

    ``sums_KCT`` rows follow ``_ROWS``; the one-step row's column t scores the prediction
    of frame t from true frame t - 1 (column 0 unused, except for steady tasks where the
    single prediction is its own one-step prediction).
    """

    given_steps: int
    steady: bool
    sums_KCT: Tensor
    max_CT: Tensor
    count: Tensor
    samples: list = field(default_factory=list)
    """(pred_TCS, true_TCS) numpy pairs kept for plots."""

    @classmethod
    def zeros(cls, channels: int, steps: int, given_steps: int, steady: bool, device) -> MetricSums:
        z = dict(dtype=torch.float64, device=device)
        return cls(given_steps, steady, torch.zeros(len(_ROWS), channels, steps, **z),
                   torch.zeros(channels, steps, **z), torch.zeros((), **z))

    def add(self, pred_BCTS: Tensor, true_BCTS: Tensor, one_step_BCTS: Tensor | None) -> None:
        """Add a batch: ``pred``/``true`` over the whole window, ``one_step`` predicts frames 1..T-1."""
        from core.metrics import nrmse_per_step, pdebench_metrics

        b = true_BCTS.shape[0]
        m = pdebench_metrics(pred_BCTS, true_BCTS, given_steps=self.given_steps)
        rows = [m[k] * b for k in MEAN_KEYS] + [m[k].square() * b for k in RMS_KEYS]
        one = torch.zeros_like(m["nrmse"])
        if self.steady:
            one = m["nrmse"]
        elif one_step_BCTS is not None:
            one[:, 1:] = nrmse_per_step(one_step_BCTS, true_BCTS[:, :, 1:])
        rows.append(one * b)
        self.sums_KCT += torch.stack(rows).to(self.sums_KCT)
        self.max_CT.copy_(torch.maximum(self.max_CT, m["max_error"].to(self.max_CT)))
        self.count += b

    def all_reduce(self, info: DistInfo) -> None:
        """Combine the ranks' sums: exactly two collectives, whatever this rank's shard size."""
        if not info.distributed:
            return
        import torch.distributed as dist

        packed = torch.cat([self.sums_KCT.flatten(), self.count.reshape(1)])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        self.sums_KCT.copy_(packed[:-1].view_as(self.sums_KCT))
        self.count.copy_(packed[-1])
        dist.all_reduce(self.max_CT, op=dist.ReduceOp.MAX)  # errors are >= 0: an empty shard's zeros are neutral

    def summary(self) -> dict:
        """Scores over channels and predicted steps ``t >= given_steps`` (see core/metrics.py)."""
        n = self.count.item()
        if n == 0:
            raise ValueError("no samples were scored")
        k = {name: i for i, name in enumerate(_ROWS)}
        per_step = {name: self.sums_KCT[k[name]] / n for name in MEAN_KEYS}
        per_step |= {name: (self.sums_KCT[k[name]] / n).sqrt() for name in RMS_KEYS}
        per_step["max_error"] = self.max_CT
        g = self.given_steps
        out = {name: v[:, g:].mean().item() for name, v in per_step.items()}
        out["nrmse_pdebench2022"] = per_step["nrmse"].mean().item()
        one = self.sums_KCT[k["one_step_nrmse"]] / n
        out["one_step_nrmse"] = (one[:, 0] if self.steady else one[:, 1:]).mean().item()
        out["nrmse_per_step"] = per_step["nrmse"][:, g:].mean(0).tolist()
        out["n_samples"] = int(n)
        return out


def window(num_steps: int, given_steps: int, rollout_steps: int, *, where: str = "data.tasks[i]") -> int:
    """Frames scored: the given ones plus ``rollout_steps`` predictions (0: to the end of the file)."""
    if not 1 <= given_steps < num_steps:
        raise ConfigError(f"initial_step={given_steps} leaves no step to predict in a trajectory of "
                          f"{num_steps} stored steps (after reduce_t); lower {where}.initial_step")
    return num_steps if rollout_steps == 0 else min(num_steps, given_steps + rollout_steps)


@torch.no_grad()
def accumulate_task(sums: MetricSums, u_true_NTCS: Tensor, *, encode: Encode, step_fn: StepFn, decode: Decode,
                    dt: float, task_id: int, coefficient_NCS: Tensor | None = None, keep: int = 0) -> None:
    """Score one batch of test trajectories into ``sums`` (steady tasks: from ``coefficient_NCS``).

    Dynamic: encode frame ``given_steps - 1`` (the model is Markov: one input frame), take
    ``T - given_steps`` steps of ``step_fn``, decode; the given frames are copied from the
    truth. One-step: every true frame t -> ``decode(step_fn(encode(u_t)))`` against t + 1.
    Steady: ``decode(step_fn(encode(coefficient)))`` against the solution (T = 1).
    ``keep`` first samples are stored in ``sums.samples`` for plots.
    """
    from core.rollout import decode_trajectory, rollout

    n, t = u_true_NTCS.shape[:2]
    grid = tuple(u_true_NTCS.shape[3:])
    dt_B = torch.full((n,), dt, dtype=torch.float32, device=u_true_NTCS.device)
    id_B = torch.full((n,), task_id, dtype=torch.int64, device=u_true_NTCS.device)
    if sums.steady:
        pred_NTCS = decode(step_fn(encode(coefficient_NCS), dt_B * 0, id_B), grid)[:, None]
        one_NTCS = None
    else:
        g = sums.given_steps
        z_BTLD = rollout(step_fn, encode(u_true_NTCS[:, g - 1]), dt_B, id_B, t - g)
        # Index 0 of the rollout is the encoded frame g - 1: the truth stands there (a given step).
        pred_NTCS = torch.cat([u_true_NTCS[:, :g], decode_trajectory(decode, z_BTLD[:, 1:], grid)], dim=1)
        frames = u_true_NTCS[:, :-1].flatten(0, 1)
        z_next = step_fn(encode(frames), dt_B.repeat_interleave(t - 1), id_B.repeat_interleave(t - 1))
        one_NTCS = decode(z_next, grid).reshape(n, t - 1, *u_true_NTCS.shape[2:])
    sums.add(pred_NTCS.transpose(1, 2), u_true_NTCS.transpose(1, 2),
             None if one_NTCS is None else one_NTCS.transpose(1, 2))
    for i in range(min(keep, n)):
        sums.samples.append((pred_NTCS[i].float().cpu().numpy(), u_true_NTCS[i].float().cpu().numpy()))


def evaluate_task(task_cfg: TaskConfig, task_index: int, u_true_NTCS: Tensor, *, given_steps: int, dt: float,
                  encode: Encode | None = None, step_fn: StepFn | None = None, decode: Decode | None = None,
                  predict_fields: StepFn | None = None, coefficient_NCS: Tensor | None = None,
                  rollout_steps: int = 0, batch_size: int = EVAL_BATCH) -> dict:
    """Scores of one task and one model on one process (the command adds ranks around this).

    Pass the latent model (``encode(u_BCS) -> z``, ``step_fn(z_BLD, dt_B, task_id_B) -> z_next``,
    ``decode(z_BLD, grid_shape) -> u_BCS``), or ``predict_fields(u_BCS, dt_B, task_id_B) -> u_next``
    stepping in field space (oracles and baselines in tests). Returns ``MetricSums.summary()``.
    """
    from pipelines.tasks import get_task

    if predict_fields is not None:
        encode, step_fn, decode = (lambda u: u), predict_fields, (lambda z, grid: z)
    if encode is None or step_fn is None or decode is None:
        raise ValueError("pass encode, step_fn and decode, or predict_fields")
    steady = get_task(task_cfg.name).steady
    t = 1 if steady else window(u_true_NTCS.shape[1], given_steps, rollout_steps)
    sums = MetricSums.zeros(u_true_NTCS.shape[2], t, 0 if steady else given_steps, steady, u_true_NTCS.device)
    for s in range(0, u_true_NTCS.shape[0], batch_size):
        accumulate_task(sums, u_true_NTCS[s:s + batch_size, :t], encode=encode, step_fn=step_fn, decode=decode,
                        dt=dt, task_id=task_index,
                        coefficient_NCS=None if coefficient_NCS is None else coefficient_NCS[s:s + batch_size])
    return sums.summary()


# ---------------------------------------------------------------------------------------- command


def task_key(cfg: Config, i: int) -> str:
    """The task's name in eval.json and plot files (with its parameter when two tasks share a name)."""
    task = cfg.data.tasks[i]
    same = sum(t.name == task.name for t in cfg.data.tasks)
    return task.name if same == 1 else f"{task.name}_param{task.param:g}"


def _test_rows(cfg: Config, i: int, small: bool) -> tuple[np.ndarray, int]:
    """All test rows of task i (capped), and the file's stored step count."""
    from pipelines.pdebench_io import open_pdebench
    from pipelines.split import split_indices

    from entry.data import task_path

    task = cfg.data.tasks[i]
    with open_pdebench(task_path(cfg, task), task=task.name) as f:
        n, steps = f.layout.n_samples, f.layout.n_steps
    rows = split_indices(n, test_fraction=cfg.data.split.test_fraction, val_fraction=cfg.data.split.val_fraction,
                         seed=cfg.data.split.seed).test
    if rows.size == 0:
        need = math.ceil(1 / cfg.data.split.test_fraction) if cfg.data.split.test_fraction > 0 else "more"
        raise ConfigError(f"data.tasks[{i}] ({task.name}): {task_path(cfg, task)} has {n} samples, so its test "
                          f"split (the first {cfg.data.split.test_fraction:g} of the file) is empty; generate "
                          f"at least {need} samples (data.tasks[{i}].samples) or raise data.split.test_fraction")
    cap = cfg.evaluation.max_test_samples
    if small:
        cap = min(cap, SMALL_EVAL_SAMPLES) if cap else SMALL_EVAL_SAMPLES
    return (rows[:cap] if cap else rows), steps


def _required_weights(cfg: Config, run_dir: Path) -> dict[str, Path]:
    """Stage -> weight file this evaluation loads; a required one that is missing is a ConfigError."""
    from pipelines.tasks import get_task

    from entry.runner import weights_file

    steady = [get_task(t.name).steady for t in cfg.data.tasks]
    need = ["autoencoder"] + (["operator"] if not all(steady) else []) + (["steady"] if any(steady) else [])
    optional = ["diffusion", "consistency"] if not all(steady) else []
    for stage in need:
        if not weights_file(run_dir, stage).is_file():
            raise ConfigError(f"missing weight file {weights_file(run_dir, stage)}: train that stage first with "
                              f"`python -m entry.{stage} --config CFG` (or run entry.pipeline)")
    return {s: weights_file(run_dir, s) for s in need + optional if weights_file(run_dir, s).is_file()}


def _variants(cfg: Config, models: dict, info: DistInfo, steady: bool, task_index: int) -> dict[str, StepFn]:
    """Latent step functions to evaluate for one task; refiners draw from a seeded per-rank generator."""
    from core.rollout import consistency_refiner, diffusion_refiner
    from core.steps.steady import SteadyStepConfig, steady_sample

    def gen() -> torch.Generator:
        return torch.Generator(info.device).manual_seed(cfg.training.seed + 1000 * info.rank + task_index)

    if steady:
        sc = SteadyStepConfig(num_levels=cfg.steady.noise_levels)
        g = gen()
        return {"steady": lambda z, dt, tid: steady_sample(models["steady"], z, tid, num_levels=sc.num_levels,
                                                           sigma_min=sc.sigma_min, generator=g)}
    op = models["operator"]
    out: dict[str, StepFn] = {"operator": op}
    refiners = {}
    if "diffusion" in models:
        refiners["operator+diffusion"] = diffusion_refiner(models["diffusion"], num_levels=cfg.diffusion.noise_levels,
                                                           sigma_min=cfg.diffusion.sigma_min, generator=gen())
    if "consistency" in models:
        refiners["operator+consistency"] = consistency_refiner(models["consistency"], generator=gen(),
                                                               steps=cfg.consistency.sample_steps,
                                                               sigma_min=cfg.diffusion.sigma_min)
    for name, refine in refiners.items():
        out[name] = lambda z, dt, tid, refine=refine: refine(op(z, dt, tid), dt, tid)
    return out


def _load_models(cfg: Config, weights: dict[str, Path], info: DistInfo) -> dict:
    from entry.models import build_autoencoder, build_denoiser, build_operator
    from entry.stage_build import load_frozen

    makers = {"autoencoder": lambda: build_autoencoder(cfg), "operator": lambda: build_operator(cfg),
              "diffusion": lambda: build_denoiser(cfg, cfg.diffusion.pdet),
              "consistency": lambda: build_denoiser(cfg, cfg.diffusion.pdet),
              "steady": lambda: build_denoiser(cfg, cfg.steady.pdet)}
    return {stage: load_frozen(makers[stage], path, info) for stage, path in weights.items()}


def evaluate_config(cfg: Config, info: DistInfo, *, small: bool = False, logger=None) -> dict:
    """Evaluate every task and variant (collective: every rank calls it). Returns the eval.json tree
    on every rank; rank 0 also writes it, the plots and the wandb logs."""
    from pipelines.pdebench_io import open_pdebench
    from pipelines.tasks import get_task

    from entry.data import task_path
    from entry.run_files import MetricsSink, git_commit, run_dir_for

    run_dir = run_dir_for(cfg)
    for i, task in enumerate(cfg.data.tasks):
        if not task_path(cfg, task).is_file():
            raise ConfigError(f"data.tasks[{i}].path: test data {task_path(cfg, task)} does not exist")
    weights = _required_weights(cfg, run_dir)
    rows_per_task = [_test_rows(cfg, i, small) for i in range(len(cfg.data.tasks))]
    models = _load_models(cfg, weights, info)
    ae = models["autoencoder"]
    tree = {"config_hash": config_hash(cfg), "git_commit": git_commit(), "small": small,
            "world_size": info.world_size, "tasks": {}}
    plots: dict[str, dict[str, MetricSums]] = {}
    for i, task in enumerate(cfg.data.tasks):
        rows, stored = rows_per_task[i]
        steady = get_task(task.name).steady
        g, stride = (0, 1) if steady else _given_and_stride(task, cfg)
        shard = np.array_split(rows, info.world_size)[info.rank]  # contiguous; may be empty
        with open_pdebench(task_path(cfg, task), task=task.name) as f:
            variants = _variants(cfg, models, info, steady, i)
            steps = 1 if steady else window(len(range(0, stored, task.reduce_t * stride)), g,
                                            cfg.evaluation.rollout_steps, where=f"data.tasks[{i}]")
            results = {name: MetricSums.zeros(FIELD_CHANNELS, steps, g, steady, info.device) for name in variants}
            for s in range(0, len(shard), EVAL_BATCH):
                data = f.read(shard[s:s + EVAL_BATCH], reduce_x=task.reduce_x, reduce_t=task.reduce_t)
                u = torch.from_numpy(data.u[:, ::stride][:, :steps]).to(info.device)
                coef = None if data.coefficient is None else torch.from_numpy(data.coefficient).to(info.device)
                dt = float(data.t[1] - data.t[0]) * stride if data.t is not None and len(data.t) > 1 else 0.0
                keep = cfg.evaluation.plot_samples - s if info.is_main else 0
                for name, step_fn in variants.items():
                    accumulate_task(results[name], u, encode=ae.encode, step_fn=step_fn, decode=ae.decode, dt=dt,
                                    task_id=i, coefficient_NCS=coef, keep=max(keep, 0))
        for sums in results.values():  # same tasks, variants and shapes on every rank: same collectives
            sums.all_reduce(info)
        key = task_key(cfg, i)
        tree["tasks"][key] = {"n_test_samples": int(len(rows)), "given_steps": g, "time_stride": stride,
                              "variants": {name: sums.summary() for name, sums in results.items()}}
        plots[key] = results
        if logger is not None:
            logger.info(f"evaluate: {key} done ({len(shard)} of {len(rows)} test samples on this rank)")
    if info.is_main:
        name = "eval_small.json" if small else "eval.json"
        (run_dir / name).write_bytes(orjson.dumps(tree, option=orjson.OPT_INDENT_2))
        print(format_table(tree))
        from entry.eval_plots import write_plots

        pngs = write_plots(run_dir / "plots", plots, tree, suffix="_small" if small else "")
        sink = MetricsSink(run_dir, cfg, info, "evaluate_small" if small else "evaluate")
        try:
            sink.log(0, _flat_scores(tree))
            if sink.wandb_run is not None:
                import wandb

                sink.wandb_run.log({f"{sink.stage}/plots/{p.stem}": wandb.Image(str(p)) for p in pngs})
        finally:
            sink.close(0)
    return tree


def evaluate_run(cfg: Config, info: DistInfo, logger, *, small: bool = False) -> dict:
    """What entry.pipeline calls after the stages (process group already up): `evaluate_config`."""
    return evaluate_config(cfg, info, small=small, logger=logger)


def _given_and_stride(task: TaskConfig, cfg: Config) -> tuple[int, int]:
    """Given steps and time stride in the operator's own steps (horizon h: every h-th stored frame,
    keeping frame initial_step - 1 as the rollout's start)."""
    h = cfg.operator.horizon
    if h == 1:
        return task.initial_step, 1
    if (task.initial_step - 1) % h:
        raise ConfigError(f"operator.horizon={h} needs initial_step - 1 divisible by it to start the rollout "
                          f"on a stored frame; got initial_step={task.initial_step}")
    return (task.initial_step - 1) // h + 1, h


def _flat_scores(tree: dict) -> dict[str, float]:
    return {f"{task}/{variant}/{k}": v for task, t in tree["tasks"].items()
            for variant, scores in t["variants"].items() for k, v in scores.items() if isinstance(v, float)}


def format_table(tree: dict) -> str:
    """The terminal table: one line per task and variant."""
    cols = ("nrmse", "nrmse_pdebench2022", "one_step_nrmse", "rmse", "max_error", "frmse_high")
    lines = [f"{'task':<16} {'variant':<22} {'n':>5} " + " ".join(f"{c:>18}" for c in cols)]
    for task, t in tree["tasks"].items():
        for variant, s in t["variants"].items():
            lines.append(f"{task:<16} {variant:<22} {t['n_test_samples']:>5} "
                         + " ".join(f"{s[c]:>18.5g}" for c in cols))
    return "\n".join(lines)


def _small_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--small", action="store_true",
                        help=f"at most {SMALL_EVAL_SAMPLES} test samples per task; writes eval_small.json")


def run(argv: list[str] | None = None) -> int:
    cfg, args = parse_config(argv, __doc__, _small_arg)
    from entry.run_files import run_dir_for, setup_logging

    _required_weights(cfg, run_dir_for(cfg))  # user errors before any file is written or any rendezvous
    info = init_distributed(backend=cfg.training.backend, timeout_s=cfg.training.timeout_s, debug=cfg.training.debug)
    try:
        logger = setup_logging(run_dir_for(cfg), info, "evaluate")
        evaluate_config(cfg, info, small=args.small, logger=logger)
        return 0
    finally:
        close_distributed()


@record
@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
