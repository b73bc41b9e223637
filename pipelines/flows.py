# long file: one generator for the 2D flows: their specs, the per-sample draws, the solve and both file layouts
"""Generate the 2D flows (``ns2d``, ``ns2d_kolmogorov[_k1|_k2|_k3]``, ``ns2d_decaying``, ``swe2d``, ``dr2d``,
``allen_cahn2d``, ``gray_scott2d``) in PDEBench's or The Well's layout:
``python -m pipelines.generate --task swe2d --samples 64 --out data/``.

Legend: N samples, K samples of one work chunk, T stored steps, X/Y stored grid points, C channels.

Each flow's solver lives in `pipelines.solvers` and is verified there; this module draws the
initial states (sample ``i`` from child ``i`` of ``np.random.SeedSequence(seed)``, in numpy,
whatever the device), solves chunks of samples on CPU worker processes or on CUDA through torch,
and writes:

* ``--layout pdebench`` (default), the layout PDEBench publishes for the family, named in the
  pattern of its names with our parameter in its ``NA`` slot (`pipelines.tasks`):
  shallow water and diffusion-reaction (Allen-Cahn, Gray-Scott too) as per-sample groups ``0000/data`` [T, X, Y, C] with
  ``0000/grid/{x,y,t}`` (``2D_rdb_g1.0_NA.h5``, ``2D_diff-react_k0.005_NA.h5``; our files add the
  attribute ``channel_names`` because ours store more channels than PDEBench's height-only
  shallow water); Navier-Stokes as PDEBench's incompressible files, ``velocity`` [N, T, X, Y, 2]
  and ``t`` [N, T], with ``vorticity`` [N, T, X, Y] and ``x-``/``y-coordinate`` added (the forcing
  is one fixed field, recorded in the attributes, so no per-sample ``force`` is stored).
* ``--layout the_well``: ``<out>/<dataset>/data/{train,valid,test}/<dataset>.hdf5``, the first
  10% of the samples as test and the next 10% as validation (PDEBench's test convention).

Every file records its solver, resolutions, seed and parameters in attributes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pipelines.pdebench_io import GENERATOR
from pipelines.tasks import TaskSpec, get_task, task_file_name
from pipelines.work_pool import run_in_workers
from pipelines.writer_lock import writing

__all__ = ["FlowSpec", "FLOWS", "generate_flow", "flow_file_name", "LAYOUTS_WRITTEN"]

LAYOUTS_WRITTEN = ("pdebench", "the_well")


@dataclass(frozen=True, kw_only=True)
class FlowSpec:
    """How one 2D flow is solved; what its files hold (channels, stored sizes, file name, its main
    parameter) is its `pipelines.tasks.TaskSpec`, `task`."""

    name: str
    module: str
    """The solver module in `pipelines.solvers`."""
    draw: str
    """The function of `module` that draws one sample's start: ``(rng, resolution[, forcing=])`` -> float64
    array on the solve's grid."""
    solve: str
    """The function of `module` that solves a batch of starts: ``(start, times, *, stored_resolution,
    **params[, forcing=])`` -> [B, T, X, Y, C] on the stored grid; ``params`` are its keywords."""
    resolution: int
    """Grid points per axis of the solve (a multiple of the stored ``task.nx``)."""
    domain: tuple[float, float]
    params: dict[str, float] = field(default_factory=dict)
    """PDE constants passed to the solver and recorded in the file (the task's parameter among them)."""
    periodic: bool = False
    forcing: str = ""
    """Navier-Stokes: its forcing (``fno``, ``kolmogorov`` or ``decaying``, `pipelines.solvers.ns2d`); empty for the
    finite-volume flows."""

    @property
    def navier_stokes(self) -> bool:
        """Solved spectrally on grid nodes and stored in PDEBench's incompressible-NS layout."""
        return bool(self.forcing)

    def draw_function(self) -> Callable[..., np.ndarray]:
        """`draw` of the solver module: ``(rng, resolution)`` -> one start (the forcing bound)."""
        return self._function(self.draw)

    def solve_function(self) -> Callable[..., Any]:
        """`solve` of the solver module: ``(starts, times, *, stored_resolution, **params)`` -> the solved
        frames (the forcing bound)."""
        return self._function(self.solve)

    def _function(self, name: str):
        import importlib

        function = getattr(importlib.import_module(self.module), name)
        return functools.partial(function, forcing=self.forcing) if self.navier_stokes else function

    @property
    def task(self) -> TaskSpec:
        return get_task(self.name)

    @property
    def fields(self) -> tuple[str, ...]:
        return self.task.channels


