"""core/ stays pure: no files, no env, no torch.distributed, no global RNG, imports go down.

Walks whatever exists under core/ when the tests run (others add modules in parallel):
every module is imported (pkgutil + importlib) and its source is checked with ``ast``.

Rules (docs/design.md, "Layers": core/ never touches files, environment variables,
torch.distributed or the global random state; imports go entry -> pipelines -> core only):

- no import of entry, pipelines, torch.distributed, os, pathlib, h5py, numpy.random, or
  the stdlib ``random`` (another global RNG); no relative import that leaves ``core``;
- no ``open(...)``, ``torch.save`` or ``torch.load`` (file access);
- no global seeding (``torch.manual_seed`` and friends) and no ``np.random.*`` call;
- every sampling call (``torch.rand/randn/randint/randperm/normal/...``, ``*_like``,
  ``.normal_()``, ``.uniform_()``, ...) passes ``generator=`` (not ``None``; a ``**kwargs``
  pass-through is trusted).

Allowed on purpose: ``torch.nn.init.*`` inside functions (module constructors). Parameter
initialisation draws from the global RNG; seeding it before building a model is the
caller's (entry/'s) responsibility. Layers that draw at call time (dropout) are not
checked here either: a model that uses them in training is seeded by entry/ as well.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest
import torch

import core

CORE_DIR = Path(core.__file__).resolve().parent
FORBIDDEN_IMPORTS = (
    "entry", "pipelines", "torch.distributed", "os", "pathlib", "h5py", "numpy.random", "random",
)
FILE_CALLS = {"open", "io.open", "builtins.open", "torch.save", "torch.load"}
GLOBAL_SEEDING = {
    "torch.manual_seed", "torch.seed", "torch.set_rng_state", "torch.random.manual_seed",
    "torch.random.seed", "torch.random.set_rng_state", "torch.cuda.manual_seed",
    "torch.cuda.manual_seed_all", "torch.cuda.seed", "torch.cuda.seed_all",
}
TORCH_SAMPLERS = {
    f"torch.{name}" for name in (
        "rand", "randn", "randint", "randperm", "normal", "rand_like", "randn_like",
        "randint_like", "bernoulli", "multinomial", "poisson",
    )
}
METHOD_SAMPLERS = {
    "normal_", "uniform_", "bernoulli_", "random_", "exponential_", "cauchy_",
    "log_normal_", "geometric_", "bernoulli", "multinomial",
}
NN_INIT = "torch.nn.init."


def _module_name(path: Path) -> str:
    parts = path.relative_to(CORE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None (calls, subscripts, ...)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _forbidden(module: str) -> bool:
    return any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN_IMPORTS)


class _Checker(ast.NodeVisitor):
    """Collects violations; tracks import aliases so ``from torch import randn`` resolves."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.aliases: dict[str, str] = {}
        self.violations: list[str] = []
        self.depth = 0  # > 0 inside a function body

    def _flag(self, node: ast.AST, message: str) -> None:
        self.violations.append(f"line {node.lineno}: {message}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _forbidden(alias.name):
                self._flag(node, f"import {alias.name}")
            local = alias.asname or alias.name.partition(".")[0]
            self.aliases[local] = alias.name if alias.asname else local

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        try:
            relative = "." * node.level + (node.module or "")
            base = importlib.util.resolve_name(relative, self.package) if node.level else node.module
        except ImportError:  # more dots than packages above this module
            self._flag(node, "relative import leaves the core package")
            return
        if node.level and not (base == "core" or base.startswith("core.")):
            self._flag(node, f"relative import leaves core: {base}")
        for alias in node.names:
            full = f"{base}.{alias.name}"
            if _forbidden(base) or _forbidden(full):
                self._flag(node, f"from {base} import {alias.name}")
            self.aliases[alias.asname or alias.name] = full

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _resolve(self, name: str) -> str:
        head, _, rest = name.partition(".")
        full = self.aliases.get(head, head)
        return f"{full}.{rest}" if rest else full

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        raw = _dotted(node.func)
        name = self._resolve(raw) if raw else None
        gen = [kw for kw in node.keywords if kw.arg == "generator"]
        has_generator = any(kw.arg is None for kw in node.keywords) or (
            bool(gen) and not (isinstance(gen[0].value, ast.Constant) and gen[0].value.value is None)
        )
        if name and name.startswith("torch.distributed."):
            self._flag(node, f"{name}(...): only entry/ knows about ranks")
        elif name in FILE_CALLS:
            self._flag(node, f"file access {name}(...)")
        elif name in GLOBAL_SEEDING:
            self._flag(node, f"global RNG seeding {name}(...)")
        elif name and (name.startswith("numpy.random.") or name.startswith("np.random.")):
            self._flag(node, f"global numpy RNG {name}(...)")
        elif name and name.startswith(NN_INIT):
            if self.depth == 0:
                self._flag(node, f"{name}(...) at import time (only inside constructors)")
        elif name in TORCH_SAMPLERS and not has_generator:
            self._flag(node, f"{name}(...) without generator=")
        elif isinstance(node.func, ast.Attribute) and node.func.attr in METHOD_SAMPLERS and not has_generator:
            self._flag(node, f".{node.func.attr}(...) without generator=")


def find_violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    checker = _Checker(module, is_package)
    checker.visit(ast.parse(source))
    return checker.violations


CORE_FILES = sorted(CORE_DIR.rglob("*.py"))


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(CORE_DIR.parent)))
def test_source_is_pure(path: Path):
    found = find_violations(path.read_text(), _module_name(path), is_package=path.name == "__init__.py")
    assert not found, f"{path.relative_to(CORE_DIR.parent)}:\n  " + "\n  ".join(found)


