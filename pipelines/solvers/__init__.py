"""Numerical PDE solvers and initial-condition families in PDEBench's conventions."""

from pipelines.solvers.advection import solve_advection
from pipelines.solvers.burgers import solve_burgers, solve_burgers_blocks
from pipelines.solvers.darcy import darcy_operator, darcy_residual, solve_darcy, solve_darcy_cg
from pipelines.solvers.initial_conditions import darcy_coefficient, sine_superposition

__all__ = [
    "darcy_coefficient",
    "darcy_operator",
    "darcy_residual",
    "sine_superposition",
    "solve_advection",
    "solve_burgers",
    "solve_burgers_blocks",
    "solve_darcy",
    "solve_darcy_cg",
]
