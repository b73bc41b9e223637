"""exp and power of float64 arrays, value by value through the C library: the same bytes on every
x86-64 CPU, so a generated file is the same bytes wherever it is generated.

numpy chooses SIMD code by the CPU when it is imported. On a CPU with AVX-512 (its X86_V4 level)
its float64 exp, power, log and arctan differ from the C library's by a unit in the last place;
without AVX-512 it calls the C library itself, which is what these do everywhere. A unit in the
last place of an initial state grows through a flow's time steps into other float32 values: the
ns2d race file generated on an AVX-512 CPU (Zen 4, 2026-12-04) differed from the one made on an
AVX2 CPU (Zen 1) until the initial states went through here
(bench/results/cpu-2core-2026-12-04-generation-cpu.md). numpy's sin, cos, tanh, sqrt and complex exp
gave the same bytes both ways there and stay as they are.

About 0.1 µs a value: for initial states and coefficients, not inside a solver's time loop.
"""

from __future__ import annotations

import math

import numpy as np


def _each(f, a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    return np.fromiter(map(f, a.ravel().tolist()), dtype=np.float64, count=a.size).reshape(a.shape)


def exp(a: np.ndarray) -> np.ndarray:
    """e ** a, elementwise, float64 of a's shape (the C library's `exp`)."""
    return _each(math.exp, a)


def power(a: np.ndarray, p: float) -> np.ndarray:
    """a ** p for a float exponent p, elementwise, float64 of a's shape (the C library's `pow`)."""
    return _each(lambda v: math.pow(v, p), a)