_NS2D = dict(module="pipelines.solvers.ns2d", draw="draw_ns2d_initial", solve="solve_ns2d", resolution=256,
             periodic=True)

FLOWS: dict[str, FlowSpec] = {s.name: s for s in (
    # The FNO paper's benchmark (Li et al. 2021): nu 1e-3, solved at 256 and stored at 64, T = 50.
    FlowSpec(name="ns2d", **_NS2D, domain=(0.0, 1.0), params={"nu": 1e-3}, forcing="fno"),
    # PDE-Refiner's Kolmogorov flow (jax-cfd): sin(4y) forcing on [0, 2 pi]^2, after a spin-up.
    FlowSpec(name="ns2d_kolmogorov", **_NS2D, domain=(0.0, 2 * math.pi), params={"nu": 1e-3, "spinup": 10.0},
             forcing="kolmogorov"),
    # The same square, drag and start forced by sin(k y), k = 1, 2, 3: forced flows of other forcing than
    # the Kolmogorov flow's, for issue 50's mixture.
    *(FlowSpec(name=f"ns2d_kolmogorov_k{k}", **_NS2D, domain=(0.0, 2 * math.pi),
               params={"nu": 1e-3, "spinup": 10.0}, forcing=f"kolmogorov_k{k}") for k in (1, 2, 3)),
    # The Kolmogorov flow's square, drag and start, unforced: decaying turbulence at its scales. One
    # time unit of spin-up keeps its frames changing about as fast as the Kolmogorov flow's (one-step
    # persistence error 0.17 against 0.24 at 16 x 16, 0.2 apart; after 10 units, 0.06): the transfer
    # mixture's Navier-Stokes with another forcing than the held-out flow's.
    FlowSpec(name="ns2d_decaying", **_NS2D, domain=(0.0, 2 * math.pi), params={"nu": 1e-3, "spinup": 1.0},
             forcing="decaying"),
    # PDEBench's radial dam break: [-2.5, 2.5]^2, 128 x 128, 101 steps to t = 1.
    FlowSpec(name="swe2d", module="pipelines.solvers.swe2d", draw="draw_dam_break", solve="solve_swe2d",
             resolution=128, domain=(-2.5, 2.5), params={"gravity": 1.0}),
    # PDEBench's FitzHugh-Nagumo diffusion-reaction: [-1, 1]^2, 128 x 128, 101 steps to t = 5.
    FlowSpec(name="dr2d", module="pipelines.solvers.dr2d", draw="draw_dr_initial", solve="solve_dr2d",
             resolution=128, domain=(-1.0, 1.0), params={"du": 1e-3, "dv": 5e-3, "k": 5e-3}),
    # Allen-Cahn on diffusion-reaction's square, grid and start: its activator's bistable reaction and
    # diffusion (D = Du) alone, one field; the reaction-diffusion member of issue 50's mixture.
    FlowSpec(name="allen_cahn2d", module="pipelines.solvers.dr2d", draw="draw_allen_cahn_initial",
             solve="solve_allen_cahn", resolution=128, domain=(-1.0, 1.0), params={"d": 1e-3}),
    # The Well's Gray-Scott "maze" (f, k) on diffusion-reaction's square and walls, its diffusion ten times
    # The Well's: the maze's stripes (~0.16 wide at its coefficients, ten cells of its 128 grid) become
    # ~0.5 wide, four cells of a 16 x 16 storage; a two-species member of issue 50's reaction mixture.
    FlowSpec(name="gray_scott2d", module="pipelines.solvers.gray_scott", draw="draw_gray_scott_initial",
             solve="solve_gray_scott", resolution=128, domain=(-1.0, 1.0),
             params={"da": 2e-4, "db": 1e-4, "f": 0.029, "k": 0.057}),
)}


