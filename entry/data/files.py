"""Resolve, generate and validate the data files a config names (process-level file work).

Under torchrun every rank takes part (`prepare_data_files`): missing files are generated in
parts, one per rank that sees the data folder (all ranks on a shared folder, a node's ranks on a
node-local one), merged by one of them, then validated and fingerprinted once per version of
each file (the results are cached beside it, see pipelines/file_facts.py). The ranks wait for
each other on a process group of their own with a timeout of `DATA_WAIT_S`, never under
`training.timeout_s`, which bounds training's collectives.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from entry.config.load import ConfigError, config_hash
from entry.config.schema import Config, TaskConfig
from entry.distributed import hooks
from entry.distributed.process_group import DistInfo
from entry.storage.probe import expand_path, probe_storage
from entry.storage.run_folder import show_progress
from pipelines.file_facts import data_fingerprint, file_fingerprint, settle
from pipelines.generate import generate_part, generate_task, generated_seed, merge_parts
from pipelines.layouts import DataError, is_glob
from pipelines.layouts import expand_path as layout_files
from pipelines.split import split_indices, split_of_sources
from pipelines.task_data import task_description
from pipelines.tasks import task_file_name
from pipelines.validate import validated

DATA_WAIT_S = 24 * 3600.0
"""How long ranks wait for each other while data are made, merged, validated or encoded: a full
config's 10000-sample files take minutes to hours. A rank that fails exits, and torchrun then
stops the others at once; only a rank that hangs would be waited for this long."""


def task_key(cfg: Config, i: int) -> str:
    """Task `i`'s identity in manifests and done files: index, name and parameter."""
    t = cfg.data.tasks[i]
    return f"{i}:{t.name}:{t.param:g}"


def task_path(cfg: Config, task: TaskConfig) -> Path:
    """The HDF5 file of `task`: its explicit `path`, else `<data.root>/<PDEBench file name>`."""
    return expand_path(task.path) if task.path else expand_path(cfg.data.root) / task_file_name(task.name, task.param)


def is_declared(task: TaskConfig) -> bool:
    """Whether `task` is a user's dataset named by path and layout (a file, a folder or a glob of
    files) rather than a generated task's single file."""
    return bool(task.layout)


def task_files(cfg: Config, task: TaskConfig) -> list[Path]:
    """The data files of `task`: its file, or every file of a declared folder or glob (of its layout), sorted."""
    path = task_path(cfg, task)
    return [path] if path.is_file() or not is_declared(task) else layout_files(path, task.layout)


def resolve_task_paths(cfg: Config, *, require_existing: bool) -> list[Path]:
    """Every task's data path (a declared task's may be a folder or a glob); with
    `require_existing`, a missing file that will not be generated is a `ConfigError` naming
    `data.tasks[i].path`."""
    paths = [task_path(cfg, t) for t in cfg.data.tasks]
    for i, path in enumerate(paths):
        if path.exists() and not path.is_file() and not is_declared(cfg.data.tasks[i]):
            raise ConfigError(f"data.tasks[{i}].path: {path} is a directory, not an HDF5 data file; name the file")
    if require_existing and not cfg.data.generate_if_missing:
        for i, (task, path) in enumerate(zip(cfg.data.tasks, paths)):
            if not path.is_file() and not is_declared(task):  # a declared path was read by the config
                raise ConfigError(
                    f"data.tasks[{i}].path: data file {path} for {task.name} does not exist; "
                    f"generate it with `python -m pipelines.generate --task {task.name} --out {path.parent}` "
                    f"or set data.generate_if_missing=true")
    if require_existing:
        check_generated_seeds(cfg, paths)
    return paths


def check_generated_seeds(cfg: Config, paths: list[Path]) -> None:
    """A `ConfigError` for the first generated task whose existing file was drawn with another root seed than
    the config's (`DataConfig.task_seed`): the file's name says only the task and its parameter, so another
    config (the task at another index) may have made it. One line naming the seed to set, or the file to move."""
    for i, (task, path) in enumerate(zip(cfg.data.tasks, paths)):
        if is_declared(task) or not path.is_file():
            continue
        made, wanted = generated_seed(path), cfg.data.task_seed(i)
        if made is not None and made != wanted:
            whose = "its seed" if task.seed >= 0 else f"data.seed + its index {i}"
            raise ConfigError(f"data.tasks[{i}]: {path} was generated with seed {made}, but this config draws "
                              f"{task.name} with seed {wanted} ({whose}); set seed: {made} on the task to train on "
                              f"that file, or move the file away to generate the config's own")


