"""Resolve, generate and validate the data files a config names (process-level file work)."""

from __future__ import annotations

from pathlib import Path

from entry.config import ConfigError
from entry.config_schema import Config, TaskConfig


def task_path(cfg: Config, task: TaskConfig) -> Path:
    """The HDF5 file of `task`: its explicit `path`, else `<data.root>/<PDEBench file name>`."""
    from pipelines.tasks import task_file_name

    return Path(task.path) if task.path else Path(cfg.data.root) / task_file_name(task.name, task.param)


def resolve_task_paths(cfg: Config, *, require_existing: bool) -> list[Path]:
    """Every task's data file; with `require_existing`, a missing file that will not be
    generated is a `ConfigError` naming `data.tasks[i].path`."""
    paths = [task_path(cfg, t) for t in cfg.data.tasks]
    for i, path in enumerate(paths):
        if path.exists() and not path.is_file():
            raise ConfigError(f"data.tasks[{i}].path: {path} is a directory, not an HDF5 data file; name the file")
    if require_existing and not cfg.data.generate_if_missing:
        for i, (task, path) in enumerate(zip(cfg.data.tasks, paths)):
            if not path.is_file():
                raise ConfigError(
                    f"data.tasks[{i}].path: data file {path} for {task.name} does not exist; "
                    f"generate it with `python -m pipelines.generate --task {task.name} --out {path.parent}` "
                    f"or set data.generate_if_missing=true")
    return paths


def existing_task_file(cfg: Config, task_index: int) -> Path:
    """The data file of task `task_index`; a `ConfigError` naming `data.tasks[i].path` when it is
    missing or not a file."""
    path = task_path(cfg, cfg.data.tasks[task_index])
    if not path.is_file():
        what = "is a directory, not an HDF5 data file" if path.is_dir() else "does not exist"
        raise ConfigError(f"data.tasks[{task_index}].path: {path} {what}; run `python -m entry.prepare_data "
                          f"--config CFG` or name the file")
    return path


def ensure_data(cfg: Config, *, workers: int = 1) -> list[Path]:
    """Generate every missing task file (when allowed) and validate all of them; returns the paths."""
    from pipelines.generate import generate_task
    from pipelines.validate import validate_file

    paths = resolve_task_paths(cfg, require_existing=True)
    for i, (task, path) in enumerate(zip(cfg.data.tasks, paths)):
        if not path.is_file():
            written = generate_task(task.name, task.samples, path.parent, nx=task.nx, nt=task.nt,
                                    seed=cfg.data.seed + i, param=task.param, workers=workers)
            if Path(written) != path:
                raise ConfigError(f"data.tasks[{i}].path: generated {written}, but the config names {path}; "
                                  f"leave the path empty or name the PDEBench file")
        validate_file(path)
    return paths


def task_split(cfg: Config, task_index: int, split: str):
    """(file rows of `split` - "train", "val" or "test" - sorted, and the file's layout) of one task,
    split as `data.split` says (PDEBench's: test = the first `test_fraction` of the file)."""
    from pipelines.pdebench_io import open_pdebench
    from pipelines.split import split_indices

    task = cfg.data.tasks[task_index]
    with open_pdebench(task_path(cfg, task), task=task.name) as f:
        layout = f.layout
    s = cfg.data.split
    rows = split_indices(layout.n_samples, test_fraction=s.test_fraction, val_fraction=s.val_fraction, seed=s.seed)
    return getattr(rows, split), layout
