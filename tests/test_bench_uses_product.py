"""bench/ is experiments on the product (issue 48): it has no training loop of its own. No module of
bench/ calls ``backward`` (every benchmark trains through `entry.training.step.train_step`, most
through `entry.training.budgeted.train_budgeted`), and the schedule, the weight average's ramp and
the budgeted loop's pieces are each defined once in the project."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "pipelines", "entry", "bench")

DEFINED_ONCE = {
    "cosine_decay": "core/schedule.py", "ema_decay_at": "core/schedule.py",
    "BudgetClock": "entry/training/budgeted.py", "predicted_step_s": "entry/training/budgeted.py",
    "cosine_lr": "entry/training/budgeted.py", "step_lr_for_budget": "entry/training/budgeted.py",
    "train_budgeted": "entry/training/budgeted.py", "train_step": "entry/training/step.py",
    "update_average": "entry/stages/parts.py",
}
"""Name -> the one file that defines it."""


def backward_calls(path: Path) -> list[int]:
    """Lines of ``path`` that call a ``backward`` attribute (``loss.backward()``, ``torch.autograd.backward``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward"]


def definitions(paths: list[Path], names: set[str]) -> dict[str, list[str]]:
    """``{name: [file of each def or class of that name, at any nesting]}`` over ``paths``."""
    found: dict[str, list[str]] = {name: [] for name in names}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name in names:
                found[node.name].append(path.relative_to(ROOT).as_posix())
    return found


def project_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_no_benchmark_calls_backward():
    calls = {p.relative_to(ROOT).as_posix(): lines for p in project_files("bench") if (lines := backward_calls(p))}
    assert calls == {}, f"train through entry.training.step.train_step or train_budgeted instead: {calls}"


def test_the_check_sees_a_backward_call(tmp_path):
    path = tmp_path / "loop.py"
    path.write_text("def f(loss, torch):\n    loss.backward()\n    (loss / 2).backward()\n"
                    "    torch.autograd.backward([loss])\n    return loss.backward_hooks\n")
    assert backward_calls(path) == [2, 3, 4]


def test_the_schedule_the_average_and_the_budgeted_loop_are_defined_once():
    found = definitions(project_files(*PACKAGES), set(DEFINED_ONCE))
    assert found == {name: [where] for name, where in DEFINED_ONCE.items()}
