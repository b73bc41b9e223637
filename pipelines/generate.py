# long file: one command: per-task generators share its work chunks, parts and merge
"""Generate PDEBench-format training data: ``python -m pipelines.generate``.

Legend: N samples, K samples of one work chunk, T time steps, X, Y grid points.

``python -m pipelines.generate --task burgers1d --samples 2000 --out data/ [--nu 0.001]``
writes ``data/1D_Burgers_Sols_Nu0.001.hdf5`` with PDEBench's keys, shapes and defaults
(1D: 1024 cell centres of [0, 1], 201 steps of 0.01 up to t = 2; Darcy: 128 x 128).

Determinism: sample ``i`` draws its initial condition (or Darcy coefficient) from child
``i`` of ``np.random.SeedSequence(seed)``, in numpy on every device, and the solvers run
on fixed blocks of `SOLVE_BLOCK` samples (Burgers takes one CFL step size per block), so
on CPU the file is the same bytes for any ``--chunk``; torch's FFT rounds differently at other thread
counts, so across ``--workers`` (1 thread per worker) only where torch also ran 1 thread
(bench/results/cpu-2core-2026-12-04-generation-threads.md). Across CPUs: the draws' exp and power go
through ``pipelines.solvers.libm``, not numpy's AVX-512 code
(bench/results/cpu-2core-2026-12-04-generation-cpu.md), and the solvers run in workers whose MKL is
pinned to the code it runs on AMD CPUs (``pipelines.work_pool``), so the ns2d race file is the same
bytes on AMD Zen 1, Zen 4 and an Intel Xeon with AVX-512 at the same thread count
(bench/results/cpu-2core-2026-12-05-generation-intel.md). Memory stays bounded: at most
``2 * workers`` chunks are in flight, and each is written as soon as it is its turn.

Devices: ``--device auto`` (the default) solves on CUDA when ``torch.cuda.is_available()``,
else on CPU. On CPU the solvers run in ``--workers`` processes (numpy advection, torch
Burgers, scipy sparse LU for Darcy). On CUDA everything runs in this process on chunks
of `CUDA_CHUNK` samples: torch FFT advection, `solve_burgers_blocks` (the per-block step
sizes of the CPU path, all blocks in one batch, eager) and batched PCG for Darcy
(`solve_darcy_cg`, relative residual 1e-10). On CPU these torch paths reproduce the CPU
solvers to ~1e-13 in float64; on CUDA, rounding differs (FFT, GEMM, reductions), so a
CUDA file may differ from a CPU file, or from a CUDA file with another ``--chunk``, in
the last bits of the float32 values.

Timing (the seconds taken; compare with ``--device cpu --workers 16`` on the same machine)::

    time python -m pipelines.generate --task darcy2d --samples 10000 --out /tmp/gen --device cuda --no-progress

Several processes (entry.data.files's ranks) make one file together: each writes a part with
`generate_part` (disjoint sample ranges from `part_rows`, aligned to `SOLVE_BLOCK`, so the
bytes equal one process's), then one calls `merge_parts`. Nothing here touches
``torch.distributed``; the caller waits for the parts.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

from pipelines.atomic import publish
from pipelines.pdebench_io import GENERATOR, GENERATOR_VERSION, DataError, PDEBenchWriter
from pipelines.flows import FLOWS, LAYOUTS_WRITTEN, generate_flow
from pipelines.work_pool import run_in_workers
from pipelines.writer_lock import WriterBusy
from pipelines.tasks import TASKS, TaskSpec, get_task, task_file_name

__all__ = ["generate_task", "generate_part", "generated_seed", "merge_parts", "part_rows", "part_file", "main",
           "resolve_device", "SOLVE_BLOCK", "MIN_NX", "CUDA_CHUNK", "DEVICES"]

SOLVE_BLOCK = 32
"""Samples solved together; fixed so results do not depend on --chunk or --workers."""
MIN_NX = 8
DEFAULT_CHUNK = 256
CUDA_CHUNK = 4096
"""Default chunk on CUDA: 4096 x 201 x 1024 float32 is 3.4 GB of output per chunk on the GPU
(Darcy at 128 x 128: ~6 GB of CG vectors), and the batch is large enough to fill an H100."""
DEVICES = ("auto", "cpu", "cuda")

_SOLVERS = {
    "advection1d": "pipelines.solvers.advection.solve_advection",
    "burgers1d": "pipelines.solvers.burgers.solve_burgers",
    "darcy2d": "pipelines.solvers.darcy.solve_darcy",
}
_MERGE_BYTES = 256 << 20
"""Bytes copied per read when parts are merged (bounded memory for any file size)."""
_CUDA_SOLVERS = {  # recorded in the file's "solver" attribute, so a file says which path made it
    "advection1d": "pipelines.solvers.advection.solve_advection",
    "burgers1d": "pipelines.solvers.burgers.solve_burgers_blocks",
    "darcy2d": "pipelines.solvers.darcy.solve_darcy_cg",
}


def _cell_centres(n: int) -> np.ndarray:
    """PDEBench's x-coordinate: the cell centres of [0, 1]."""
    return (np.arange(n) + 0.5) / n


