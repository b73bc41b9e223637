# long file: one dataclass per YAML section, the reference a user reads for every key; split, it would scatter
"""Typed experiment configuration: one frozen dataclass per YAML section.

Every field has a docstring-style comment; `__post_init__` checks ranges and raises
`ValueError` naming the field, and `entry.config.load.load_config` prefixes the full key path.
Required fields have no default.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, fields, make_dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, Literal, get_type_hints

from core.models.conv_codec import GLOBAL_MAX_NUMBERS
from core.models.grid_codec import cells_per_axis
from core.models.pdet import PDETSettings
from core.models.registry import entry as registry_entry
from core.models.registry import with_settings
from core.metrics import RECONSTRUCTION_LOSSES
from pipelines.layouts.description import DataError
from pipelines.layouts.registry import layout_names
# How an error message shows a user's value lives below entry/ (the YAML loader of `pipelines.user_yaml`
# uses it too); entry/ imports these names from here.
from pipelines.shown import PATH_CHARS, SHOWN_CHARS, cut, shown, shown_path  # noqa: F401
from pipelines.tasks import TASKS, TaskSpec, declared_task, get_task

_frozen = dict(frozen=True, kw_only=True, slots=True)


def _positive(obj, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {shown(getattr(obj, name))}")


def _in_range(obj, name: str, lo: float, hi: float) -> None:
    value = getattr(obj, name)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {shown(value)}")


@dataclass(**_frozen)
class Hdf5FieldConfig:
    """One field of a user's HDF5 file (layout ``hdf5``)."""

    key: str
    """The dataset that holds it."""
    axes: str
    """Its axis order in letters: ``n`` trajectory, ``t`` time (absent: steady), ``x y z`` space in that
    order, ``c`` channel (absent: one channel); e.g. ``n t x y c``."""
    name: str = ""
    """The field's name (default: the key)."""
    kind: Literal["", "scalar", "vector", "tensor"] = ""
    """Default: vector when it has a channel axis, else scalar."""
    input: bool = False
    """An input only (a coefficient or forcing field, constant in time), not predicted."""


@dataclass(**_frozen)
class Hdf5LayoutConfig:
    """Where a user's HDF5 file keeps its fields (layout ``hdf5``)."""

    fields: tuple[Hdf5FieldConfig, ...]
    """The state fields in channel order, then any inputs."""
    coords: tuple[str, ...] = ()
    """Datasets of the coordinates per spatial axis, in order x, y, z (default: cell centres of [0, 1])."""
    times: str = ""
    """Dataset of the [T] (or [N, T]) stored times (default: 0, 1, 2, ...)."""
    periodic: tuple[bool, ...] = ()
    """Per spatial axis, whether the domain is periodic (default: unknown)."""

    def options(self) -> dict:
        """The mapping `pipelines.layouts.user_hdf5` reads."""
        fields = [{k: v for k, v in (("key", f.key), ("axes", f.axes), ("name", f.name), ("kind", f.kind),
                                     ("input", f.input)) if v not in ("", False)} for f in self.fields]
        out = {"fields": fields, "coords": {a: k for a, k in zip("xyz", self.coords, strict=False)}}
        if self.times:
            out["times"] = self.times
        if self.periodic:
            out["periodic"] = list(self.periodic)
        return out


@dataclass(**_frozen)
class TaskConfig:
    """One PDE data file and how it is sampled: a task we generate (``name`` and ``param``), or a
    dataset declared by its ``path`` and ``layout``."""

    name: str = ""
    """A generated task (a name in `pipelines.tasks.TASKS`: the 1D problems, Darcy and the 2D flows); it decides
    the solver, the file layout and the channels. Declared data (``layout`` set): a label only
    (default: the data's name and parameters)."""
    param: float = 0.0
    """A generated task's PDE parameter: advection beta, Burgers nu, Darcy forcing beta, Navier-Stokes
    nu, shallow-water gravity, or the diffusion-reaction k."""
    path: str = ""
    """HDF5 file; empty means `<data.root>/<PDEBench file name for name and param>` (generated tasks)."""
    layout: str = ""
    """Declared data: how the file at ``path`` is read, a registered layout (`pipelines.layouts.registry`:
    ``pdebench``, ``the_well``, ``hdf5`` reads the keys and axes ``hdf5`` names ...) or ``auto`` (the
    one that recognises the file's keys: PDEBench's, The Well's). Its grid, steps and channels come from the
    file, which replaces ``nx`` and ``nt``. Empty: a generated task."""
    hdf5: Hdf5LayoutConfig | None = None
    """Layout ``hdf5``: the dataset key and axis order of each field."""
    samples: int = 64
    """Trajectories to generate when the file is missing and data.generate_if_missing is set."""
    nx: int = 1024
    """Spatial points per axis of the stored file (PDEBench: 1024 for 1D, 128 for Darcy)."""
    nt: int = 201
    """Stored time steps for time-dependent tasks (PDEBench: 201)."""
    reduce_x: int = 1
    """Keep every reduce_x-th grid point when reading (PDEBench baselines: 4)."""
    reduce_t: int = 1
    """Keep every reduce_t-th time step when reading (PDEBench baselines: 5)."""
    initial_step: int = 1
    """Time steps given to the model before the first prediction (PDEBench baselines: 10)."""
    resolution: int = 0
    """Generated 2D flows only: grid points per axis of the solve, a multiple of ``nx`` (0: the flow's
    own, e.g. 256 for Navier-Stokes as the FNO benchmark solves it)."""
    t_end: float = 0.0
    """Generated time series: the time of the last of the ``nt`` stored steps, evenly spaced from t = 0
    (0: the task's own, e.g. 50 for Navier-Stokes, as the FNO benchmark stores it). A shorter span
    makes a chaotic flow's step from one frame to the next predictable (the Kolmogorov flow
    decorrelates within a few time units)."""
    seed: int = -1
    """A generated task's root seed: its file's every random draw (initial conditions, forcing) derives from it
    (-1: ``data.seed`` plus the task's index in ``data.tasks``). A file is named by the task and its parameter
    only, so configs that share a data folder and list a task at different places draw it differently; a
    file made with another seed is refused, naming the seed to set here to train on it."""
    train_trajectories: int = 0
    """Train on the first ``train_trajectories`` trajectories of the task's training split only (0:
    all of it); the validation and test splits are unchanged, and a smaller cap's trajectories are
    among a larger one's. A cap above the training split is a data error naming its size. For a
    learning curve against training-set size (bench.transfer)."""

    def __post_init__(self):
        _positive(self, "samples", "reduce_x", "reduce_t", "initial_step")
        if self.t_end < 0 or not math.isfinite(self.t_end):
            raise ValueError(f"t_end must be >= 0 (0: the task's own), got {shown(self.t_end)}")
        if self.seed < -1:
            raise ValueError(f"seed must be >= 0 (or -1: data.seed plus the task's index), got {shown(self.seed)}")
        if self.train_trajectories < 0:
            raise ValueError(f"train_trajectories must be >= 0 (0: the whole training split), got "
                             f"{shown(self.train_trajectories)}")
        if self.layout:
            if self.t_end:
                raise ValueError("t_end applies to generated tasks: a declared file's times are its own; remove t_end")
            if self.seed != -1:
                raise ValueError("seed applies to generated tasks: a declared file is read as it is; remove seed")
            self._declare()
            return
        if self.hdf5 is not None:
            raise ValueError("hdf5 applies to layout: hdf5 (a declared file); set layout or remove hdf5")
        if self.name not in TASKS:
            raise ValueError(f"name must be one of {list(TASKS)} (or set path and layout to declare a file), "
                             f"got {shown(self.name)}")
        if self.param <= 0:
            raise ValueError(f"param must be > 0, got {shown(self.param)}")
        if self.nx < 8:
            raise ValueError(f"nx must be >= 8, got {shown(self.nx)}")
        if self.nt < 2:
            raise ValueError(f"nt must be >= 2, got {shown(self.nt)}")
        if self.t_end and get_task(self.name).steady:
            raise ValueError(f"t_end applies to time series; {self.name} is steady: remove t_end")
        if self.resolution and (get_task(self.name).storage == "tensor" or self.resolution % self.nx):
            raise ValueError(f"resolution applies to the generated 2D flows and must be a multiple of nx "
                             f"({shown(self.nx)}), got {shown(self.resolution)} for {self.name}")

    def _declare(self) -> None:
        """A declared file: checked now (one line naming the file and key), its sizes taken from it."""
        if self.layout not in layout_names():
            raise ValueError(f"layout must be one of {list(layout_names())}, got {shown(self.layout)}")
        if not self.path:
            raise ValueError(f"layout {self.layout} needs path: the HDF5 file to read")
        if (self.layout == "hdf5") != (self.hdf5 is not None):
            raise ValueError("layout: hdf5 needs hdf5: {fields: [{key: ..., axes: ...}]}, and only it takes hdf5")
        try:
            spec = declared_task(self.path, self.layout, self.hdf5.options() if self.hdf5 else None, name=self.name)
        except DataError as err:
            raise ValueError(f"path: {err}") from None
        # The data say how large they are and what they are called; the frozen config records it.
        if not self.name:
            object.__setattr__(self, "name", spec.name)
        object.__setattr__(self, "nx", spec.nx)
        object.__setattr__(self, "nt", max(spec.nt, 2))

    @property
    def spec(self) -> TaskSpec:
        """What the stack reads of this task: dimension, steadiness, channels, grid (a generated task's
        registry entry, or what a declared file holds)."""
        if self.layout:
            return declared_task(self.path, self.layout, self.hdf5.options() if self.hdf5 else None, name=self.name)
        return get_task(self.name)

    @property
    def training_grid(self) -> tuple[int, ...]:
        """The grid the task is trained on: its stored points per axis after ``reduce_x``."""
        spec = self.spec
        grid = spec.grid or (self.nx,) * spec.spatial_dims
        return tuple(math.ceil(n / self.reduce_x) for n in grid)


