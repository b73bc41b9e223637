"""What two modules share is a public name of the module that owns it: no module of core/,
pipelines/, entry/ or bench/ imports a `_private` name from another module (STYLE.md; a private
name may change without notice, so a caller reaching for one is a seam that should be public).
Tests may still reach into the module they test."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "pipelines", "entry", "bench")


def private_imports(path: Path) -> list[str]:
    """``module.name`` of every ``from module import _name`` in ``path`` (any nesting)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module != "__future__":
            found += [f"{node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_a_private_name_of_another():
    offenders = {str(p.relative_to(ROOT)): names for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
                 if (names := private_imports(p))}
    assert offenders == {}, f"make these public in the module that owns them: {offenders}"


def test_the_check_sees_nested_and_parenthesised_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from entry.x import (\n        public,\n        _hidden,\n    )\n"
                   "from __future__ import annotations\nfrom a import __version__\n")
    assert private_imports(src) == ["entry.x._hidden"]
