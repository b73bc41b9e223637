"""Registry of the PDEBench tasks we read and generate: names, files, keys, defaults.

Facts taken from PDEBench (github.com/pdebench/PDEBench):

* File names (``pdebench/data_download/pdebench_data_urls.csv``):
  ``1D_Advection_Sols_beta0.1.hdf5`` ... ``beta7.0``, ``1D_Burgers_Sols_Nu0.001.hdf5`` ...
  ``Nu4.0``, ``2D_DarcyFlow_beta0.01_Train.hdf5`` ... ``beta100.0``: the parameter is
  Python's ``str(float)`` ("0.1", "1.0", "0.001", "100.0").
* Keys (``pdebench/data_gen/data_gen_NLE/Data_Merge.py``): 1D scalar files hold ``tensor``
  [N, T, X], ``x-coordinate`` [X], ``t-coordinate`` [T + 1]; Darcy files hold ``tensor``
  [N, 1, X, Y] (the solution), ``nu`` [N, X, Y] (the coefficient), ``x-coordinate`` and
  ``y-coordinate``. PDEBench itself stores the parameter as attribute ``beta`` (advection,
  Darcy) or ``Nu`` (Burgers).
* Grids (``data_gen_NLE/AdvectionEq/advection_multi_solution_Hydra.py``): x at the cell
  centres of [0, 1]; ``t-coordinate = arange(T + 1) * dt_save`` with ``dt_save = 0.01``
  and T = 201 steps up to t = 2.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pipelines.layouts.description import DataError

__all__ = ["TaskSpec", "TASKS", "get_task", "format_param", "task_file_name", "parse_file_name", "declared_task",
           "declared_description"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskSpec:
    """One PDEBench task as stored on disk."""

    name: str
    """Our task name, e.g. ``burgers1d``."""
    spatial_dims: int
    """Number of spatial axes of the field."""
    file_pattern: str
    """PDEBench file name with a ``{param}`` placeholder."""
    param_name: str
    """Name of the PDE parameter (and of its command-line flag without dashes)."""
    pdebench_attr: str
    """Attribute under which PDEBench stores the parameter (``beta`` or ``Nu``)."""
    steady: bool
    """True when the file holds one solution per sample, not a trajectory."""
    nx: int
    """Default grid points per spatial axis (PDEBench's resolution)."""
    nt: int
    """Default stored time steps (1 for steady tasks)."""
    t_end: float
    """Default time of the last stored step (0 for steady tasks)."""
    default_param: float
    """Parameter used when none is given."""
    keys: tuple[str, ...]
    """HDF5 datasets of the file, exactly PDEBench's."""
    channels: tuple[str, ...] = ("u",)
    """The stored channels, in order (a scalar task: one)."""
    storage: str = "tensor"
    """How PDEBench's generator stores the task (the variant of the ``pdebench`` layout): ``tensor``
    (the scalar files), ``groups``, ``ns_incompressible``, or ``declared``: a user's file described by
    `declared_task`, read by its layout `source_layout`. (A file format is a *layout*:
    `pipelines.layouts`.)"""
    grid: tuple[int, ...] = ()
    """A declared task's stored points per axis (the generated tasks': ``nx`` per axis)."""
    source_layout: str = ""
    """A declared task's layout (a registered one: ``pdebench``, ``the_well``, ``hdf5`` ...)."""
    source_options: str = ""
    """A declared task's layout options, as sorted JSON (the ``hdf5`` layout's keys and axes)."""

    @property
    def file_regex(self) -> re.Pattern[str]:
        head, tail = self.file_pattern.split("{param}")
        return re.compile(re.escape(head) + r"(?P<param>[0-9][0-9.eE+-]*)" + re.escape(tail))


def _navier_stokes(name: str, forcing: str) -> TaskSpec:
    """A Navier-Stokes flow of `pipelines.flows` (``ns_incom_<forcing>_2d_nu{param}.h5``): one
    layout and field set, its forcing named in the file."""
    return TaskSpec(name=name, spatial_dims=2, file_pattern=f"ns_incom_{forcing}_2d_nu{{param}}.h5", param_name="nu",
                    pdebench_attr="nu", steady=False, nx=64, nt=51, t_end=50.0, default_param=1e-3,
                    keys=("vorticity", "velocity", "t"), channels=("vorticity", "velocity_x", "velocity_y"),
                    storage="ns_incompressible")


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec(name="advection1d", spatial_dims=1, file_pattern="1D_Advection_Sols_beta{param}.hdf5",
                 param_name="beta", pdebench_attr="beta", steady=False, nx=1024, nt=201, t_end=2.0,
                 default_param=0.1, keys=("tensor", "x-coordinate", "t-coordinate")),
        TaskSpec(name="burgers1d", spatial_dims=1, file_pattern="1D_Burgers_Sols_Nu{param}.hdf5",
                 param_name="nu", pdebench_attr="Nu", steady=False, nx=1024, nt=201, t_end=2.0,
                 default_param=0.001, keys=("tensor", "x-coordinate", "t-coordinate")),
        TaskSpec(name="darcy2d", spatial_dims=2, file_pattern="2D_DarcyFlow_beta{param}_Train.hdf5",
                 param_name="darcy_beta", pdebench_attr="beta", steady=True, nx=128, nt=1, t_end=0.0,
                 default_param=1.0, keys=("tensor", "nu", "x-coordinate", "y-coordinate")),
        # The 2D flows of `pipelines.flows`, in the pattern of PDEBench's names for the family (its
        # "NA" slots hold our parameter; PDEBench's NS files name resolution and seed instead).
        _navier_stokes("ns2d", "inhom"),
        _navier_stokes("ns2d_kolmogorov", "kolmogorov"),
        *(_navier_stokes(f"ns2d_kolmogorov_k{k}", f"kolmogorov_k{k}") for k in (1, 2, 3)),
        _navier_stokes("ns2d_decaying", "decaying"),
        TaskSpec(name="swe2d", spatial_dims=2, file_pattern="2D_rdb_g{param}_NA.h5", param_name="gravity",
                 pdebench_attr="gravity", steady=False, nx=64, nt=101, t_end=1.0, default_param=1.0,
                 keys=("data",), channels=("height", "velocity_x", "velocity_y"), storage="groups"),
        TaskSpec(name="dr2d", spatial_dims=2, file_pattern="2D_diff-react_k{param}_NA.h5", param_name="k",
                 pdebench_attr="k", steady=False, nx=64, nt=101, t_end=5.0, default_param=5e-3,
                 keys=("data",), channels=("activator", "inhibitor"), storage="groups"),
        TaskSpec(name="allen_cahn2d", spatial_dims=2, file_pattern="2D_allen-cahn_d{param}_NA.h5", param_name="d",
                 pdebench_attr="d", steady=False, nx=64, nt=101, t_end=5.0, default_param=1e-3,
                 keys=("data",), channels=("phase",), storage="groups"),
        # The Well's spacing, every 10 time units (its 1001 frames to t = 10000, here the first 41)
        TaskSpec(name="gray_scott2d", spatial_dims=2, file_pattern="2D_gray-scott_k{param}_NA.h5", param_name="k",
                 pdebench_attr="k", steady=False, nx=64, nt=41, t_end=400.0, default_param=0.057,
                 keys=("data",), channels=("concentration_a", "concentration_b"), storage="groups"),
    )
}


