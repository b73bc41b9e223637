"""What two modules share is a public name of the module that owns it: no module of core/,
pipelines/, entry/ or bench/ imports a `_private` name from another module (docs/design.md, "How we
write code"; a private name may change without notice, so a caller reaching for one is a seam that
should be public).
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


def module_imports(path: Path, package_modules: set[str]) -> set[str]:
    """Project modules ``path`` imports at module level (imports inside functions run later, when
    every module is loaded, so they cannot form an import-time cycle)."""
    found = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import module`
    return found & package_modules


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> modules it imports) as a path, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_module_level_import_cycle():
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {m: module_imports(p, set(files)) - {m} for m, p in files.items()}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


MAX_FUNCTION_LINES = 60


def test_functions_fit_on_a_screen():
    """No function of core/, pipelines/, entry/ or bench/ is longer than 60 lines (docstring
    included) unless the line above its ``def`` says why (a comment starting ``# long:``)."""
    too_long = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            lines = path.read_text().splitlines()
            for node in ast.walk(ast.parse("\n".join(lines), filename=str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                above = lines[first - 2].strip() if first >= 2 else ""
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and not above.startswith("# long:"):
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                    f"({node.end_lineno - node.lineno + 1} lines)")
    assert too_long == [], "cut these at their phases, or say why above the def (# long: ...): " + "; ".join(too_long)


MAX_FILE_LINES = 300


def test_files_fit_in_a_sitting():
    """No module of core/, pipelines/, entry/ or bench/ is longer than 300 lines unless its first
    line says why (a comment starting ``# long file:``)."""
    too_long = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            lines = path.read_text().splitlines()
            if len(lines) > MAX_FILE_LINES and not (lines and lines[0].startswith("# long file:")):
                too_long.append(f"{path.relative_to(ROOT)} ({len(lines)} lines)")
    assert too_long == [], "split these where their parts already are, or say why on line 1 (# long file: ...): " + \
        "; ".join(too_long)