def flow_file_name(spec: FlowSpec, params: dict[str, float]) -> str:
    """The file name of the flow at these parameters (its task's pattern and parameter)."""
    return task_file_name(spec.task, params[spec.task.param_name])


def _sample_rngs(seed: int, start: int, stop: int) -> list[np.random.Generator]:
    return [np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(i,))) for i in range(start, stop)]


def solve_chunk(spec: FlowSpec, start: int, stop: int, *, resolution: int, stored: int, steps: int, t_end: float,
                seed: int, params: dict[str, float], device: str = "cpu") -> tuple[int, np.ndarray]:
    """(start, [K, T, X, Y, C] float32) for samples ``start .. stop``; runnable in a worker process."""
    import torch

    draw = spec.draw_function()
    x0 = np.stack([draw(r, resolution) for r in _sample_rngs(seed, start, stop)])
    x0_t = torch.from_numpy(x0).to(device=device, dtype=torch.float64)
    times = np.linspace(0.0, t_end, steps)
    out = spec.solve_function()(x0_t, times, stored_resolution=stored, **params)
    # .cpu() waits for the device: the one sync per chunk outside the solver's own.
    return start, out.to(torch.float32).cpu().numpy()


def _stored_coords(spec: FlowSpec, stored: int) -> np.ndarray:
    lo, hi = spec.domain
    if spec.navier_stokes:  # the spectral grid's nodes, x_i = lo + i h (FNO's convention)
        return lo + (hi - lo) * np.arange(stored) / stored
    return lo + (hi - lo) * (np.arange(stored) + 0.5) / stored  # finite volumes: cell centres


def _attrs(spec: FlowSpec, *, resolution, stored, seed, samples, params, device) -> dict:
    return {"generator": GENERATOR, "task": spec.name, "solver": spec.module, "seed": seed,
            "resolution": resolution, "stored_resolution": stored, "samples": samples, "device": device,
            "channel_names": list(spec.fields), "periodic": spec.periodic, **params}


class _PDEBenchOut:
    """Writes solved chunks into PDEBench's layout of the family (an open temporary HDF5 file)."""

    def __init__(self, f: h5py.File, spec: FlowSpec, n: int, stored: int, times: np.ndarray):
        self.f, self.spec, self.times = f, spec, times
        coords = _stored_coords(spec, stored)
        self.ns = spec.navier_stokes
        if self.ns:
            shape = (n, len(times), stored, stored)
            f.create_dataset("vorticity", shape=shape, dtype=np.float32, chunks=(1, *shape[1:]))
            f.create_dataset("velocity", shape=(*shape, 2), dtype=np.float32, chunks=(1, *shape[1:], 2))
            f.create_dataset("t", data=np.tile(times, (n, 1)))
            f.create_dataset("x-coordinate", data=coords)
            f.create_dataset("y-coordinate", data=coords)
        self.coords = coords

    def write(self, start: int, u_KTXYC: np.ndarray) -> None:
        k = u_KTXYC.shape[0]
        if self.ns:
            self.f["vorticity"][start:start + k] = u_KTXYC[..., 0]
            self.f["velocity"][start:start + k] = u_KTXYC[..., 1:3]
            return
        for i in range(k):
            g = self.f.create_group(f"{start + i:04d}")
            g.create_dataset("data", data=u_KTXYC[i])
            g.create_dataset("grid/x", data=self.coords)
            g.create_dataset("grid/y", data=self.coords)
            g.create_dataset("grid/t", data=self.times)


def _write_well(out_dir: Path, spec: FlowSpec, u_NTXYC: np.ndarray, times, stored, attrs) -> Path:
    from pipelines.layouts.fields_from import fields_from_channels
    from pipelines.layouts.to_the_well import well_fields, write_well_dataset

    coords = _stored_coords(spec, stored)
    params = {k: float(v) for k, v in attrs.items() if k in spec.params}
    fields = well_fields(fields_from_channels(spec.fields, ("x", "y")), u_NTXYC, where=spec.name)
    return write_well_dataset(out_dir, spec.name, spec.name, fields, axes=("x", "y"),
                              coords=(coords, coords), times=times, periodic=(spec.periodic, spec.periodic),
                              parameters=params, attrs={k: v for k, v in attrs.items() if k not in params})