def _times(nt: int, t_end: float) -> np.ndarray:
    """PDEBench's t-coordinate, [T + 1]: ``arange(T + 1) * dt`` (one time past the last step)."""
    return np.arange(nt + 1) * (t_end / (nt - 1))


def _sample_rngs(seed: int, start: int, stop: int) -> list[np.random.Generator]:
    # SeedSequence(seed, spawn_key=(i,)) is child i of SeedSequence(seed).spawn(...).
    return [np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(i,))) for i in range(start, stop)]


def _draw_inputs(task: str, start: int, stop: int, nx: int, seed: int) -> np.ndarray:
    """Float32 inputs of samples ``start .. stop``: Darcy coefficients [K, X, Y], else u0 [K, X].

    Drawn in numpy from each sample's own generator, whatever device then solves.
    """
    from pipelines.solvers import initial_conditions as ic

    rngs = _sample_rngs(seed, start, stop)
    if task == "darcy2d":
        return np.concatenate([ic.darcy_coefficient(1, nx, rng=r) for r in rngs])
    # period = domain length: exactly periodic initial conditions (PDEBench's init_multi uses
    # x[-1] - x[0], one cell short, which leaves a small jump at the periodic boundary).
    return np.concatenate([ic.sine_superposition(1, _cell_centres(nx), rng=r, period=1.0) for r in rngs])


def _solve_chunk(task: str, param: float, start: int, stop: int, nx: int, nt: int, t_end: float,
                 seed: int) -> tuple[int, np.ndarray, np.ndarray | None]:
    """Samples ``start .. stop`` on CPU: (start, tensor [K, T, X] or [K, 1, X, Y], nu [K, X, Y] or None)."""
    if task == "darcy2d":
        from pipelines.solvers.darcy import solve_darcy

        a_KXY = _draw_inputs(task, start, stop, nx, seed)
        return start, solve_darcy(a_KXY, param)[:, None].astype(np.float32), a_KXY.astype(np.float32)
    u0_KX = _draw_inputs(task, start, stop, nx, seed)
    t_T = _times(nt, t_end)[:nt]
    if task == "advection1d":
        from pipelines.solvers.advection import solve_advection

        return start, solve_advection(u0_KX, param, t_T, length=1.0), None
    from pipelines.solvers.burgers import solve_burgers

    blocks = [solve_burgers(u0_KX[b:b + SOLVE_BLOCK], param, t_T, length=1.0, chunk=SOLVE_BLOCK)
              for b in range(0, stop - start, SOLVE_BLOCK)]
    return start, np.concatenate(blocks).astype(np.float32), None


def _solve_chunk_torch(device: str, task: str, param: float, start: int, stop: int, nx: int, nt: int,
                       t_end: float, seed: int) -> tuple[int, np.ndarray, np.ndarray | None]:
    """`_solve_chunk` with the torch solvers on ``device`` (in this process); same return."""
    import torch

    from pipelines.solvers.advection import solve_advection
    from pipelines.solvers.burgers import solve_burgers_blocks
    from pipelines.solvers.darcy import solve_darcy_cg

    inputs = _draw_inputs(task, start, stop, nx, seed)
    x = torch.from_numpy(inputs).to(device=device, dtype=torch.float64)
    if task == "darcy2d":
        u = solve_darcy_cg(x, param)[:, None]
    elif task == "advection1d":
        u = solve_advection(x, param, _times(nt, t_end)[:nt], length=1.0)
    else:
        # Per-block step sizes, as the CPU path's separate solve_burgers calls take them.
        u = solve_burgers_blocks(x, param, _times(nt, t_end)[:nt], block=SOLVE_BLOCK, length=1.0)
    # .cpu() waits for the device: the one sync per chunk outside the solvers' own.
    return start, u.cpu().numpy(), inputs.astype(np.float32) if task == "darcy2d" else None


