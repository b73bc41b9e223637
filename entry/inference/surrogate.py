"""A finished run as a surrogate: `load_run(run_dir)` rebuilds its models from the run folder alone
and `Surrogate.rollout` rolls them out from given frames in physical units.

The rollout is the evaluation's own (`entry.evaluation.long_rollout.rollout_fields` over the step
functions of `entry.evaluation.variants.variants`), so on the same device, variant, seed and sample
ids it returns the evaluation's predictions bit for bit.

Legend: K ensemble members, B batch, T time steps (T0 given), C channels, S spatial axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from core.evaluation import predict_steady
from entry.config.errors import ConfigError, InputError
from entry.config.load import load_config
from entry.config.schema import Config, TaskConfig
from entry.distributed.process_group import DistInfo
from entry.evaluation.long_rollout import rollout_fields
from entry.evaluation.task_frames import given_and_stride, task_label
from entry.evaluation.variants import load_models, required_weights, variants
from entry.storage.atomic import read_json
from pipelines.fields import SAMPLE_ID_STRIDE
from pipelines.layouts import describe

Frames = Tensor | np.ndarray | Mapping[str, Tensor | np.ndarray]
"""Fields as `Surrogate.rollout` takes and returns them: one array [B, T, C, *S], or one array
[B, T, *S] per channel name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskInfo:
    """What a run knows of one of its tasks."""

    index: int
    """The task's place in the run's config (the operator's task id)."""
    name: str
    """Its name in eval.json (with its parameter when two tasks share a name)."""
    channels: tuple[str, ...]
    """The field's channel names, in the order of the C axis."""
    grid: tuple[int, ...]
    """The points per spatial axis the run was trained on (the file's, after ``reduce_x``)."""
    steady: bool
    """A steady task: `Surrogate.solve` maps its coefficient to its solution."""
    given_steps: int
    """Frames the evaluation gives before its first prediction (the rollout starts from the last)."""
    time_step: float
    """The time between two frames the operator steps (the training data's step times ``reduce_t``
    times ``operator.horizon``; 0 for a steady task)."""
    frame_stride: int
    """Stored frames per operator step (``reduce_t * operator.horizon``)."""
    variants: tuple[str, ...]
    """What `Surrogate.rollout` can roll out for it: operator, operator+diffusion, operator+consistency
    (steady: steady)."""


def _time_step(cfg: Config, task: TaskConfig, stride: int) -> float:
    """The time step of one operator step, as the evaluation reads it from the data file: a generated
    file stores ``t_end / (nt - 1)`` apart (pipelines.generate), a declared one its own times."""
    spec = task.spec
    if spec.steady:
        return 0.0
    if task.layout:
        (desc,) = describe(task.path, task.layout, options=task.hdf5.options() if task.hdf5 else None)
        t = desc.times[::task.reduce_t] if desc.times is not None else np.arange(2.0)
        return float(t[1] - t[0]) * stride
    return task.reduce_t * (spec.t_end / (task.nt - 1)) * stride


def _task_info(cfg: Config, i: int, names: tuple[str, ...]) -> TaskInfo:
    task = cfg.data.tasks[i]
    steady = task.spec.steady
    given, stride = (0, 1) if steady else given_and_stride(task, cfg)
    return TaskInfo(index=i, name=task_label(cfg, i), channels=tuple(task.spec.channels), grid=task.training_grid,
                    steady=steady, given_steps=given, time_step=_time_step(cfg, task, stride),
                    frame_stride=task.reduce_t * stride, variants=names)


def read_run_config(run_dir: str | Path) -> Config:
    """The config a run folder recorded (`config.json`); a `ConfigError` naming the folder when it
    holds none (not a run folder, or no stage of it ran)."""
    path = Path(run_dir) / "config.json"
    found = read_json(path)
    if found is None or "config" not in found:
        raise ConfigError(f"{run_dir} is not a trained run folder: {path} is missing or unreadable; "
                          f"train it first (python -m entry.pipeline --config CFG)")
    return load_config(tree=found["config"])


