"""The layers hold: the shared command line names its user errors through entry/errors.py alone,
so it pulls in no upper layer of entry/; every user error is one class wherever it is imported
from; and every design citation in the code names a file of this repository (docs/design.md),
with every distributed rule the code cites by number defined there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import entry.errors as errors

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "entry" / "config" / "cli.py"
DESIGN = ROOT / "docs/design.md"

UPPER_LAYERS = ("entry.distributed", "entry.storage", "entry.training", "entry.data", "entry.evaluation")
ALLOWED_UPPER = {"entry.distributed.precision"}
"""The `auto` recipe's rule (`resolve_config`) lives with the precision contract; that module imports
only torch and entry.config.schema, so importing it pulls in nothing else of entry.distributed."""


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any nesting (``from pkg import name`` also counts
    ``pkg.name``, in case it is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def module_file(module: str) -> Path | None:
    """The project file that defines ``module`` (a module or a package), or None."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def in_layers(module: str, layers: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``layers`` or inside one of them."""
    return any(module == layer or module.startswith(layer + ".") for layer in layers)


def upper_layer(modules: set[str]) -> set[str]:
    """The names in ``modules`` that belong to an upper layer of entry/ (`ALLOWED_UPPER` and the
    layers' package ``__init__`` files, which hold only a docstring, left out)."""
    return {m for m in modules if in_layers(m, UPPER_LAYERS) and m not in UPPER_LAYERS
            and not in_layers(m, tuple(ALLOWED_UPPER))}


def project_closure(path: Path) -> set[str]:
    """The project modules ``path`` reaches through imports, transitively."""
    seen: set[str] = set()
    todo = [path]
    while todo:
        for module in imported_modules(todo.pop()):
            if module not in seen and (file := module_file(module)) is not None:
                seen.add(module)
                todo.append(file)
    return seen


def test_cli_imports_no_upper_layer_of_entry():
    upper = upper_layer(imported_modules(CLI))
    assert upper == set(), f"entry/config/cli.py imports {sorted(upper)}; name user errors through entry.errors"


def test_cli_reaches_no_upper_layer_through_its_imports():
    reached = upper_layer(project_closure(CLI))
    assert reached == set(), f"entry/config/cli.py pulls in {sorted(reached)}"


def test_errors_module_sits_at_the_bottom():
    below = ("entry.config.load", "entry.config.schema", "pipelines", "core")
    project = {m for m in imported_modules(ROOT / "entry" / "errors.py")
               if m.split(".")[0] in ("entry", "pipelines", "core")}
    above = {m for m in project if not any(m == b or m.startswith(b + ".") for b in below)}
    assert above == set(), f"entry/errors.py must import only entry.config and lower layers: {sorted(above)}"


def test_each_user_error_is_one_class_wherever_it_is_imported_from():
    from entry.config import cli
    from entry.config.load import ConfigError
    from entry.storage.folder_lock import FolderInUse
    from entry.training.checkpoint import CheckpointError, UntrustedCheckpointError
    from pipelines.latent_cache import CacheError
    from pipelines.pdebench_io import DataError

    assert (ConfigError, DataError, CacheError, CheckpointError, FolderInUse) == errors.USER_ERRORS
    assert cli.USER_ERRORS is errors.USER_ERRORS
    assert UntrustedCheckpointError is errors.UntrustedCheckpointError
    assert issubclass(UntrustedCheckpointError, CheckpointError)


def test_every_user_error_has_its_label():
    labels = {kind: errors.error_label(kind("x")) for kind in errors.USER_ERRORS}
    assert labels[errors.ConfigError] == "config error"
    assert labels[errors.FolderInUse] == "run folder in use"
    assert errors.error_label(errors.UntrustedCheckpointError("x")) == "checkpoint error"
    assert len(set(labels.values())) == len(labels)


CITED_DOC = re.compile(r"\bdocs/[\w./-]+\.md\b")
OUTSIDE_DOC = re.compile(r"(?<!docs/)\b(?:DESIGN|STYLE)\.md\b", re.IGNORECASE)
CITED_RULE = re.compile(r"\brules? (\d+(?:(?:, | and )\d+)*)", re.IGNORECASE)


def rule_numbers(text: str) -> list[int]:
    """The rule numbers ``text`` cites: "rule 2" -> [2], "rules 1, 5 and 8" -> [1, 5, 8]."""
    return [int(n) for m in CITED_RULE.finditer(text) for n in re.findall(r"\d+", m.group(1))]


def python_files() -> list[Path]:
    """The Python files of the project and its tests."""
    return sorted(p for folder in ("core", "pipelines", "entry", "bench", "tests")
                  for p in (ROOT / folder).rglob("*.py"))


def test_every_cited_document_is_in_the_repository():
    missing, outside = [], []
    for path in [*python_files(), ROOT / "README.md"]:
        text = path.read_text()
        missing += [f"{path.relative_to(ROOT)}: {m}" for m in CITED_DOC.findall(text) if not (ROOT / m).is_file()]
        outside += [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
                    for m in OUTSIDE_DOC.finditer(text)]
    assert missing == [], f"cited documents that do not exist: {missing}"
    assert outside == [], f"cite docs/design.md (a file of this repository) instead: {outside}"


def distributed_rules() -> set[int]:
    """Numbers of the items of docs/design.md's "Distributed rules" section."""
    text = DESIGN.read_text()
    section = text.split("## Distributed rules", 1)[1].split("\n## ", 1)[0]
    return {int(n) for n in re.findall(r"^(\d+)\. ", section, flags=re.MULTILINE)}


def test_every_rule_the_code_cites_is_defined():
    defined = distributed_rules()
    assert defined == set(range(1, len(defined) + 1)), f"rules are numbered 1..N: {sorted(defined)}"
    cited = {}
    for path in python_files():
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            if "docs/design.md" in line:
                cited |= {n: f"{path.relative_to(ROOT)}:{line_no}" for n in rule_numbers(line)}
    assert cited, "the code cites distributed rules by number; the scan found none"
    undefined = {n: where for n, where in cited.items() if n not in defined}
    assert undefined == {}, f"rules cited but not defined in docs/design.md: {undefined}"


def test_the_citation_check_sees_a_bad_citation():
    # The examples are assembled, so that this file itself cites nothing outside the repository.
    design, style, missing = "DESIGN" + ".md", "STYLE" + ".md", "docs/" + "missing.md"
    assert OUTSIDE_DOC.findall(f"see {design} rule 1 and ../shared/{style}") == [design, style]
    assert OUTSIDE_DOC.findall("../shared/" + design.lower()) == [design.lower()]
    assert OUTSIDE_DOC.findall("see docs/design.md, distributed rule 1") == []
    assert CITED_DOC.findall(f"(docs/design.md, rule 2) and {missing}.") == ["docs/design.md", missing]
    assert rule_numbers("Distributed rules 1, 5 and 8 of docs/design.md; rule 2.") == [1, 5, 8, 2]


def test_the_layer_check_sees_an_upper_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from entry.errors import CheckpointError\nfrom entry.distributed.precision import resolve_config\n"
                   "def f():\n    from entry.training.checkpoint import CheckpointError\n"
                   "from entry.storage import folder_lock\n")
    assert upper_layer(imported_modules(src)) == {"entry.training.checkpoint", "entry.storage.folder_lock",
                                                  "entry.training.checkpoint.CheckpointError"}