@dataclass(**_frozen)
class SplitConfig:
    """Train/val/test split of every file (PDEBench: test = first 10% of the file)."""

    test_fraction: float = 0.1
    """Fraction of each file, taken from its start, kept for the final test."""
    val_fraction: float = 0.1
    """Fraction of the training part used for model selection."""
    seed: int = 0
    """Seed of the permutation that picks the validation slice."""

    def __post_init__(self):
        _in_range(self, "test_fraction", 0.0, 0.5)
        _in_range(self, "val_fraction", 0.0, 0.5)


@dataclass(**_frozen)
class DataConfig:
    """Where the PDE data live and how tasks are mixed."""

    tasks: tuple[TaskConfig, ...]
    """One entry per data file; batches may mix tasks."""
    root: str = "data"
    """Folder for task files without an explicit path ($VAR expanded by each process)."""
    generate_if_missing: bool = False
    """Generate a missing task file with our solvers instead of failing."""
    seed: int = 0
    """Seed for data generation: a generated task draws from this plus its index in ``tasks`` unless it sets
    its own (`task_seed`)."""
    split: SplitConfig = field(default_factory=SplitConfig)
    """How each file is split."""
    task_sampling: Literal["balanced", "proportional"] = "balanced"
    """Task mix of every global batch: every task an equal share (``balanced``, or the shares of
    ``task_weights``), or a share proportional to its training pairs (``proportional``)."""
    task_weights: tuple[float, ...] = ()
    """With ``task_sampling: balanced``, each task's relative share of every global batch, one
    positive number per entry of ``tasks`` in their order (e.g. [2, 1, 1]: the first task half of
    every batch); empty: equal shares."""

    def __post_init__(self):
        if not self.tasks:
            raise ValueError("tasks must name at least one task")
        if self.task_weights:
            if len(self.task_weights) != len(self.tasks) or min(self.task_weights) <= 0:
                raise ValueError(f"task_weights must hold one positive number per task ({len(self.tasks)}), "
                                 f"got {shown(list(self.task_weights))}")
            if self.task_sampling != "balanced":
                raise ValueError("task_weights set the shares of task_sampling: balanced; remove them, or set "
                                 "task_sampling: balanced")

    def place_seed(self, index: int) -> int:
        """The root seed task ``index`` draws from when it sets none: ``seed + index``, its place's."""
        return self.seed + index

    def task_seed(self, index: int) -> int:
        """The root seed task ``index`` is generated with: its own ``seed``, else its place's (`place_seed`)."""
        own = self.tasks[index].seed
        return own if own >= 0 else self.place_seed(index)

    def integer_task_weights(self) -> list[int] | None:
        """``task_weights`` as the smallest integers in the same ratios (to 4 significant digits:
        the sampler splits batches in exact integer arithmetic); None when unset."""
        if not self.task_weights:
            return None
        shares = [Fraction(w).limit_denominator(10_000) for w in self.task_weights]
        scale = math.lcm(*(f.denominator for f in shares))
        whole = [int(f * scale) for f in shares]
        common = math.gcd(*whole)
        return [w // common for w in whole]


@dataclass(**_frozen)
class LatentConfig:
    """Latent token space shared by all tasks, and the codec that maps fields to it (``codec``).

    ``grid`` (core/models/grid_codec.py): each token's cell holds a cosine expansion of the field,
    mapped to the token's D numbers by a linear path fitted in closed form (the autoencoder stage
    fits it before training), plus an optional learned non-linear correction. With ``modes`` = the
    points per cell of the training grid and D >= modes^d, encode/decode is exact (the codec is no
    error floor). Keys: tokens, tokens_2d, modes, linear.

    ``conv`` (core/models/conv_codec.py): a field of C channels becomes a latent grid of the
    training grid / ``patch`` cells of D = ``dim`` numbers each, C * patch^d / dim times fewer
    numbers; one token per latent cell. Its linear path is the PCA of the patches (fitted
    before training), plus a learned convolutional correction of width ``hidden``. Keys: patch,
    blocks. Every task then trains on one grid (one token count) that ``patch`` divides.

    ``fields`` (core/models/field_codec.py): named fields, each with a learned embedding, merged
    into ``tokens`` tokens per frame whatever their number, so tasks of other channel counts (and
    of 1D and 2D) share one model; learned end to end (``hidden`` > 0, no linear path). Keys:
    tokens, tokens_2d, modes, hidden."""

    codec: Literal["grid", "conv", "fields"] = "grid"
    """The codec: "grid" (cosine cells, ``tokens`` per field), "conv" (a latent grid ``patch``
    times coarser per axis, learned convolutions) or "fields" (named fields, any channel set)."""
    tokens: int = 0
    """Codec grid (required there): tokens L per field (a power of 4 when 2D fields share it, so
    they tile a square patch grid). Codec conv: leave 0 (its tokens are the latent cells)."""
    dim: int
    """Channels D per token (codec conv: the latent grid's channels)."""
    tokens_2d: int = 0
    """Codec grid: tokens of 2D fields (a power of 4); 0: the same as `tokens`. 1D and 2D fields never
    meet in one model that steps tokens (the operator steps 1D tasks, the steady prior Darcy), so
    each kind can have the token count that makes its codec exact at the latent size D."""
    hidden: int = 64
    """Width of the learned correction (codec grid: its stems and mixer; codec conv: its
    convolutional trunks); 0: the fitted linear path alone (no parameters, nothing to train: set
    autoencoder.steps=0)."""
    modes: int = 0
    """Codec grid: cosine modes per axis in each token's cell; 0: the training grid's points per cell
    and axis (exact for a latent of dim >= modes^d)."""
    linear: Literal["local", "global"] = "local"
    """Scope of the fitted linear path. Codec grid: "local" maps each cell to its own token (spatially
    local tokens, what the windowed operator expects); "global" is the PCA of whole fields (the best
    linear code when the latent is smaller than the field; tokens are not local). Codec conv:
    "local" is the PCA of patches; "global" the PCA of whole fields written in the basis closest to
    that local code (tokens stay local: core/models/conv_codec.py), for fields of at most 8192
    numbers."""
    patch: int = 0
    """Codec conv (required there): downsampling factor P per axis; every task's training grid must be
    a multiple of it. Codec grid: leave 0."""
    blocks: int = 1
    """Codec conv: residual blocks per downsampling stage (and at the latent resolution) of the
    learned correction. Codec grid: leave 1."""

    def __post_init__(self):
        _positive(self, "dim")
        for name in ("tokens", "tokens_2d", "hidden", "modes", "patch", "blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {shown(getattr(self, name))}")
        if self.codec == "fields" and (self.hidden == 0 or self.hidden % 4 or self.linear != "local"):
            raise ValueError(f"codec fields is learned (no linear path): it needs hidden a positive multiple of 4 "
                             f"(its attention heads) and linear=local, got hidden={shown(self.hidden)}, "
                             f"linear={shown(self.linear)}")
        if self.codec == "grid" and self.hidden % 4:
            raise ValueError(f"hidden: codec grid's learned correction has 4 attention heads (as codec fields'): "
                             f"give 0 (the linear path alone) or a multiple of 4, got hidden={shown(self.hidden)}")
        if self.codec in ("grid", "fields"):
            if self.tokens == 0:
                raise ValueError(f"tokens: codec {self.codec} needs the tokens per field, e.g. latent.tokens=16 (or "
                                 f"choose latent.codec=conv with latent.patch)")
            conv_only = {k: v for k, v, unset in (("patch", self.patch, 0), ("blocks", self.blocks, 1)) if v != unset}
            if conv_only:
                raise ValueError(_other_codec(conv_only, "conv", "latent.codec=conv"))
            return
        if self.patch == 0:
            raise ValueError("patch: codec conv needs the downsampling factor per axis, e.g. latent.patch=4")
        grid_only = {k: v for k, v in (("tokens", self.tokens), ("tokens_2d", self.tokens_2d), ("modes", self.modes))
                     if v != 0}
        if grid_only:
            # A base config may set them for the grid codec: name the overrides that clear them.
            resets = " ".join(f"latent.{k}=0" for k in grid_only)
            raise ValueError(_other_codec(grid_only, "grid", resets) + " (codec conv's tokens are its latent "
                             "cells: training grid / patch)")


def _other_codec(keys: dict[str, Any], codec: str, fix: str) -> str:
    """The message for latent `keys` (name -> value) set although they apply to `codec` only."""
    one = len(keys) == 1
    return (f"{', '.join(keys)} {'applies' if one else 'apply'} to codec {codec} only, got "
            f"{', '.join(f'{k}={shown(v)}' for k, v in keys.items())}; remove {'it' if one else 'them'} or set {fix}")


@dataclass(**_frozen)
class StageConfig:
    """Optimisation settings shared by every training stage. A section deriving from it, as a field of
    `Config`, is a training stage of that name (`STAGE_NAMES`, in the order of the fields)."""

    KEEPS_AVERAGE: ClassVar[bool] = False
    """Whether the stage keeps a moving average of its weights (`ema_decay`); the config refuses
    `ema_decay` on a section that keeps none, and the stage's record reads it."""
    HASHED_WHEN_SET: ClassVar[tuple[str, ...]] = ("adam_beta2",)
    """Keys added after runs were recorded, hashed only when set away from their default
    (`entry.config.load.HASHED_WHEN_SET`)."""
    RUN_CONTROL_KEYS: ClassVar[tuple[str, ...]] = ()
    """Keys that only shape the test report (a sampler's settings), which no stage's weights depend on
    (`entry.config.identity.RUN_CONTROL_KEYS`)."""

    steps: int = 100
    """Optimizer steps for the stage."""
    batch_size: int = 16
    """Global batch size (split over ranks and micro-steps)."""
    lr: float = 1e-3
    """Peak AdamW learning rate (cosine decay after warm-up)."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    ema_decay: float = 0.0
    """Decay of an exponential moving average of the weights (0: none). When set, the average is
    what validation scores, `select: best` keeps and the stage exports; its decay warms up as
    min(ema_decay, (1 + step) / (10 + step)). Used by the autoencoder, operator and steady stages."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay. A lower one (0.95, what large transformer trainings use) bounds
    the step a sudden larger gradient takes after a long run of small ones: a spike's m / sqrt(v)
    is at most (1 - beta1) / sqrt(1 - beta2), 3.2 at 0.999 and 0.45 at 0.95."""

    def __post_init__(self):
        _positive(self, "steps", "batch_size", "lr")
        if self.weight_decay < 0 or self.warmup_steps < 0:
            raise ValueError("weight_decay and warmup_steps must be >= 0")
        _adam_beta2_in_range(self)
        if not 0.0 <= self.ema_decay < 1.0:  # also refuses NaN
            raise ValueError(f"ema_decay must lie in [0, 1) (0: no average), got {shown(self.ema_decay)}")
        _no_average(self)


def _adam_beta2_in_range(section) -> None:
    if not 0.0 < section.adam_beta2 < 1.0:  # also refuses NaN
        raise ValueError(f"adam_beta2 must lie in (0, 1) (default 0.999), got {shown(section.adam_beta2)}")


def _no_average(section: StageConfig) -> None:
    if section.ema_decay != 0 and not section.KEEPS_AVERAGE:
        names = [name for name, cls in STAGE_CONFIGS.items() if cls.KEEPS_AVERAGE]
        keeping = " and ".join(filter(None, [", ".join(names[:-1]), names[-1]]))
        raise ValueError(f"ema_decay: only the {keeping} stages keep a moving average of their "
                         f"weights; remove it here (got {shown(section.ema_decay)})")


@dataclass(**_frozen)
class AutoencoderConfig(StageConfig):
    """Grid encoder/decoder stage: fit the linear path, then train the correction `steps` steps."""

    KEEPS_AVERAGE = True
    HASHED_WHEN_SET = StageConfig.HASHED_WHEN_SET + ("loss",)

    steps: int = 100
    """Optimizer steps training the learned correction (0: the fitted linear path alone)."""
    fit_frames: int = 8192
    """Training frames per task the linear path is fitted to (evenly spaced over the split)."""
    loss: Literal[("auto", *RECONSTRUCTION_LOSSES)] = "auto"
    """The correction's reconstruction loss per frame: "squared_relative" (its squared nRMSE),
    "nrmse" (each field's nRMSE, not squared, mean over the fields: scale-free, so it keeps
    training where the linear path is already good and a squared loss stalls, and every field
    weighs the same) or "mse" (plain); `core.steps.autoencoder.AutoencoderStepConfig.loss`.
    "auto": "nrmse" for the field codec (`latent.codec: fields`, whose tasks mix fields of other
    magnitudes, where a frame's relative error is its largest field's), else "squared_relative"."""

    def resolved_loss(self, codec: str) -> str:
        """The loss a codec `codec` trains with (``loss``, "auto" resolved)."""
        if self.loss != "auto":
            return self.loss
        return "nrmse" if codec == "fields" else "squared_relative"

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0 (0: the fitted linear path alone), got {shown(self.steps)}")
        _positive(self, "batch_size", "lr", "fit_frames")
        _no_average(self)
        if self.weight_decay < 0 or self.warmup_steps < 0:
            raise ValueError("weight_decay and warmup_steps must be >= 0")
        _adam_beta2_in_range(self)


@dataclass(**_frozen)
class OperatorConfig(StageConfig):
    """Latent time-stepping operator: the stage's settings, the architecture (`arch`) and, beside
    them, one section per operator of the model registry holding that model's settings (its
    settings dataclass, defined beside the model in core/models/): ``pdet`` (arch "pdet_unet",
    core.models.pdet.PDETSettings), ``transformer`` (core.models.transformer.TransformerSettings).
    The config holds `registered()`, this class with those sections as the registry has them now."""

    KEEPS_AVERAGE = True
    HASHED_WHEN_SET = StageConfig.HASHED_WHEN_SET + ("identity_start",)

    arch: str = "pdet_unet"
    """Operator architecture, a name in the model registry: "pdet_unet" (the PDE-Transformer U-Net,
    settings in `pdet`) or "transformer" (a plain transformer with global attention, settings in
    `transformer`); its settings are the section the registry names."""
    identity_start: bool = True
    """Predict the next latent as the last plus a learned change whose output layer starts at zero,
    so a fresh operator is persistence (True); False predicts the next latent itself (the
    ablation of this choice: the same output layer then starts it at the zero latent)."""
    horizon: int = 1
    """Stored steps between the input and the target latent."""
    unroll_steps: int = 1
    """Operator steps each training sample is rolled out (its own predictions fed back) and
    scored on; 1 is one-step training. Unrolling trains for the autoregressive use."""
    unroll_grad: Literal["full", "pushforward"] = "full"
    """With unroll_steps > 1: back-propagate through the whole rollout ("full"), or detach
    each step's input ("pushforward": one step's graph at a time)."""
    input_noise: float = 0.0
    """Std of Gaussian noise added to the input latent in training (0 disables it)."""
    task_weighting: Literal["none", "step_size"] = "none"
    """How the tasks of a multi-task model weigh in its loss. "none": plain latent MSE, so the
    tasks whose latents change most per step dominate. "step_size": each task's loss divided
    by its mean square step |z_next - z_t|^2 over the training pairs (measured before training;
    weights normalised to mean 1 over the dynamic tasks), so every task's error counts in units
    of its own step."""

    def __post_init__(self):
        StageConfig.__post_init__(self)
        _positive(self, "horizon")
        _positive(self, "unroll_steps")
        if self.input_noise < 0:
            raise ValueError("input_noise must be >= 0")

    @classmethod
    def registered(cls) -> type[OperatorConfig]:
        """This section as the loader reads it: `arch` one of the registered operators, and a field
        per registered operator (its section key, of its settings class, defaulted). Rebuilt when
        the registry changes (a test registers a model of its own)."""
        return _operator_section(tuple((name, e.section, e.settings) for name, e in with_settings("operator")))

    @property
    def settings(self) -> Any:
        """The settings of the chosen `arch` (the section the registry names for it)."""
        return getattr(self, registry_entry("operator", self.arch).section)


@functools.cache
def _operator_section(archs: tuple[tuple[str, str, type], ...]) -> type[OperatorConfig]:
    """`OperatorConfig` with `arch` a Literal of the `archs` names and one defaulted field per arch
    (section key, settings class): what `OperatorConfig.registered` returns for that registry."""
    taken = [section for _, section, _ in archs if hasattr(OperatorConfig, section)]  # a field, `settings`
    if taken:
        raise ValueError(f"operator section(s) {taken} of the model registry are keys of the operator stage; "
                         f"register the model with another section")
    fields = [("arch", Literal[tuple(name for name, _, _ in archs)], field(default="pdet_unet"))]
    fields += [(section, settings, field(default_factory=settings)) for _, section, settings in archs]
    return make_dataclass("OperatorConfig", fields, bases=(OperatorConfig,),
                          namespace={"__doc__": OperatorConfig.__doc__, "__module__": __name__,
                                     "__reduce__": _reduce_registered}, **_frozen)


def _reduce_registered(section: OperatorConfig) -> tuple:
    """Pickle a registered operator section by its values (its class is made at run time, so pickle
    cannot find it by name): a child process (the dry run's planner) rebuilds it from its registry."""
    return _registered_operator, ({f.name: getattr(section, f.name) for f in fields(section)},)


def _registered_operator(values: dict) -> OperatorConfig:
    """The registered operator section of this process's registry holding `values` (unpickling)."""
    return OperatorConfig.registered()(**values)


@dataclass(**_frozen)
class DiffusionConfig(StageConfig):
    """PDE-Refiner-style residual denoiser."""

    HASHED_WHEN_SET = StageConfig.HASHED_WHEN_SET + ("continuous_levels", "sampler", "sample_steps")
    RUN_CONTROL_KEYS = ("sampler", "sample_steps")

    pdet: PDETSettings = field(default_factory=PDETSettings)
    """Backbone settings."""
    noise_levels: int = 3
    """Refinement noise levels K (from sigma 1 down to sigma_min)."""
    sigma_min: float = 2e-3
    """Smallest noise level, in latent units like sigma_data: keep it below sigma_data (the
    residual's RMS, often ~1e-2), or the finest level's noise swamps the residual."""
    sigma_data: float = 0.0
    """RMS of the operator's latent residual z_next - operator(z_t), the signal the refiner
    models (EDM's sigma_data); 0 = measure it from the training data when the diffusion stage
    starts (stored in the weights, reused by the consistency stage and evaluation). Must be >= 0."""
    continuous_levels: bool = False
    """Train the noisy levels at sigmas drawn log-uniformly between sigma_min and 1 rather than at
    the sampler's noise_levels - 1 levels alone. Sampling is unchanged; a consistency stage needs
    it: distillation steps the teacher's ODE at levels between the sampler's, which a teacher
    trained on the levels alone has never seen (its student then drifts off the data)."""
    sampler: Literal["levels", "ode"] = "levels"
    """How evaluation samples the residual: "levels", PDE-Refiner's noise_levels steps from the
    level-0 prediction (its spread no wider than the first level's noise); "ode", EDM's Heun
    sampler from noise at min(1, 5 sigma_data) over sample_steps levels (a draw of the whole
    residual distribution; needs continuous_levels)."""
    sample_steps: int = 5
    """Levels of the "ode" sampler's Karras grid (2 * sample_steps - 2 denoiser calls a step)."""

    def __post_init__(self):
        StageConfig.__post_init__(self)
        _positive(self, "noise_levels")
        _in_range(self, "sigma_min", 1e-8, 1.0)
        if self.sample_steps < 2:
            raise ValueError(f"sample_steps must be >= 2, got {shown(self.sample_steps)}")
        if self.sampler == "ode" and not self.continuous_levels:
            raise ValueError("sampler 'ode' queries the denoiser between its training levels: set "
                             "diffusion.continuous_levels=true (and retrain the stage), or sampler=levels")
        if not self.sigma_data >= 0:  # also refuses NaN
            raise ValueError(f"sigma_data must be >= 0 (0: measure it), got {shown(self.sigma_data)}")


@dataclass(**_frozen)
class ConsistencyConfig(StageConfig):
    """Consistency distillation of the diffusion model."""

    HASHED_WHEN_SET = StageConfig.HASHED_WHEN_SET + ("sigma_mid",)
    RUN_CONTROL_KEYS = ("sample_steps", "sigma_mid")

    target_decay: float = 0.99
    """Decay of the EMA target network the student is distilled against (not a moving average of
    the exported weights: that is `ema_decay`, which this stage does not keep)."""
    sample_steps: int = 1
    """Steps the distilled model takes at inference (1 or 2)."""
    sigma_mid: float = 0.0
    """The noise level a 2-step sample re-noises to before its second step (0: the geometric mean of
    ``diffusion.sigma_min`` and 1, 0.045 at 2e-3). Near the residual's scale the second step
    corrects large scales too; near sigma_min, small scales only. Run control, as ``sample_steps``."""

    def __post_init__(self):
        # Before the shared checks, whose refusal of ema_decay would not name target_decay.
        if self.ema_decay != 0:
            raise ValueError(f"ema_decay: the consistency stage keeps no moving average of its weights; its "
                             f"target network's decay is target_decay (got ema_decay {shown(self.ema_decay)})")
        StageConfig.__post_init__(self)
        if not 0.0 <= self.sigma_mid < 1.0:  # also refuses NaN
            raise ValueError(f"sigma_mid must lie in [0, 1) (0: the geometric mean of sigma_min and 1), got "
                             f"{shown(self.sigma_mid)}")
        _in_range(self, "target_decay", 0.0, 1.0)
        if self.sample_steps not in (1, 2):
            raise ValueError(f"sample_steps must be 1 or 2, got {shown(self.sample_steps)}")


@dataclass(**_frozen)
class SteadyConfig(StageConfig):
    """Conditional prior for steady tasks (coefficient latent -> solution latent)."""

    KEEPS_AVERAGE = True

    pdet: PDETSettings = field(default_factory=PDETSettings)
    """Backbone settings."""
    noise_levels: int = 3
    """Denoising levels."""
    subtract_mean: bool = True
    """Learn each solution's deviation from its task's training mean (measured before training,
    stored in the weights, added back when sampling) instead of the solution itself."""

    def __post_init__(self):
        StageConfig.__post_init__(self)
        _positive(self, "noise_levels")


@dataclass(**_frozen)
class TrainingConfig:
    """Process-level training settings shared by all stages."""

    seed: int = 0
    """Base seed; ranks offset it where they must differ."""
    accum_steps: int = 1
    """Micro-steps per optimizer step."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision: bf16 computes in bf16 and keeps the latent state, losses and reductions in
    fp32 (docs/precision.md); auto is bf16 on CUDA and fp32 on CPU."""
    parallel: Literal["fsdp", "ddp", "none"] = "fsdp"
    """Data parallelism when world size > 1."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend; auto is nccl on CUDA, gloo on CPU."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile every block (then shard), and the frozen networks; auto is on with CUDA, off on CPU."""
    cpu_offload: bool = False
    """Offload FSDP2 parameters to CPU."""
    num_workers: int = 2
    """Data-loader thread workers."""
    prefetch_factor: int = 2
    """Batches prefetched ahead of the step."""
    cache_dir: str = "data/latent_cache"
    """Latent cache folder; node-local ones (/dev/shm, $TMPDIR/...: $VAR is expanded by each
    process) are built once per node."""
    checkpoint_every: int = 50
    """Optimizer steps between checkpoints."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept per stage."""
    max_skips_in_a_row: int = 5
    """Non-finite steps skipped in a row before the run stops."""
    max_train_s: float = 0.0
    """A training stage's time budget in seconds of training (validation excluded, resumed attempts
    included): no step starts that would pass it, and the stage ends early if it must (0: none).
    The learning-rate schedule is annealed to the stage's `steps` unless ``anneal_to`` is ``time``."""
    anneal_to: Literal["steps", "time"] = "steps"
    """What the learning rate's cosine decays over: the stage's ``steps``, or (``time``, with
    ``max_train_s``, one process) whichever of the steps and the time budget runs out first, so that
    a stage its budget stops ends annealed on a machine of any speed (bench.race's ours: every
    model's schedule annealed to its own budget)."""
    on_oom: Literal["shrink", "fail"] = "shrink"
    """After an out-of-memory restart: halve the micro-batch, or fail."""
    timeout_s: float = 300.0
    """Process-group timeout. A latent cache build waits half of it for another job building the
    same cache (the same encoder and data), then reuses what that job built."""
    deterministic: bool = False
    """torch deterministic algorithms (for golden-loss tests)."""
    debug: bool = False
    """Verbose distributed debugging (TORCH_DISTRIBUTED_DEBUG, NCCL_DEBUG)."""

    def __post_init__(self):
        _positive(self, "accum_steps", "prefetch_factor", "checkpoint_every",
                  "keep_checkpoints", "max_skips_in_a_row", "timeout_s")
        if self.num_workers < 0 or self.grad_clip < 0 or self.max_train_s < 0:
            raise ValueError("num_workers, grad_clip and max_train_s must be >= 0")
        if self.anneal_to == "time" and self.max_train_s == 0:
            raise ValueError("anneal_to='time' needs a time budget to anneal to: set training.max_train_s=SECONDS "
                             "or training.anneal_to=steps")


MAX_ENSEMBLE_MEMBERS = 1024
"""The most rollouts per test trajectory `evaluation.ensemble_members` may ask for: ensemble scores
settle with tens of members, and each member costs a whole rollout of every test trajectory."""


@dataclass(**_frozen)
class EvalConfig:
    """Evaluation settings."""

    rollout_steps: int = 0
    """Autoregressive steps (0: the whole stored trajectory)."""
    val_rollout_steps: int = 0
    """Autoregressive steps of validation (0: as ``rollout_steps``). On a chaotic flow a rollout
    decorrelates within tens of steps, after which its error is the climatology's whatever the
    model: validating the first steps selects the model that stays accurate, at a fraction of the
    cost of the whole trajectory."""
    plot_samples: int = 2
    """Test samples plotted per task."""
    max_test_samples: int = 0
    """Cap on test trajectories per task (0: all)."""
    val_every: int = 0
    """Optimizer steps between validations in the operator and steady stages (0: none); one also
    follows the last step. Validation rolls out the val split, never the test split."""
    val_samples: int = 32
    """Validation trajectories per task: the first ones of the task's val split."""
    select: Literal["last", "best"] = "last"
    """Weights a stage exports: the last step's, or those with the lowest mean validation nRMSE
    ("best" needs val_every > 0)."""
    lead_windows: tuple[int, ...] = (10, 30)
    """Lead times (predicted steps, 1-based) at which the test report's lead-time windows end:
    (10, 30) scores steps 1-10, 11-30 and 31 to the end separately (edges past the rollout drop)."""
    ensemble_members: int = 1
    """Rollouts K per test sample of a stochastic variant (the refiners), each with its own noise,
    scored by CRPS, spread-skill and ensemble-mean nRMSE; 1 samples nothing beyond the one rollout.
    At most `MAX_ENSEMBLE_MEMBERS` (1024), and the K predicted trajectories of a batch of 16, held
    at once (twice), must take at most half the available memory: the evaluation (and the pipeline,
    before training) prints that estimate and refuses a larger K, naming the largest that fits."""
    time_rollout: bool = True
    """Time one latent rollout step of each variant of a time-dependent task (eval.json's
    `rollout_step_ms`, up to half a second of timed rounds per variant and task, on rank 0). false
    records only each network's calls per step: for runs whose timing nobody reads (a busy or shared
    machine's is noise)."""
    split: Literal["test", "val"] = "test"
    """Trajectories the evaluation scores: the test split (what results report) or the val split, to
    choose run control (``diffusion.sampler``, ``ensemble_members``) without the test trajectories.
    eval.json records which. Training's validation always reads the val split."""

    def __post_init__(self):
        for key in ("rollout_steps", "val_rollout_steps", "plot_samples", "max_test_samples"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {shown(getattr(self, key))}")
        if any(e <= 0 for e in self.lead_windows) or any(b <= a for a, b in zip(self.lead_windows,
                                                                                 self.lead_windows[1:])):
            raise ValueError(f"lead_windows must be strictly increasing positive step counts, got "
                             f"{shown(self.lead_windows)}")
        _positive(self, "ensemble_members")
        if self.ensemble_members > MAX_ENSEMBLE_MEMBERS:
            raise ValueError(f"ensemble_members must be at most {MAX_ENSEMBLE_MEMBERS} (each member is a whole "
                             f"rollout of every test trajectory), got {shown(self.ensemble_members)}")
        if self.val_every < 0:
            raise ValueError(f"val_every must be >= 0 (0 disables validation), got {shown(self.val_every)}")
        _positive(self, "val_samples")
        if self.select == "best" and self.val_every == 0:
            # The prefix the loader adds makes this "evaluation.select=...": name the fix in full.
            raise ValueError("select='best' needs validation to pick the weights, but evaluation.val_every "
                             "is 0; set evaluation.val_every=N (steps between validations) or "
                             "evaluation.select=last")


@dataclass(**_frozen)
class WandbConfig:
    """Weights & Biases logging (rank 0 only)."""

    mode: Literal["offline", "online", "disabled"] = "offline"
    """offline needs no network; online uploads; disabled skips wandb."""
    project: str = "universal-simulator"
    """Project name."""
    entity: str = ""
    """Team or user (empty: wandb's default)."""
    tags: tuple[str, ...] = ()
    """Run tags."""


@dataclass(**_frozen)
class LoggingConfig:
    """Where runs are written; excluded from the config hash."""

    run_dir: str = "runs"
    """Parent folder of run folders."""
    run_name: str = ""
    """Run folder name, a plain name inside run_dir (empty: derived from the config hash)."""
    log_every: int = 10
    """Optimizer steps between metric lines."""
    progress: bool = True
    """tqdm progress bar on rank 0."""
    plots: bool = True
    """PNG plots in the run folder's ``plots/``: each stage's training curves and the evaluation's
    (its test samples, ``evaluation.plot_samples`` of them, and nRMSE per rollout step). false: none
    at all, for runs whose plots nobody reads (a sweep's, a test's): each costs about half a second of
    CPU, and the first of a process a second more to import matplotlib."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """wandb settings."""

    def __post_init__(self):
        _positive(self, "log_every")
        _plain_name(self.run_name)
        _name_fits(self.run_dir, self.run_name)


def _plain_name(name: str) -> None:
    """Refuse a run name that is a path: `..`, `a/b` or `/abs` would put the run folder (its
    checkpoints, logs, lock) outside `run_dir`, and `..` would make the repository root a run."""
    if not name:
        return  # the documented default: a name derived from the config hash
    if name.strip() in (".", "..", "") or any(c in name for c in "/\\\0") or name != name.strip():
        raise ValueError(f"run_name must be a plain folder name inside logging.run_dir (no '/' or '\\', not '.' "
                         f"or '..', no surrounding spaces), got {shown(name)}; use a plain name, e.g. "
                         f"--set logging.run_name=my_run (put the parent folder in logging.run_dir)")


def _name_fits(run_dir: str, name: str) -> None:
    """Refuse a run name longer than one name may be on the file system that holds `run_dir`
    (`os.pathconf`'s PC_NAME_MAX of its nearest existing folder, else 255 bytes): creating the run
    folder would fail with ENAMETOOLONG only after the data were prepared."""
    folder = Path(os.path.expanduser(os.path.expandvars(run_dir))).absolute()
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255  # NAME_MAX of ext4, XFS, APFS and NFS
    if len(os.fsencode(name)) > limit:
        raise ValueError(f"run_name is {len(os.fsencode(name))} bytes, longer than the {limit} a file name may have "
                         f"under {folder}; got {shown(name)}; use a shorter name, e.g. --set logging.run_name=my_run")


NEW_FIELD_LOSSES = ("reconstruction", "forecast")
"""What a fine-tuned field codec's new field embeddings learn from (`FinetuneConfig.new_fields`)."""


@dataclass(**_frozen)
class FinetuneConfig:
    """Fine-tuning from a finished run: every stage it trained starts from its weights
    (docs/using.md, "Fine-tuning from a run"). The YAML key of `source` is ``from``
    (`YAML_KEYS`: ``from`` is a Python keyword, so the field has another name)."""

    YAML_KEYS: ClassVar[dict[str, str]] = {"source": "from"}
    """Field name -> the key a YAML file (and config.json) spells it with."""

    source: str = ""
    """``finetune.from``: a finished run folder whose weights every training stage it has starts
    from ($VAR and ~ expanded); empty: no fine-tuning. A config that names no ``latent`` takes
    every section it leaves out from that run's config.json (entry.config.from_run)."""
    freeze: tuple[str, ...] = ()
    """Training stages (e.g. ``[autoencoder]``) not trained: their weights are the source's,
    copied into the run folder, and later stages read them. A frozen field codec meeting fields the
    source never read trains their new embeddings alone (``autoencoder.steps``), every weight the
    source trained kept bit for bit, so the new fields are read into the latent the source's operator
    knows. A stage with a task table (operator, refiners, steady prior) may be frozen only when the
    config's tasks are the source's."""
    new_lr_scale: float = 1.0
    """Learning-rate multiplier of the parameters the source did not have: the task-embedding rows
    of tasks it did not train on and a field codec's embeddings of fields it never read, under DDP and
    FSDP2 alike (each rank scales the rows its shard holds). 1 (the default) treats them as every other
    parameter. New fields need more: their embeddings start at the mean of the source's and must move
    far while the trained rest should not, and AdamW's steps are lr-sized whatever a parameter's
    history. On a held-out PDE with two new fields (docs/benchmarks.md, "The reduced
    diffusion-reaction case") the fine-tuned model lost to scratch at 1x and beat it at every
    training-set size at 10x; a new task row alone was indifferent to it."""

    new_fields: str = "reconstruction"
    """What a field codec's embeddings of fields the source never read learn from: "reconstruction"
    (the codec's loss alone) or "forecast" (that loss plus the error of the source's operator, as the
    operator stage starts it, forecasting one step through them: decode(operator(encode(u_t))) against
    u_{t+h}, the operator frozen). Reconstruction alone places a new field wherever it decodes well,
    which need not be where the source's operator has learned dynamics; the forecast pulls it there
    (docs/using.md, "New fields")."""

    def __post_init__(self):
        _positive(self, "new_lr_scale")
        if self.new_fields not in NEW_FIELD_LOSSES:
            raise ValueError(f"new_fields must be one of {shown(NEW_FIELD_LOSSES)}, got {self.new_fields!r}")
        if self.new_fields == "forecast" and not self.source:
            raise ValueError("new_fields: forecast fits new fields through a source run's operator, but finetune.from "
                             "is empty; set finetune.from=RUN_FOLDER or remove new_fields")
        if len(set(self.freeze)) != len(self.freeze):
            raise ValueError(f"freeze names a stage twice: {shown(self.freeze)}")
        if self.freeze and not self.source:
            raise ValueError(f"freeze ({shown(self.freeze)}) keeps a source run's weights, but finetune.from is "
                             f"empty; set finetune.from=RUN_FOLDER or remove freeze")


@dataclass(**_frozen)
class Config:
    """A whole experiment."""

    data: DataConfig
    """PDE data files."""
    latent: LatentConfig
    """Latent token space."""
    autoencoder: AutoencoderConfig = field(default_factory=AutoencoderConfig)
    """Autoencoder stage."""
    operator: OperatorConfig = field(default_factory=lambda: OperatorConfig.registered()())
    """Operator stage (`OperatorConfig.registered()`: with a section per registered operator)."""
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    """Diffusion residual stage."""
    consistency: ConsistencyConfig = field(default_factory=ConsistencyConfig)
    """Consistency distillation stage."""
    steady: SteadyConfig = field(default_factory=SteadyConfig)
    """Steady prior stage."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Process-level training settings."""
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation settings."""
    stages: tuple[str, ...] = field(default_factory=lambda: STAGE_NAMES)
    """Stages entry.pipeline runs, in this order."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Output locations and loggers (not part of the config hash)."""
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    """Fine-tuning from a finished run (`finetune.from`); off by default, and then not hashed."""
    derived: tuple[str, ...] = ()
    """Written by the loader, never by hand: for a config that names only its data, what was derived
    from the data and why (entry.config.from_data), the block printed at start-up; empty otherwise.
    Not part of the config hash (the sections it describes are)."""

    def __post_init__(self):
        unknown = [s for s in self.stages if s not in STAGE_NAMES]
        if unknown:
            raise ValueError(f"stages has unknown stage(s) {shown(unknown)}; allowed: {list(STAGE_NAMES)}")
        frozen = [s for s in self.finetune.freeze if s not in STAGE_CONFIGS]
        if frozen:
            raise ValueError(f"finetune.freeze has unknown training stage(s) {shown(frozen)}; allowed: "
                             f"{list(STAGE_CONFIGS)}")
        if self.consistency.sigma_mid and not self.consistency.sigma_mid > self.diffusion.sigma_min:
            raise ValueError(f"consistency.sigma_mid ({shown(self.consistency.sigma_mid)}) must lie above "
                             f"diffusion.sigma_min ({shown(self.diffusion.sigma_min)}), where a 2-step sample ends; "
                             f"raise it or set 0 (the geometric mean of sigma_min and 1)")

        channels = {t.spec.name: len(t.spec.channels) for t in self.data.tasks}
        if len(set(channels.values())) > 1 and self.latent.codec != "fields":
            # The grid and conv codecs read one channel set; the field codec reads each task's own.
            raise ValueError(f"data.tasks have different channel counts ({', '.join(f'{k}: {v}' for k, v in channels.items())}); "
                             f"set latent.codec: fields (a codec of named fields), or train tasks with another "
                             f"number of channels in a separate config")
        if self.latent.codec == "conv":
            _check_conv_layout(self)
            return
        for task in self.data.tasks:
            d = task.spec.spatial_dims
            key, tokens = (("tokens_2d", self.latent.tokens_2d) if d == 2 and self.latent.tokens_2d
                           else ("tokens", self.latent.tokens))
            try:
                # The grid encoder tiles a 2D/3D field into an S^d Morton grid of tokens, S a power of 2.
                cells_per_axis(tokens, d)
            except ValueError:
                raise ValueError(f"latent.{key} must be a power of {2 ** d} ({2 ** d}, {4 ** d}, {8 ** d}, ...) when a "
                                 f"{d}D task is trained ({task.spec.name}), got {shown(tokens)}") from None


def _stage_configs() -> dict[str, type[StageConfig]]:
    hints = get_type_hints(Config)
    return {f.name: hints[f.name] for f in fields(Config)
            if isinstance(hints[f.name], type) and issubclass(hints[f.name], StageConfig)}


STAGE_CONFIGS: dict[str, type[StageConfig]] = _stage_configs()
"""The training stages, each named as its section (a field of `Config` deriving from `StageConfig`),
in the order of `Config`'s fields, which is the order the pipeline trains them."""


def _stage_names() -> tuple[str, ...]:
    training = tuple(STAGE_CONFIGS)
    # The latent cache is what the trained encoder writes and every later stage reads: it follows the
    # autoencoder. The evaluation scores what the stages exported: it comes last.
    after = training.index("autoencoder") + 1
    return training[:after] + ("cache",) + training[after:] + ("evaluate",)


STAGE_NAMES: tuple[str, ...] = _stage_names()
"""Every stage in pipeline order, defined here once: the training stages (`STAGE_CONFIGS`), the
latent cache after the autoencoder, the evaluation last; the default of `Config.stages`. Each but
the evaluation has its record in entry/stages/<name>.py (entry.stages.record)."""


def _check_conv_layout(cfg: Config) -> None:
    """The tasks a conv codec can serve: one spatial dimension and one training grid (so one token
    count: the operator's batches mix tasks), every axis a multiple of `latent.patch`, and for the
    pdet_unet operator a latent grid its windows see as local patches (Morton order needs a
    square / cubic grid of power-of-two side). Raises ValueError naming the key and the fix."""
    patch, tasks = cfg.latent.patch, cfg.data.tasks
    # Listed by position: two tasks of one name (another parameter) may differ in grid.
    dims = [t.spec.spatial_dims for t in tasks]
    if len(set(dims)) > 1:
        raise ValueError(f"latent.codec: a conv codec serves one spatial dimension, but data.tasks mix "
                         f"{_per_task(tasks, [f'{d}D' for d in dims])}; train tasks of another dimension in a "
                         f"separate config")
    grids = [t.training_grid for t in tasks]
    if len(set(grids)) > 1:
        raise ValueError(f"latent.codec: with codec conv every task trains on one grid (one token count), got "
                         f"{_per_task(tasks, grids)} (points per axis after reduce_x); set nx / reduce_x so they agree")
    name, grid = tasks[0].spec.name, grids[0]
    if any(n % patch for n in grid):
        fits = [p for p in range(2, min(grid) + 1) if all(n % p == 0 for n in grid)]
        raise ValueError(f"latent.patch ({shown(patch)}) must divide every axis of the training grid {grid} "
                         f"({name}, after reduce_x); choose one of {shown(fits) if fits else '[1]'} or change "
                         f"nx / reduce_x")
    cells = tuple(n // patch for n in grid)
    numbers = len(tasks[0].spec.channels) * math.prod(grid)
    if cfg.latent.linear == "global" and not cfg.latent.dim * math.prod(cells) <= numbers <= GLOBAL_MAX_NUMBERS:
        raise ValueError(f"latent.linear: a global linear path fits fields of at most {GLOBAL_MAX_NUMBERS} numbers into a "
                         f"latent no larger than the field; {name} has {numbers} numbers per frame and the latent "
                         f"{cfg.latent.dim * math.prod(cells)}: set latent.linear=local or a smaller latent.dim")
    side = cells[0]
    if (cfg.operator.arch == "pdet_unet" and len(cells) > 1
            and (any(n != side for n in cells) or side & (side - 1))):
        raise ValueError(f"latent.patch: the pdet_unet operator needs a square / cubic latent grid of power-of-two "
                         f"side (Morton-ordered tokens), but {name}'s grid {grid} / patch {patch} is {cells}; "
                         f"choose nx and latent.patch so, or set operator.arch=transformer")


def _per_task(tasks: tuple[TaskConfig, ...], values: list) -> str:
    """`values` beside their tasks, for a message: "a: (16, 16), b: (32, 32)" (cut short)."""
    return cut(", ".join(f"{t.spec.name}: {v}" for t, v in zip(tasks, values, strict=True)))
