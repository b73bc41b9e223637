"""The sections a config leaves out, derived from its data: the one place that maps a dataset's
description to config sections.

A config file that names no `latent` section and only declared data (`data.tasks` with `path` and
`layout`) is completed here before it is validated: every section it leaves out comes from the
data's description (dimension, channels, training grid, kept steps, steady or not, training
trajectories), and a section it gives is merged over the derived one key by key, as a file is
merged over its `base:` (`operator: {steps: 3000}` changes the steps alone; `--set` overrides
apply after, so `--set latent.dim=32` changes the derived latent). A file that names `latent` is
its author's in full: nothing is derived. What was chosen, and why, is `Config.derived`: printed
in one block at start-up and recorded in config.json. Nothing here writes a file; the data are
read from metadata only (`pipelines.tasks.declared_description`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from entry.config.base import ConfigError, merge_trees
from entry.config.schema import AutoencoderConfig, DataConfig, TaskConfig
from pipelines.split import split_indices, split_of_sources
from pipelines.tasks import declared_description

__all__ = ["DataFacts", "derivable", "facts_of", "derive_sections", "complete_from_data"]

EXACT_NUMBERS = 64
"""The most numbers per token of an exact grid codec (dim = channels x points per cell): above
it the field is large, and its latent is a compressed one of `LATENT_DIM` numbers per token."""
LATENT_DIM = 64
"""Numbers per token of a compressed latent: the operator's width (`OPERATOR_WIDTH`), so the
tokens it steps are no wider than its blocks."""
SAMPLES_PER_NUMBER = 10
"""Patches (or cells) of training frames per latent number that a fitted PCA keeps: a basis
estimated from fewer is noise (the global PCA of 693 frames at 1,117 numbers reconstructed half)."""
OPERATOR_WIDTH = 64
"""The operator's width: what trains in minutes on a laptop CPU (configs/reduced/_base_flow.yaml)."""
TIME_BUDGET_S = 300.0
"""Seconds of training a derived stage may take (training.max_train_s): small data finish in
minutes on 2 CPU cores; a GPU runs the stage's steps well inside it."""
STEPS = 1500
"""A derived stage's optimizer steps (the reduced configs'); the time budget stops it sooner on a
slow machine, and the best validation's weights are published."""
VAL_EVERY = 100
"""Optimizer steps between validations of a derived operator or steady prior."""
FIT_FRAMES = AutoencoderConfig().fit_frames
"""Training frames per task the codec's linear path is fitted to (autoencoder.fit_frames' default)."""
REFINERS_LEFT_OUT = ("the refiners (diffusion, consistency) are left out to keep the run short (each trains as "
                     "long as the operator; they paid on a chaotic flow's long rollouts: README, \"Refinement on a "
                     "chaotic flow\"); add them to stages to train and score them")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataFacts:
    """What the defaults read of a config's data (all tasks together)."""

    name: str
    """The first task's name, for the start-up block."""
    dims: int
    """Spatial dimension d (1, 2 or 3), the same for every task."""
    channels: int
    """State channels C, the same for every task."""
    grid: tuple[int, ...]
    """The training grid (points per axis after reduce_x) of the largest task."""
    same_grid: bool
    """Every task trains on one grid (a conv codec serves only that)."""
    steps: int
    """Kept time steps per trajectory of the shortest dynamic task (1 when every task is steady)."""
    steady: bool
    """Some task is steady (the steady prior trains)."""
    dynamic: bool
    """Some task is time-dependent (the operator trains)."""
    train_trajectories: int
    """Training trajectories, summed over the tasks."""

    @property
    def frames(self) -> int:
        """Training frames (trajectories x kept steps)."""
        return self.train_trajectories * self.steps

    @property
    def pairs(self) -> int:
        """Training (input, next) pairs of the operator, or steady samples."""
        return self.train_trajectories * max(1, self.steps - 1)

    def describe(self) -> str:
        grid = "x".join(map(str, self.grid))
        time = f"{self.steps} steps" if self.dynamic else "steady"
        return (f"{self.name}: {self.dims}D, {self.channels} channel{'s' * (self.channels > 1)}, grid {grid}, "
                f"{time}, {self.train_trajectories} training trajectories")