def usable_device(name: str | torch.device) -> torch.device:
    """The torch device `name` ("cpu", "cuda", "cuda:1", ...) when this machine has it; an
    `InputError` of one line otherwise (torch's own is a traceback from deep inside the first copy)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise InputError(f"device {name!r} is not a torch device; give cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {name}: this machine has no CUDA device torch can use; give cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise InputError(f"device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"device {name}: runs load on cpu or cuda, not {device.type}")
    return device


def load_run(run_dir: str | Path, *, device: str | torch.device = "cpu", compile: bool = False) -> Surrogate:
    """Load a finished run from its folder alone (no config file, no data file but a declared task's).

    Takes the run folder (``runs/<run>``: its ``config.json``, each stage's ``<stage>.pt`` and the
    ``<stage>.model.json`` beside it), the device ("cpu", "cuda", ...) and whether to compile the
    networks' blocks. Returns a `Surrogate`. Raises `ConfigError` for a folder without a config and
    `ConfigError`/`CheckpointError` (naming the file) for missing or unusable weights.
    """
    device = usable_device(device)
    cfg = read_run_config(run_dir)
    weights = required_weights(cfg, Path(run_dir))
    # The evaluation's loader (descriptions beside the weights, frozen, eval mode), compiled on request.
    made = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, compile=compile))
    models = load_models(made, weights, DistInfo(0, 1, 0, device, None, 0))
    tasks = tuple(_task_info(cfg, i, tuple(variants(cfg, models, t.spec.steady)))
                  for i, t in enumerate(cfg.data.tasks))
    return Surrogate(cfg, Path(run_dir), device, models, tasks)


class Surrogate:
    """A trained run's models, ready to roll out (`load_run` makes one)."""

    def __init__(self, config: Config, run_dir: Path, device: torch.device, models: dict,
                 tasks: tuple[TaskInfo, ...]) -> None:
        self.config, self.run_dir, self.device, self.models, self.tasks = config, run_dir, device, models, tasks

    def task(self, name: str | int | None = None) -> TaskInfo:
        """The task named `name` (its eval.json name, or its index: an int or its digits); None: the
        run's only task."""
        if name is None:
            if len(self.tasks) != 1:
                names = ", ".join(t.name for t in self.tasks)
                raise InputError(f"{self.run_dir} has {len(self.tasks)} tasks ({names}); name one (--task NAME; "
                                 f"in Python task=NAME)")
            return self.tasks[0]
        for t in self.tasks:
            if name in (t.name, t.index, str(t.index)):  # an index typed on a command line is text
                return t
        raise InputError(f"{self.run_dir} has no task {name!r}; its tasks: {', '.join(t.name for t in self.tasks)}")

    def rollout(self, frames: Frames, steps: int, *, task: str | int | None = None, variant: str = "operator",
                members: int | None = None, seed: int | None = None, time_step: float | None = None,
                sample_ids=None, batch_size: int | None = None) -> Frames:
        """Roll a time-dependent task out from given frames, as the evaluation does.

        Args:
            frames: physical fields, [B, T0, C, *S] (numpy or torch) or {channel: [B, T0, *S]}; the
                rollout starts from the last of the T0 >= 1 frames (the models are Markov).
            steps: operator steps to take (>= 0).
            task: the task's name or index (None: the run's only task).
            variant: one of `TaskInfo.variants`.
            members: None for one rollout; K for an ensemble of K (member 0 is the single rollout).
            seed: the refiners' noise seed (None: the run's ``training.seed``, the evaluation's).
            time_step: the time between frames (None: `TaskInfo.time_step`, the training data's).
            sample_ids: one int per trajectory picking its noise (None: 0..B-1, which are the
                evaluation's ids of a task file's first rows).
            batch_size: trajectories rolled out at once (None: all).
        Returns:
            The T0 given frames followed by ``steps`` predictions, in the input's form: [B, T0 + steps,
            C, *S] (with members: [K, B, T0 + steps, C, *S]), or a mapping of such arrays per channel;
            numpy in, numpy out; torch in, torch on this surrogate's device out.
        Raises:
            InputError: other channels, a shape, dimension or grid other than the task's, non-finite
                values, an unknown task or variant, a negative step count.
        """
        info = self.task(task)
        if info.steady:
            raise InputError(f"task {info.name} is steady: map its coefficient with solve(), not rollout()")
        u, form = self._fields(frames, info, time=True)
        if not isinstance(steps, int) or steps < 0:
            raise InputError(f"steps must be an integer >= 0, got {steps!r}")
        dt = info.time_step if time_step is None else float(time_step)
        tail = (u.shape[1] + steps, *u.shape[2:])
        codec = self.models["autoencoder"].for_task(info.index)  # the codec reads this task's fields
        out = self._members(info, variant, members, seed, sample_ids, tail, u.shape[0], batch_size,
                            lambda step_for, rows, ids: rollout_fields(
                                u[rows], steps, encode=codec.encode, step_for=step_for,
                                decode=codec.decode, dt=dt, task_id=info.index,
                                sample_id_N=ids))
        return self._as(out, form, info, members is not None)

    def solve(self, coefficient: Tensor | np.ndarray, *, task: str | int | None = None, members: int | None = None,
              seed: int | None = None, sample_ids=None, batch_size: int | None = None) -> Tensor | np.ndarray:
        """A steady task's solution from its coefficient [B, C, *S] (numpy or torch), as the evaluation
        predicts it. -> [B, C, *S] (with members: [K, B, C, *S]) in the input's form; see `rollout`."""
        info = self.task(task)
        if not info.steady:
            raise InputError(f"task {info.name} is time-dependent: roll it out with rollout(), not solve()")
        if isinstance(coefficient, Mapping):
            raise InputError("solve() takes the coefficient as one array [B, C, *S]")
        u, form = self._fields(coefficient, info, time=False)
        ae = self.models["autoencoder"].for_task(info.index)

        def one(step_for, rows, ids):
            b = len(ids)
            fn = step_for(ids, torch.full((b,), -1, dtype=torch.int64))
            id_B = torch.full((b,), info.index, dtype=torch.int64, device=u.device)
            return predict_steady(fn, u[rows], encode=ae.encode, decode=ae.decode, task_id_B=id_B)

        out = self._members(info, "steady", members, seed, sample_ids, tuple(u.shape[1:]), u.shape[0], batch_size,
                            one)
        return self._as(out, form, info, members is not None)

    # --------------------------------------------------------------------------------- internals

    def _members(self, info: TaskInfo, variant: str, members: int | None, seed: int | None, sample_ids,
                 tail: tuple[int, ...], b: int, batch_size: int | None, run) -> Tensor:
        """``run(step_for, rows, ids)`` per member and batch of the B trajectories. -> [K, B, *tail]."""
        if variant not in info.variants:
            raise InputError(f"task {info.name} has no variant {variant!r}; this run has: {', '.join(info.variants)}")
        k = 1 if members is None else members
        if not isinstance(k, int) or k < 1:
            raise InputError(f"members must be an integer >= 1, got {members!r}")
        if batch_size is not None and batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        ids = (torch.arange(b, dtype=torch.int64) if sample_ids is None
               else torch.as_tensor(np.asarray(sample_ids), dtype=torch.int64).reshape(-1))
        if ids.numel() != b:
            raise InputError(f"sample_ids has {ids.numel()} ids for {b} trajectories")
        ids = ids + info.index * SAMPLE_ID_STRIDE
        cfg = self.config
        if seed is not None:
            cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, seed=int(seed)))
        if b == 0:  # nothing to roll out
            return torch.empty(k, 0, *tail, device=self.device)
        size = b if batch_size is None else batch_size
        out = []
        for member in range(k):
            step_for = variants(cfg, self.models, info.steady, member=member)[variant]
            out.append(torch.cat([run(step_for, slice(s, s + size), ids[s:s + size]) for s in range(0, b, size)]))
        return torch.stack(out)

    def _fields(self, frames, info: TaskInfo, *, time: bool) -> tuple[Tensor, str]:
        """The input as a float32 tensor [B, (T0,) C, *S] on the device, checked against the task,
        and its form ("numpy", "torch" or "mapping")."""
        lead = 2 if time else 1
        layout = f"[B, {'T0, ' if time else ''}C, *S] = [B, {'T0, ' if time else ''}{len(info.channels)}, " \
                 f"{', '.join(map(str, info.grid))}]"
        if isinstance(frames, Mapping):
            form = "mapping"
            if set(frames) != set(info.channels):
                raise InputError(f"task {info.name} has fields {list(info.channels)}; got {sorted(map(str, frames))}")
            parts = [_tensor(frames[c], c) for c in info.channels]
            if len({p.shape for p in parts}) != 1:
                raise InputError(f"the fields' arrays differ in shape: "
                                 f"{ {c: list(p.shape) for c, p in zip(info.channels, parts)} }")
            u = torch.stack(parts, dim=lead)
        else:
            form = "torch" if isinstance(frames, Tensor) else "numpy"
            u = _tensor(frames, "frames")
        want = (len(info.channels), *info.grid)
        if u.ndim != lead + len(want):
            raise InputError(f"task {info.name} is {len(info.grid)}D: expected {layout}, got {list(u.shape)}")
        if tuple(u.shape[lead:]) != want:
            what = "channels" if u.shape[lead] != want[0] else "grid (resolution)"
            raise InputError(f"task {info.name}: wrong {what}: expected {layout}, got {list(u.shape)}")
        if time and u.shape[1] < 1:
            raise InputError(f"task {info.name}: give at least one frame (T0 >= 1), got {list(u.shape)}")
        if not torch.isfinite(u).all():
            raise InputError(f"task {info.name}: the given fields hold NaN or infinite values")
        return u.to(self.device), form

    def _as(self, out_KB: Tensor, form: str, info: TaskInfo, keep_members: bool):
        """The result in the input's form (`rollout`'s Returns)."""
        out = out_KB if keep_members else out_KB[0]
        if form == "torch":
            return out
        arr = out.cpu().numpy()
        if form == "numpy":
            return arr
        axis = arr.ndim - len(info.grid) - 1
        return {c: np.take(arr, j, axis=axis) for j, c in enumerate(info.channels)}


def _tensor(x, name: str) -> Tensor:
    """`x` (numpy or torch, floating) as a float32 CPU-or-device tensor; `InputError` otherwise."""
    try:
        t = x if isinstance(x, Tensor) else torch.from_numpy(np.asarray(x))
    except (TypeError, ValueError) as e:
        raise InputError(f"{name}: not an array of numbers ({e})") from None
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise InputError(f"{name}: expected floating-point values, got {t.dtype}")
    return t.to(torch.float32)