def resolve_device(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` for ``device`` in `DEVICES`; `ValueError` if CUDA is asked for but absent."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        return "cpu"  # without importing torch: the CPU path does not need it in this process
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if device == "cuda":
        raise ValueError("--device cuda (device='cuda') was asked for, but torch.cuda.is_available() is "
                         "False; use --device cpu or auto")
    return "cpu"


def check_arguments(task: str, samples: int, *, nx: int, nt: int, param: float, workers: int, chunk: int,
                    t_end: float) -> TaskSpec:
    """`ValueError` naming the first bad argument; the task's spec otherwise."""
    spec = get_task(task)
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if nx < MIN_NX:
        raise ValueError(f"nx must be >= {MIN_NX}, got {nx}")
    if not spec.steady and nt < 2:
        raise ValueError(f"nt must be >= 2, got {nt}")
    if not spec.steady and not (math.isfinite(t_end) and t_end > 0):
        raise ValueError(f"t_end must be > 0, got {t_end}")
    if not (math.isfinite(param) and param > 0):
        raise ValueError(f"{spec.param_name} must be a finite number > 0, got {param}")
    if workers < 1 or chunk < 1:
        raise ValueError(f"workers and chunk must be >= 1, got {workers}, {chunk}")
    return spec


def _resolve(task: str, samples: int, *, nx, nt, param, workers, chunk, t_end, device):
    """Defaults filled in and checked: (spec, device, chunk, nx, nt, t_end, param)."""
    spec = get_task(task)
    device = resolve_device(device)
    if chunk is None:
        chunk = CUDA_CHUNK if device == "cuda" else DEFAULT_CHUNK
    nx = spec.nx if nx is None else int(nx)
    nt = spec.nt if nt is None or spec.steady else int(nt)
    t_end = spec.t_end if t_end is None else float(t_end)
    param = spec.default_param if param is None else float(param)
    check_arguments(task, samples, nx=nx, nt=nt, param=param, workers=workers, chunk=chunk, t_end=t_end)
    return spec, device, chunk, nx, nt, t_end, param


def _write_rows(out_path: Path, task: str, samples: int, rows: tuple[int, int], *, nx, nt, seed, param, workers,
                chunk, t_end, device, progress: Callable[[int], None] | None) -> Path:
    """Solve samples ``rows[0] .. rows[1]`` of a `samples`-sample file into `out_path` (atomically)."""
    spec, device, chunk, nx, nt, t_end, param = _resolve(task, samples, nx=nx, nt=nt, param=param, workers=workers,
                                                          chunk=chunk, t_end=t_end, device=device)
    start, stop = rows
    if not (0 <= start < stop <= samples and start % SOLVE_BLOCK == 0):
        raise ValueError(f"rows [{start}, {stop}) must lie in [0, {samples}) and start at a multiple of "
                         f"{SOLVE_BLOCK} (the solvers' block)")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if spec.steady:
        coords = dict(x_coordinate=_cell_centres(nx), y_coordinate=_cell_centres(nx))
    else:
        coords = dict(x_coordinate=_cell_centres(nx), t_coordinate=_times(nt, t_end))
    attrs = {spec.pdebench_attr: param, "task": task, "param": param, "seed": seed,
             "solver": (_CUDA_SOLVERS if device == "cuda" else _SOLVERS)[task], "generator": GENERATOR,
             "generator_version": GENERATOR_VERSION}
    # Chunks start at multiples of SOLVE_BLOCK from `start` (itself one): the same blocks, hence the
    # same bytes, as one process writing the whole file.
    step = math.ceil(chunk / SOLVE_BLOCK) * SOLVE_BLOCK
    jobs = [(task, param, s, min(s + step, stop), nx, nt, t_end, seed) for s in range(start, stop, step)]
    if device == "cuda":
        if workers != 1:
            warnings.warn(f"workers={workers} is ignored on CUDA: chunks are solved in this process",
                          stacklevel=3)
        results = (_solve_chunk_torch(device, *job) for job in jobs)
    else:
        results = run_in_workers(_solve_chunk, jobs, workers)
    with PDEBenchWriter(out_path, task, n_samples=stop - start, attrs=attrs, **coords) as writer:
        for first, tensor, nu in results:
            writer.write(first - start, tensor, nu)
            if progress is not None:
                progress(tensor.shape[0])
    return out_path


def generate_task(task: str, samples: int, out_dir, *, nx: int | None = None, nt: int | None = None,
                  seed: int = 0, param: float | None = None, workers: int = 1, chunk: int | None = None,
                  t_end: float | None = None, progress: bool = False, device: str = "auto",
                  resolution: int | None = None) -> Path:
    """Generate `samples` samples of `task` into ``out_dir/<PDEBench file name>``; returns that path.

    Args:
        task: ``advection1d``, ``burgers1d`` or ``darcy2d``.
        samples: N >= 1.
        out_dir: folder (created if missing).
        nx: grid points per axis (default PDEBench's: 1024, Darcy 128).
        nt: stored time steps (default 201); ignored for the steady Darcy task.
        seed: root of every random draw (see the module docstring).
        param: advection beta, Burgers nu or Darcy beta (default: the task's default).
        workers: worker processes on CPU (1: one, at this process's thread count); ignored on CUDA.
        chunk: samples per unit of work, rounded up to a multiple of `SOLVE_BLOCK`
            (default `DEFAULT_CHUNK` on CPU, `CUDA_CHUNK` on CUDA).
        t_end: time of the last step (default 2.0).
        progress: show a tqdm bar.
        device: ``auto`` (CUDA if available), ``cpu`` or ``cuda`` (see the module docstring).
        resolution: the 2D flows' solve grid per axis (default the flow's; see `pipelines.flows`).

    Raises:
        ValueError: a bad argument (also ``device="cuda"`` without CUDA), before anything
            is written.
    """
    from tqdm import tqdm

    spec = get_task(task)
    param_value = spec.default_param if param is None else float(param)
    if task in FLOWS:
        with tqdm(total=samples, unit="sample", desc=task, disable=not progress) as bar:
            return generate_flow(task, samples, out_dir, resolution=resolution or None, stored=nx, steps=nt,
                                 t_end=t_end, seed=seed, workers=workers, device=resolve_device(device),
                                 progress=bar.update, params={spec.param_name: param_value})
    out_path = Path(out_dir) / task_file_name(spec, param_value)
    check_arguments(task, samples, nx=spec.nx if nx is None else nx, nt=spec.nt if nt is None or spec.steady else nt,
                    param=param_value, workers=workers, chunk=DEFAULT_CHUNK if chunk is None else chunk,
                    t_end=spec.t_end if t_end is None else t_end)
    with tqdm(total=samples, unit="sample", desc=task, disable=not progress) as bar:
        return _write_rows(out_path, task, samples, (0, samples), nx=nx, nt=nt, seed=seed, param=param_value,
                           workers=workers, chunk=chunk, t_end=t_end, device=device, progress=bar.update)


def generated_seed(path: str | os.PathLike) -> int | None:
    """The root seed HDF5 file ``path`` was generated with (its ``seed`` attribute, written by this module);
    None for a file this module did not write, one that predates the attribute, or one that does not open."""
    try:
        with h5py.File(path, "r") as f:
            attrs = f.attrs
            if attrs.get("generator") != GENERATOR or "seed" not in attrs:
                return None
            return int(attrs["seed"])
    except OSError:  # not HDF5, or unreadable: the file's validation says so in its own words
        return None


def part_rows(samples: int, parts: int) -> list[tuple[int, int]]:
    """Disjoint sample ranges ``[start, stop)`` covering ``0 .. samples``, one per part (some
    empty when there are more parts than blocks), each starting at a multiple of `SOLVE_BLOCK`."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    blocks = math.ceil(samples / SOLVE_BLOCK)
    bounds = [min(samples, (blocks * k // parts) * SOLVE_BLOCK) for k in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def part_file(out_path: str | os.PathLike, index: int, parts: int, tag: str) -> Path:
    """Where part `index` of `parts` of `out_path` is written (hidden, beside it; `tag` names the job)."""
    out = Path(out_path)
    return out.with_name(f".{out.name}.part{index}-of-{parts}.{tag}")


def generate_part(task: str, samples: int, out_path, index: int, parts: int, *, tag: str, nx: int | None = None,
                  nt: int | None = None, seed: int = 0, param: float | None = None, workers: int = 1,
                  chunk: int | None = None, t_end: float | None = None, device: str = "auto",
                  progress: Callable[[int], None] | None = None, resolution: int | None = None) -> Path | None:
    """Write part `index` of `parts` of the file `generate_task` would write at `out_path`.

    The part holds the samples `part_rows(samples, parts)[index]` in the same layout; several
    processes (ranks) each write one part, then one of them calls `merge_parts`. `progress(k)` is
    called after every k samples solved. Returns the part's path (None for an empty part).
    """
    if task in FLOWS:  # one process solves a flow's file whole (its samples are not split into parts)
        if index != 0:
            return None
        spec = get_task(task)
        return generate_flow(task, samples, Path(out_path).parent, resolution=resolution or None, stored=nx,
                             steps=nt, t_end=t_end, seed=seed,
                             workers=workers, device=resolve_device(device), progress=progress,
                             params={spec.param_name: spec.default_param if param is None else float(param)},
                             out_file=part_file(out_path, index, parts, tag))
    start, stop = part_rows(samples, parts)[index]
    if start == stop:
        return None
    return _write_rows(part_file(out_path, index, parts, tag), task, samples, (start, stop), nx=nx, nt=nt, seed=seed,
                       param=param, workers=workers, chunk=chunk, t_end=t_end, device=device, progress=progress)


def merge_parts(out_path, parts: int, *, tag: str) -> Path:
    """Concatenate the parts `generate_part` wrote for `out_path` into it (atomically, in `_MERGE_BYTES`
    blocks), then delete them; returns `out_path`. The result equals `generate_task`'s file."""
    import h5py

    out_path = Path(out_path)
    files = [f for f in (part_file(out_path, k, parts, tag) for k in range(parts)) if f.is_file()]
    if not files:
        raise FileNotFoundError(f"no part of {out_path} was written (looked for {part_file(out_path, 0, parts, tag)})")
    with h5py.File(files[0], "r") as first:
        flow = str(first.attrs.get("task", "")) in FLOWS
    if flow:  # the one part is the whole file
        return publish(files[0], out_path)
    handles = [h5py.File(f, "r") for f in files]
    try:
        first = handles[0]
        attrs = dict(first.attrs)
        task = str(attrs["task"])
        steady = get_task(task).steady
        coords = {"x_coordinate": first["x-coordinate"][:]}
        if steady:  # a steady file's second axis is y; a time-dependent one's is t
            coords["y_coordinate"] = first["y-coordinate"][:]
        else:
            coords["t_coordinate"] = first["t-coordinate"][:]
        n = sum(h["tensor"].shape[0] for h in handles)
        per_sample = math.prod(first["tensor"].shape[1:]) * 4 * (2 if steady else 1)
        block = max(1, _MERGE_BYTES // per_sample)
        with PDEBenchWriter(out_path, task, n_samples=n, attrs=attrs, **coords) as writer:
            start = 0
            for h in handles:
                k = h["tensor"].shape[0]
                for s in range(0, k, block):
                    writer.write(start + s, h["tensor"][s:s + block], h["nu"][s:s + block] if steady else None)
                start += k
    finally:
        for h in handles:
            h.close()
    for f in files:
        f.unlink()
    return out_path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines.generate",
                                description="Generate a PDEBench-format HDF5 file.")
    p.add_argument("--task", required=True, choices=sorted(TASKS))
    p.add_argument("--samples", required=True, type=int, help="number of samples N")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--nx", type=int, default=None, help="grid points per axis (1024; Darcy 128)")
    p.add_argument("--nt", type=int, default=None, help="stored time steps (201; not for darcy2d)")
    p.add_argument("--t-end", type=float, default=None, help="time of the last step (2.0; not for darcy2d)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--beta", type=float, default=None, help="advection speed (advection1d)")
    p.add_argument("--nu", type=float, default=None, help="viscosity (burgers1d)")
    p.add_argument("--darcy-beta", type=float, default=None, help="forcing (darcy2d)")
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument("--chunk", type=int, default=None,
                   help=f"samples per unit of work ({DEFAULT_CHUNK}; {CUDA_CHUNK} on cuda)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to solve: cuda if available (auto), cpu, or cuda (error if absent)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--layout", choices=LAYOUTS_WRITTEN, default="pdebench",
                   help="PDEBench's layout of the family (default) or The Well's (time-dependent tasks)")
    p.add_argument("--resolution", type=int, default=None,
                   help="2D flows: grid points per axis of the solve (a multiple of --nx, which is stored)")
    return p


def _main_flow(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`main` for the 2D flows of `pipelines.flows`."""
    from tqdm import tqdm

    if args.beta is not None or args.darcy_beta is not None or (args.nu is not None and args.task == "swe2d"):
        parser.error(f"--beta/--darcy-beta{'/--nu' if args.task == 'swe2d' else ''} do not apply to {args.task}")
    params = {"nu": args.nu} if args.nu is not None else {}
    if args.nu is not None and not args.task.startswith("ns2d"):
        parser.error(f"--nu does not apply to {args.task}")
    try:
        device = resolve_device(args.device)
        with tqdm(total=args.samples, unit="sample", desc=args.task, disable=args.no_progress) as bar:
            path = generate_flow(args.task, args.samples, args.out, resolution=args.resolution, stored=args.nx,
                                 steps=args.nt, t_end=args.t_end, seed=args.seed, workers=args.workers,
                                 chunk=args.chunk or 8, device=device, layout=args.layout, progress=bar.update,
                                 params=params)
    except ValueError as err:
        parser.error(str(err))
    except WriterBusy as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.generate ARGS`: returns the exit code (2: a bad argument, or the file is
    being written by another live process)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.task in FLOWS:
        return _main_flow(parser, args)
    if args.resolution is not None:
        parser.error(f"--resolution applies to the 2D flows ({', '.join(FLOWS)}), not to {args.task}")
    spec = TASKS[args.task]
    if args.layout == "the_well" and spec.steady:
        parser.error(f"--layout the_well: The Well's format holds time series, and {args.task} is steady; "
                     f"use --layout pdebench")
    flags = {"beta": args.beta, "nu": args.nu, "darcy_beta": args.darcy_beta}
    for name, value in flags.items():
        if value is not None and name != spec.param_name:
            parser.error(f"--{name.replace('_', '-')} does not apply to task {spec.name} "
                         f"(its parameter is --{spec.param_name.replace('_', '-')})")
    if spec.steady and (args.nt is not None or args.t_end is not None):
        parser.error(f"--nt and --t-end do not apply to the steady task {spec.name}")
    try:
        nx = spec.nx if args.nx is None else args.nx
        nt = spec.nt if args.nt is None else args.nt
        t_end = spec.t_end if args.t_end is None else args.t_end
        param = flags[spec.param_name]
        param = spec.default_param if param is None else param
        check_arguments(spec.name, args.samples, nx=nx, nt=nt, param=param, workers=args.workers,
                        chunk=DEFAULT_CHUNK if args.chunk is None else args.chunk, t_end=t_end)
        # After the cheap checks: "auto" imports torch (seconds) to ask for CUDA.
        device = resolve_device(args.device)
        chunk = args.chunk if args.chunk is not None else CUDA_CHUNK if device == "cuda" else DEFAULT_CHUNK
    except ValueError as err:
        parser.error(str(err))
    try:
        path = generate_task(spec.name, args.samples, args.out, nx=nx, nt=nt, seed=args.seed, param=param,
                             workers=args.workers, chunk=chunk, t_end=t_end, progress=not args.no_progress,
                             device=device)
    except DataError as err:  # another live process writes this file
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.layout == "the_well":
        path = _pdebench_to_the_well(path, args.out)
    print(path)
    return 0


def _pdebench_to_the_well(path: Path, out: Path) -> Path:
    """The generated PDEBench file rewritten as The Well's dataset folder ``out/<task>/``; the
    PDEBench file is removed (it was written only to be converted)."""
    from pipelines.layouts.pdebench import describe_files
    from pipelines.layouts.to_the_well import to_the_well

    (desc,) = describe_files([Path(path)], {})
    with h5py.File(path, "r") as f:
        attrs = {k: v for k, v in f.attrs.items() if k not in desc.parameters}
        task = str(f.attrs["task"])
    folder = to_the_well(desc, out, name=task, file_stem=Path(path).stem, attrs=attrs)
    Path(path).unlink()
    return folder


if __name__ == "__main__":
    sys.exit(main())