def get_task(name: str) -> TaskSpec:
    """The spec of task `name`; `ValueError` listing the known tasks otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}") from None


def format_param(param: float) -> str:
    """PDEBench's spelling of a parameter in a file name: ``str(float)`` ("0.1", "1.0", "0.001")."""
    return str(float(param))


def task_file_name(task: str | TaskSpec, param: float) -> str:
    """PDEBench's file name for `task` at `param`, e.g. ``1D_Burgers_Sols_Nu0.001.hdf5``."""
    spec = task if isinstance(task, TaskSpec) else get_task(task)
    return spec.file_pattern.format(param=format_param(param))


def parse_file_name(file_name: str) -> tuple[TaskSpec, float] | None:
    """(spec, param) if `file_name` (no folder) follows a PDEBench pattern, else None."""
    for spec in TASKS.values():
        match = spec.file_regex.fullmatch(file_name)
        if match:
            try:
                return spec, float(match["param"])
            except ValueError:
                return None
    return None


def declared_description(path: str | os.PathLike, layout: str, options: Mapping | None = None):
    """The `DatasetDescription` of a user's dataset at `path` (a file, folder or glob; ``$VAR`` and
    ``~`` expanded) read by `layout` with `options`, from metadata (kept per version of the file).

    Raises:
        DataError: the file is missing, the layout cannot read it, or it holds more than one task.
    """
    from pipelines.layouts import describe

    full = Path(os.path.expandvars(os.path.expanduser(str(path))))
    descs = describe(full, layout, options=json.loads(json.dumps(dict(options or {}), sort_keys=True)))
    if len(descs) != 1:
        raise DataError(f"{path}: holds {len(descs)} tasks ({', '.join(d.identity for d in descs)}); "
                        f"name one file or folder per task")
    return descs[0]


def declared_task(path: str | os.PathLike, layout: str, options: Mapping | None = None, *, name: str = "") -> TaskSpec:
    """The spec of a user's dataset at `path` (a file; ``$VAR`` and ``~`` expanded) read by `layout`
    (``auto``, ``pdebench``, ``the_well``, ``hdf5`` with `options`): its dimension, grid, steps and
    channels come from the data, read from metadata (once per version of the file: `describe` keeps
    what it read).

    Raises:
        DataError: the file is missing or the layout cannot read it (naming the file and the key).
    """
    d = declared_description(path, layout, options)
    options = json.dumps(dict(options or {}), sort_keys=True)
    return TaskSpec(name=name or d.identity, spatial_dims=d.dims, file_pattern="", param_name="", pdebench_attr="",
                    steady=d.steady, nx=d.grid.shape[0], nt=d.steps, t_end=float(d.times[-1]) if d.times is not None
                    else 0.0, default_param=0.0, keys=(), channels=d.channels, storage="declared",
                    grid=d.grid.shape, source_layout=d.layout, source_options=options)