def derivable(tree: dict) -> bool:
    """Whether a config tree is completed from its data: it names no `latent` and every task is
    declared (has a `layout`)."""
    tasks = tree.get("data", {}).get("tasks") if isinstance(tree.get("data"), dict) else None
    return ("latent" not in tree and isinstance(tasks, list) and bool(tasks)
            and all(isinstance(t, dict) and t.get("layout") for t in tasks))


def _train_rows(task: TaskConfig, data: DataConfig) -> int:
    """Training trajectories of a declared task: The Well's train folder when it has all three
    split folders, else PDEBench's split of `data.split` (as entry.data.files.task_split splits)."""
    desc = declared_description(task.path, task.layout, task.hdf5.options() if task.hdf5 else None)
    rows = split_of_sources({name: desc.split_rows(name) for name in ("train", "valid", "test")})
    if rows is None:
        s = data.split
        rows = split_indices(desc.trajectories, test_fraction=s.test_fraction, val_fraction=s.val_fraction,
                             seed=s.seed)
    return min(len(rows.train), task.train_trajectories or len(rows.train))


def facts_of(data: DataConfig) -> DataFacts:
    """The facts of a validated data section whose tasks are declared; `ConfigError` when its tasks
    mix spatial dimensions (no one latent serves them: name `latent` yourself)."""
    tasks = data.tasks
    dims = {t.spec.spatial_dims for t in tasks}
    if len(dims) > 1:
        raise ConfigError(f"data.tasks mix spatial dimensions ({sorted(dims)}): no one derived latent serves them; "
                          f"train them in separate configs or name the latent section yourself")
    grids = [t.training_grid for t in tasks]
    dynamic = [t for t in tasks if not t.spec.steady]
    steps = min(math.ceil(t.nt / t.reduce_t) for t in dynamic) if dynamic else 1
    return DataFacts(name=tasks[0].spec.name, dims=dims.pop(), channels=len(tasks[0].spec.channels),
                     grid=max(grids, key=math.prod), same_grid=len(set(grids)) == 1, steps=steps,
                     steady=len(dynamic) < len(tasks), dynamic=bool(dynamic),
                     train_trajectories=sum(_train_rows(t, data) for t in tasks))


def _cells(f: DataFacts) -> int:
    """Cells (latent grid points) per axis: 16 to 64 tokens in 1D, 8 x 8 in 2D (16 x 16 above 64
    points a side), 4^3 in 3D (8^3 above 32): the token counts the CPU-sized configs step."""
    if f.dims == 1:
        cells = 16
        while cells < 64 and f.channels * math.ceil(f.grid[0] / cells) > EXACT_NUMBERS:
            cells *= 2
        return min(cells, f.grid[0])
    side = (8 if max(f.grid) <= 64 else 16) if f.dims == 2 else (4 if max(f.grid) <= 32 else 8)
    while side > 2 and side > min(f.grid):
        side //= 2
    return side


