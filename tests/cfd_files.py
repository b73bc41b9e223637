"""Files in PDEBench's compressible-flow layout (its ``{2D,3D}_CFD_*`` files: ``density``,
``pressure``, ``Vx``, ``Vy`` (, ``Vz``) as [N, T, *S], ``x-``/``y-``/``z-coordinate``, and a
``t-coordinate`` of T + 1 values), written one trajectory at a time: a test can write a file larger
than it would hold in memory."""

from __future__ import annotations

from collections.abc import Callable

import h5py
import numpy as np


def cell_centres(side: int) -> np.ndarray:
    """[side] cell-centred points of the unit interval."""
    return (np.arange(side) + 0.5) / side


def write_cfd(path, trajectory: Callable[[int], dict[str, np.ndarray]], *, trajectories: int, steps: int, side: int,
              dims: int, t_end: float) -> int:
    """Write ``trajectory(n)`` ({key: [steps, side, ...]}) for every n, chunked by frame, with the
    coordinate datasets (``t-coordinate`` spans [0, t_end]); returns the file's size in bytes."""
    shape = (steps, *(side,) * dims)
    with h5py.File(path, "w") as f:
        data = {}
        for n in range(trajectories):
            for key, value in trajectory(n).items():
                if key not in data:
                    data[key] = f.create_dataset(key, (trajectories, *shape), np.float32, chunks=(1, 1, *shape[1:]))
                data[key][n] = value
        for axis in "xyz"[:dims]:
            f[f"{axis}-coordinate"] = cell_centres(side).astype(np.float32)
        f["t-coordinate"] = np.linspace(0, t_end, steps + 1).astype(np.float32)
    return path.stat().st_size