def require_task_file(path: Path, task_index: int) -> Path:
    """`path`, the data of task `task_index` (a file, or a declared folder or glob holding files); a
    `ConfigError` naming `data.tasks[i].path` when it is missing."""
    if path.is_dir() or is_glob(path):
        try:
            layout_files(path)
            return path
        except DataError as err:
            raise ConfigError(f"data.tasks[{task_index}].path: {err}") from None
    if not path.is_file():
        what = "is a directory, not an HDF5 data file" if path.is_dir() else "does not exist"
        raise ConfigError(f"data.tasks[{task_index}].path: {path} {what}; run `python -m entry.prepare_data "
                          f"--config CFG` or name the file")
    return path


def ensure_data(cfg: Config, *, workers: int = 1, log: Callable[[str], None] | None = None) -> list[Path]:
    """One process: generate every missing task file (when allowed) and validate all of them
    (once per version of each file); returns the paths. `log` gets a line for each task whose
    split folders The Well's split cannot use (`dropped_well_split`)."""
    paths = resolve_task_paths(cfg, require_existing=True)
    for i, (task, path) in enumerate(zip(cfg.data.tasks, paths)):
        if not path.is_file() and not is_declared(task):  # a declared folder or glob is read, never made
            written = generate_task(task.name, task.samples, path.parent, nx=task.nx, nt=task.nt,
                                    seed=cfg.data.task_seed(i), param=task.param, workers=workers,
                                    resolution=task.resolution, t_end=task.t_end or None)
            if Path(written) != path:
                raise ConfigError(f"data.tasks[{i}].path: generated {written}, but the config names {path}; "
                                  f"leave the path empty or name the PDEBench file")
            settle(path)  # just written: wait out the racy window, so the validation below is cached
        validated(path, task=task.spec)
        if log is not None and (note := dropped_well_split(cfg, i)) is not None:
            log(note)
    return paths


@contextlib.contextmanager
def data_waits(info: DistInfo) -> Iterator[Callable[[], None]]:
    """A `wait()` that returns once every rank called it, under `DATA_WAIT_S` (a gloo group of its
    own, also beside NCCL); a no-op at world size 1. Every rank must enter and wait alike."""
    if not info.distributed:
        yield lambda: None
        return

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=DATA_WAIT_S))
    try:
        yield lambda: dist.barrier(group=group)
    finally:
        dist.destroy_process_group(group)


def prepare_data_files(cfg: Config, info: DistInfo, logger, *, workers: int = 1, progress: bool = True) -> list[Path]:
    """Every rank together: generate the missing task files (when allowed), then validate and
    fingerprint each file once per version; returns the paths. A collective: every rank calls it.

    Ranks that see a data folder each solve a disjoint range of samples (`pipelines.generate.
    generate_part`) and the folder's leader merges the parts; rank 0 shows one progress bar for
    all. Refuses (`ConfigError`) a missing file that may not be generated, before writing anything.
    """
    paths = resolve_task_paths(cfg, require_existing=True)
    views = {folder: probe_storage(folder, info) for folder in sorted({p.parent for p in paths})}
    missing = [(i, task, path) for i, (task, path) in enumerate(zip(cfg.data.tasks, paths))
               if not path.is_file() and not is_declared(task)]
    tag = f"{config_hash(cfg, sections=('data',))}-{info.restart_count}"
    with data_waits(info) as wait:
        bar = tqdm(total=sum(t.samples for _, t, _ in missing), unit="sample", desc="generating data",
                   disable=not (info.is_main and show_progress(progress) and missing))
        # A listener may stall a rank here (the tests do): the others must not time out.
        hooks.before_step("data", info.rank, 0, info.restart_count)
        for i, task, path in missing:
            view = views[path.parent]
            # Rank 0 reports for its group: the parts are equal but for the last.
            generate_part(task.name, task.samples, path, view.index, view.members, tag=tag, nx=task.nx, nt=task.nt,
                          seed=cfg.data.task_seed(i), param=task.param, workers=workers, resolution=task.resolution,
                          t_end=task.t_end or None, progress=lambda k, n=view.members: bar.update(min(k * n, bar.total - bar.n)))
        bar.close()
        wait()  # every part written
        for _, task, path in missing:
            if views[path.parent].leader:
                merge_parts(path, views[path.parent].members, tag=tag)
                for stale in path.parent.glob(f".{path.name}.part*"):  # parts of an attempt that was killed
                    stale.unlink(missing_ok=True)
                logger.info(f"data: generated {path} ({task.samples} samples, {views[path.parent].members} parts)")
        wait()  # every file in place
        for task, path in zip(cfg.data.tasks, paths, strict=True):
            if views[path.parent].leader:
                for file in task_files(cfg, task):
                    settle(file)  # a file written seconds ago is fingerprinted now and then only read
                    report = validated(file, task=task.spec)
                    file_fingerprint(file)
                    if info.is_main:
                        logger.info(f"data ok: {report}")
        if info.is_main:
            for i in range(len(cfg.data.tasks)):
                if (note := dropped_well_split(cfg, i)) is not None:
                    logger.info(note)
        wait()  # validations and fingerprints cached beside every file
    return paths


