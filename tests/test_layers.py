"""The layers of entry/ hold. Subpackages import only their own layer and the ones below it, in the
order `LAYERS` states (docs/design.md, "Layers"); library modules never import a command module
(entry/<command>.py), and commands never import one another; the shared command line and the user
errors sit in the bottom layer. Every user error is one class wherever it is imported from, and
every design citation in the code names a file of this repository (docs/design.md), with every
distributed rule the code cites by number defined there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import entry.config.errors as errors

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "entry" / "config" / "cli.py"
DESIGN = ROOT / "docs/design.md"

LAYERS = ("entry.config", "entry.distributed", "entry.storage", "entry.models", "entry.data", "entry.stages",
          "entry.evaluation", "entry.inference", "entry.training")
"""entry/'s subpackages, bottom first: each imports only its own layer and those before it."""

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


IMPORT_CALLS = {"import_module", "__import__"}
"""Calls that import a module named by a string (`importlib.import_module`, `__import__`)."""


def literal_start(arg: ast.expr) -> str:
    """The literal text a name built at run time starts with (``f'entry.stages.{name}'`` and
    ``'entry.stages.' + name``: ``entry.stages.``); "" when it starts with no literal."""
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value)
    if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Add) and isinstance(arg.left, ast.Constant):
        return str(arg.left.value)
    return ""


def import_calls(path: Path) -> tuple[set[str], list[int]]:
    """The modules ``path`` imports by calling `IMPORT_CALLS` with a literal name, and the lines of
    those calls whose name is built at run time (an f-string, a concatenation, a variable): the
    layering cannot see what those import. A name built inside one of `LAYERS` (it starts with
    ``entry.stages.``: the stages' records, which entry.stages.record collects) counts as importing
    that subpackage, which holds no command."""
    named, built = set(), []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if called not in IMPORT_CALLS:
            continue
        arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            named.add(arg.value)
        elif arg is not None and (start := literal_start(arg)).endswith(".") and start[:-1] in LAYERS:
            named.add(start[:-1])
        else:
            built.append(node.lineno)
    return named, built


def module_file(module: str) -> Path | None:
    """The project file that defines ``module`` (a module or a package), or None."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def layer_of(module: str) -> int | None:
    """The index in `LAYERS` of the layer `module` belongs to, None for a module outside them."""
    return next((i for i, layer in enumerate(LAYERS) if module == layer or module.startswith(layer + ".")), None)


def command_modules() -> set[str]:
    """The commands: `entry.<name>` for every entry/<name>.py."""
    return {f"entry.{p.stem}" for p in (ROOT / "entry").glob("*.py") if p.stem != "__init__"}


def layer_violations(path: Path, module: str, commands: set[str]) -> list[str]:
    """What the file `path` of module `module` imports against the layering: a command module
    (from a library module or from another command), or a layer above its own."""
    own = layer_of(module)
    named, built = import_calls(path)
    out = [f"{module}:{line} imports a module by a name built at run time; import it by name" for line in sorted(built)]
    for imported in sorted(imported_modules(path) | named):
        target = imported if imported in commands else imported.rsplit(".", 1)[0]
        if imported in commands or target in commands:
            name = imported if imported in commands else target
            if name != module:
                out.append(f"{module} imports the command {name}")
        elif own is not None and (layer := layer_of(imported)) is not None and layer > own:
            out.append(f"{module} ({LAYERS[own]}) imports {imported} ({LAYERS[layer]}, above it)")
    return out


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


def library_and_command_files() -> list[tuple[Path, str]]:
    """(file, module) of every module of entry/."""
    return [(p, ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
            for p in sorted((ROOT / "entry").rglob("*.py"))]


def test_every_layer_imports_only_itself_and_the_layers_below():
    subpackages = {p.name for p in (ROOT / "entry").iterdir() if (p / "__init__.py").is_file()}
    assert {f"entry.{name}" for name in subpackages} == set(LAYERS), "state every subpackage's place in LAYERS"
    commands = command_modules()
    found = [v for path, module in library_and_command_files() for v in layer_violations(path, module, commands)]
    assert found == [], "\n".join(found)


def test_the_layer_check_sees_an_upward_or_command_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from entry.config.errors import CheckpointError\nimport entry.operator\n"
                   "def f():\n    from entry.training.checkpoint import export_weights\n"
                   "from entry import pipeline\n")
    found = layer_violations(src, "entry.data.example", command_modules())
    assert found == ["entry.data.example imports the command entry.operator",
                     "entry.data.example imports the command entry.pipeline",
                     "entry.data.example (entry.data) imports entry.training.checkpoint (entry.training, above it)",
                     "entry.data.example (entry.data) imports entry.training.checkpoint.export_weights "
                     "(entry.training, above it)"]
    assert layer_violations(src, "entry.cache", command_modules())[:2] == [
        "entry.cache imports the command entry.operator", "entry.cache imports the command entry.pipeline"]


def test_the_layer_check_sees_a_command_imported_by_a_call(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import importlib\nfrom importlib import import_module\n"
                   "def stage(name):\n"
                   "    importlib.import_module('entry.operator')\n"
                   "    __import__('entry.steady')\n"
                   "    import_module(name='entry.training.loop')\n"
                   "    return importlib.import_module(f'entry.{name}').STAGE\n"
                   "def other(name):\n    return __import__('entry.' + name)\n"
                   "def record(name):\n    return importlib.import_module(f'entry.stages.{name}').SPEC\n")
    found = layer_violations(src, "entry.data.example", command_modules())
    assert found == ["entry.data.example:7 imports a module by a name built at run time; import it by name",
                     "entry.data.example:9 imports a module by a name built at run time; import it by name",
                     "entry.data.example imports the command entry.operator",
                     "entry.data.example (entry.data) imports entry.stages (entry.stages, above it)",
                     "entry.data.example imports the command entry.steady",
                     "entry.data.example (entry.data) imports entry.training.loop (entry.training, above it)"]
    # The stages' records, collected by name inside their own layer, are no command and no layer above.
    assert layer_violations(src, "entry.stages.example", command_modules())[-1] == (
        "entry.stages.example (entry.stages) imports entry.training.loop (entry.training, above it)")
    assert not any("entry.stages " in v for v in layer_violations(src, "entry.stages.example", command_modules()))


def test_the_command_line_and_the_user_errors_sit_at_the_bottom():
    for path in (ROOT / "entry" / "config" / "cli.py", ROOT / "entry" / "config" / "errors.py"):
        reached = {m for m in project_closure(path) if m.startswith("entry.") and layer_of(m) != 0}
        assert reached == set(), f"{path.relative_to(ROOT)} pulls in {sorted(reached)}"


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
    assert labels[errors.FolderInUse] == "folder in use"
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


def test_no_task_name_file_pattern_or_channel_count_is_written_into_core_or_entry():
    """What a task is comes from pipelines.tasks (generated tasks) and the layout readers (declared
    data); core/ and entry/ read it from a task's spec, never by name."""
    from pipelines.tasks import TASKS

    words = [*TASKS, *(spec.file_pattern.split("{")[0] for spec in TASKS.values()), "FIELD_CHANNELS"]
    found = [f"{path.relative_to(ROOT)}: {word}" for folder in ("core", "entry") for path in (ROOT / folder).rglob("*.py")
             for word in words if word in path.read_text()]
    assert found == []