def test_every_module_imports_without_touching_global_rng():
    walked = {info.name for info in pkgutil.walk_packages(core.__path__, prefix="core.")}
    on_disk = {_module_name(p) for p in CORE_FILES} - {"core"}
    # A folder without __init__.py would hide its modules from packaging and from this walk.
    assert on_disk <= walked, f"not importable as packages: {sorted(on_disk - walked)}"
    state = torch.get_rng_state()
    for name in sorted(walked):
        importlib.import_module(name)
    assert torch.equal(torch.get_rng_state(), state), "importing core/ changed the global RNG"


def test_checker_catches_violations():
    bad = """
import os
import numpy as np
from torch import distributed as dist
from torch import randn
from ... import pipelines
import torch, torch.nn as nn
torch.manual_seed(0)
nn.init.normal_(torch.empty(2))
def f(x, g):
    open("a")
    torch.save(x, "a")
    np.random.rand(3)
    randn(3)
    torch.rand(3, generator=None)
    x.uniform_()
    torch.distributed.get_rank()
    return torch.randint(0, 3, (2,))
"""
    found = find_violations(bad, "core.models.x")
    expected = [
        "import os", "from torch import distributed", "relative import leaves", "torch.manual_seed",
        "torch.nn.init.normal_(...) at import time", "open(", "torch.save", "numpy.random.rand",
        "torch.randn(", "torch.rand(", ".uniform_(", "torch.distributed.get_rank", "torch.randint(",
    ]
    assert len(found) == len(expected), found
    for message, snippet in zip(found, expected):
        assert snippet in message, (snippet, message)


def test_checker_accepts_clean_code():
    good = """
import torch
from torch import nn
from torch.nn import init
from . import sibling
from ..metrics import rmse
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))
        init.normal_(self.w)
        nn.init.trunc_normal_(self.w, std=0.02)
def step(x, *, generator, **kw):
    torch.randn(x.shape, generator=generator)
    x.normal_(generator=generator)
    torch.rand(3, **kw)
    return torch.randint(0, 3, (2,), generator=generator)
"""
    assert find_violations(good, "core.models.x") == []