# long: argument checks, the work list, the solve loop and both writers read best in one place
def generate_flow(task: str, samples: int, out_dir, *, resolution: int | None = None, stored: int | None = None,
                  steps: int | None = None, t_end: float | None = None, seed: int = 0, workers: int = 1,
                  chunk: int = 8, device: str = "cpu", layout: str = "pdebench",
                  progress: Callable[[int], None] | None = None, params: dict[str, float] | None = None,
                  out_file: Path | None = None) -> Path:
    """Generate `samples` trajectories of flow `task` into `out_dir`; returns the file (PDEBench
    layout) or the dataset folder (The Well layout).

    Args:
        resolution / stored / steps / t_end: the solve's grid, the stored grid, the stored steps (t = 0
            included) and the last time; default the flow's (`FLOWS`).
        seed: root of the per-sample draws. workers: CPU processes. chunk: samples per unit of work.
        device: ``cpu`` or ``cuda`` (resolved by the caller). layout: ``pdebench`` or ``the_well``.
        params: PDE constants overriding the flow's defaults (e.g. ``{"nu": 1e-4}``).
        out_file: the PDEBench-layout file to write instead of ``out_dir/<its name>`` (a part file).
    Raises:
        ValueError: a bad argument, before anything is written.
    """
    spec = FLOWS[task]
    resolution, stored = resolution or spec.resolution, stored or spec.task.nx
    steps, t_end = steps or spec.task.nt, spec.task.t_end if t_end is None else float(t_end)
    merged = {**spec.params, **(params or {})}
    unknown = sorted(set(merged) - set(spec.params))
    if unknown:
        raise ValueError(f"{task} has no parameter {', '.join(unknown)}; its parameters: {', '.join(spec.params)}")
    if samples < 1 or steps < 2 or not t_end > 0 or chunk < 1 or workers < 1:
        raise ValueError(f"need samples >= 1, steps >= 2, t_end > 0, chunk >= 1, workers >= 1; got {samples}, "
                         f"{steps}, {t_end}, {chunk}, {workers}")
    if stored < 4 or resolution % stored:
        raise ValueError(f"the solve's resolution ({resolution}) must be a multiple of the stored one ({stored} >= 4)")
    if layout not in LAYOUTS_WRITTEN:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS_WRITTEN)}, got {layout!r}")
    times = np.linspace(0.0, t_end, steps)
    attrs = _attrs(spec, resolution=resolution, stored=stored, seed=seed, samples=samples, params=merged,
                   device=device)
    kw = dict(resolution=resolution, stored=stored, steps=steps, t_end=t_end, seed=seed, params=merged)
    jobs = [(spec, s, min(s + chunk, samples)) for s in range(0, samples, chunk)]
    if device == "cuda":
        results = (solve_chunk(*job, device=device, **kw) for job in jobs)
    else:
        results = run_in_workers(_SolveJob(kw), jobs, workers)
    out_dir = Path(out_dir)
    if layout == "the_well":
        u = np.empty((samples, steps, stored, stored, len(spec.fields)), np.float32)
        for start, part in results:
            u[start:start + part.shape[0]] = part
            if progress is not None:
                progress(part.shape[0])
        return _write_well(out_dir, spec, u, times, stored, attrs)
    path = Path(out_file) if out_file is not None else out_dir / flow_file_name(spec, merged)
    with writing(path) as temp, h5py.File(temp, "w") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        sink = _PDEBenchOut(f, spec, samples, stored, times)
        for start, part in results:
            sink.write(start, part)
            if progress is not None:
                progress(part.shape[0])
    return path


@dataclass(frozen=True)
class _SolveJob:
    """`solve_chunk` with its keyword arguments bound: picklable for the worker processes."""

    kw: dict

    def __call__(self, spec: FlowSpec, start: int, stop: int) -> tuple[int, np.ndarray]:
        return solve_chunk(spec, start, stop, device="cpu", **self.kw)