def data_inputs(cfg: Config) -> dict[str, str | None]:
    """Each task's data fingerprint now, by task key: `stage_inputs`'s "data" part."""
    def data(path: Path) -> str | None:
        try:
            return data_fingerprint(path)
        except (FileNotFoundError, DataError):
            return None

    return {task_key(cfg, i): data(task_path(cfg, t)) for i, t in enumerate(cfg.data.tasks)}


def require_same_data(cfg: Config, recorded: dict[str, str | None], what: str) -> None:
    """A `DataError` naming the first task file whose fingerprint is no longer the one `recorded`
    (`data_inputs` as it was when `what` happened, e.g. "stage operator started"): a file replaced
    while a stage trained or an evaluation scored would leave a result that describes neither version."""
    now = data_inputs(cfg)
    for i, (key, fingerprint) in enumerate(now.items()):
        if key in recorded and recorded[key] != fingerprint:
            raise DataError(f"data.tasks[{i}]: {task_path(cfg, cfg.data.tasks[i])} changed since {what} "
                            f"(fingerprint {recorded[key]} -> {fingerprint}); nothing was marked complete or scored: "
                            f"leave the data files alone while a run uses them and run the command again")


def _well_rows(cfg: Config, task_index: int):
    """(rows per The Well split folder - "train", "valid", "test" - and the data's description) of
    one task; the rows are empty for a dataset without split folders."""
    task = cfg.data.tasks[task_index]
    desc = task_description(task_path(cfg, task), task.spec)
    return {name: desc.split_rows(name) for name in ("train", "valid", "test")}, desc


def task_split(cfg: Config, task_index: int, split: str):
    """(rows of `split` - "train", "val" or "test" - sorted, and the data's description) of one task: The
    Well's own split when its files sit in all three of its split folders, else as `data.split` says
    (PDEBench's: test = the first `test_fraction` of the file)."""
    rows_of, desc = _well_rows(cfg, task_index)
    s = cfg.data.split
    rows = split_of_sources(rows_of)
    if rows is None:
        rows = split_indices(desc.trajectories, test_fraction=s.test_fraction, val_fraction=s.val_fraction,
                             seed=s.seed)
    cap = cfg.data.tasks[task_index].train_trajectories
    if split == "train" and cap:
        if cap > len(rows.train):
            raise DataError(f"data.tasks[{task_index}].train_trajectories={cap}, but its training split holds "
                            f"{len(rows.train)} trajectories: lower it, or give the task more data")
        return rows.train[:cap], desc
    return getattr(rows, split), desc


def dropped_well_split(cfg: Config, task_index: int) -> str | None:
    """The line that says a task's data have some of The Well's split folders but not all three with
    trajectories, naming the missing or empty ones and the rule used instead (`data.split`); None
    when its own split is used or it has no split folders."""
    rows_of, _ = _well_rows(cfg, task_index)
    empty = [name for name, rows in rows_of.items() if not rows]
    if not any(rows_of.values()) or not empty:
        return None
    s = cfg.data.split
    return (f"data.tasks[{task_index}]: The Well's split folder(s) {', '.join(empty)} missing or empty under "
            f"{task_path(cfg, cfg.data.tasks[task_index])}, so its own split is not used: all its trajectories are "
            f"split by data.split instead (test: the first {s.test_fraction:g}; val: a seeded {s.val_fraction:g} "
            f"of the rest, seed {s.seed})")