def _fitted_dim(f: DataFacts, tokens: int, numbers: int) -> int:
    """Numbers per token of a compressed latent: `LATENT_DIM`, fewer when the training frames'
    cells (`SAMPLES_PER_NUMBER` per number) support fewer, never fewer than the channels."""
    samples = min(f.frames, FIT_FRAMES) * tokens
    return max(f.channels, min(LATENT_DIM, numbers, samples // SAMPLES_PER_NUMBER))


def latent_section(f: DataFacts) -> tuple[dict, str]:
    """The codec the data fit, and one line saying why: the exact grid codec when a cell's numbers
    fit a token (the codec is no error floor); else the conv codec, its patch dividing the grid, a
    local PCA (patches, never a dense covariance of whole fields), `LATENT_DIM` numbers per token;
    the grid codec's per-cell PCA where no patch gives a square power-of-two latent grid."""
    cells = _cells(f)
    tokens = cells ** f.dims
    per_cell = [math.ceil(n / cells) for n in f.grid]
    numbers = f.channels * math.prod(per_cell)
    cell_text = "x".join(map(str, per_cell))
    if numbers <= EXACT_NUMBERS:
        return ({"codec": "grid", "tokens": tokens, "dim": numbers, "hidden": 0},
                f"latent: grid codec, {tokens} tokens (cells of {cell_text} points) of {numbers} numbers: exact, "
                f"fitted, not trained (the codec is no error floor)")
    dim = _fitted_dim(f, tokens, numbers)
    fits = f.same_grid and all(n % cells == 0 for n in f.grid) and (f.dims == 1 or len(set(f.grid)) == 1)
    why = (f"{numbers / dim:.3g}x fewer numbers than the field; its linear path the PCA of {cell_text} "
           f"{'patches' if fits else 'cells'} over {min(f.frames, FIT_FRAMES)} training frames "
           f"x {tokens} {'patches' if fits else 'cells'}, fitted, not trained")
    if fits:
        patch = f.grid[0] // cells
        return ({"codec": "conv", "patch": patch, "dim": dim, "linear": "local", "hidden": 0},
                f"latent: conv codec, patch {patch} -> {tokens} tokens of {dim} numbers, {why}")
    return ({"codec": "grid", "tokens": tokens, "dim": dim, "hidden": 0},
            f"latent: grid codec, {tokens} tokens of {dim} numbers, {why}")


def _batch(most: int, cap: int) -> int:
    """The largest power of two <= min(cap, most), at least 2 (two ranks split it)."""
    return max(2, 1 << (max(1, min(cap, most)).bit_length() - 1))


def _backbone(tokens: int, width: int, depths: list[int], group_cap: int) -> dict:
    group = max(4, min(group_cap, tokens // 4))
    return {"hidden_dim": width, "depths": depths, "num_heads": 4, "group_size": group - group % 2,
            "token_conv": True}


def derive_sections(f: DataFacts) -> tuple[dict, tuple[str, ...]]:
    """Every section but `data` and `logging` for data of facts `f`, as a config tree, and the
    lines that say what was chosen and why (`Config.derived`)."""
    latent, latent_line = latent_section(f)
    tokens = latent["tokens"] if latent["codec"] == "grid" else (f.grid[0] // latent["patch"]) ** f.dims
    tree: dict = {"latent": latent,
                  "autoencoder": {"steps": 0, "batch_size": _batch(f.frames, 16)},
                  "training": {"max_train_s": TIME_BUDGET_S, "parallel": "ddp", "num_workers": 0,
                               "checkpoint_every": 500},
                  "evaluation": {"val_every": VAL_EVERY, "select": "best"}}
    lines = [f"derived from the data ({f.describe()}):", f"  {latent_line}"]
    stages = ["autoencoder", "cache"]
    if f.dynamic:
        pdet = _backbone(tokens, OPERATOR_WIDTH, [1, 1], 16)
        batch = _batch(f.pairs, 32)
        tree["operator"] = {"steps": STEPS, "batch_size": batch, "lr": 2e-3, "warmup_steps": 50, "ema_decay": 0.99,
                            "input_noise": 0.0, "pdet": pdet}
        stages.append("operator")
        lines.append(f"  operator: pdet_unet of width {OPERATOR_WIDTH}, depths [1, 1], windows of {pdet['group_size']} "
                     f"of the {tokens} tokens; {STEPS} steps of batch {batch} ({f.pairs} training pairs), "
                     f"lr 2e-3, moving average 0.99")
    if f.steady:
        pdet = _backbone(tokens, 2 * OPERATOR_WIDTH, [2, 2], 16)
        batch = _batch(f.pairs, 8)
        tree["steady"] = {"steps": STEPS, "batch_size": batch, "lr": 1e-3, "warmup_steps": 50, "noise_levels": 1,
                          "pdet": pdet}
        stages.append("steady")
        lines.append(f"  steady: conditional prior of width {2 * OPERATOR_WIDTH}, depths [2, 2], one level; "
                     f"{STEPS} steps of batch {batch} ({f.pairs} training samples)")
    tree["stages"] = [*stages, "evaluate"]
    lines += [f"  training: at most {TIME_BUDGET_S:.0f} s of training per stage (training.max_train_s); the best "
              f"validation (every {VAL_EVERY} steps) is published",
              f"  stages: {', '.join(tree['stages'])}; {REFINERS_LEFT_OUT}",
              "  a section the config gives is merged over these; --set changes any key (docs/declared-data.md)"]
    return tree, tuple(lines)


def complete_from_data(tree: dict, data: DataConfig) -> dict:
    """`tree` (a config that `derivable` accepts, `data` its validated data section) merged over the
    sections derived from its data, with `derived` set to the lines that say what was chosen."""
    derived, lines = derive_sections(facts_of(data))
    return {**merge_trees(derived, tree), "derived": list(lines)}
