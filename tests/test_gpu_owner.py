"""bench/gpu_owner.sh, the one command a GPU owner runs, is checked on the CPU as far as the CPU
can: it passes shellcheck, every name its inline Python imports exists, every module it runs
with `python -m` is there, and every config it names is a file. (Its first run on a GPU,
2026-12-04, stopped at an import of `device_slug` from a module it had left.) And README's test
line keeps to the CPU on a GPU machine: only a session that selects `-m cuda` sees the GPUs, and
the processes the suite starts keep the caller's PYTHONPATH, where that image's missing packages
are unpacked (nine tests there lost them, 2026-12-04)."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys

import pytest

from tests import tiny_run as tr
from tests.conftest import gpus_for_the_session

SCRIPT = tr.ROOT / "bench" / "gpu_owner.sh"


def test_gpu_owner_script_passes_shellcheck():
    tr.assert_shellcheck_passes(SCRIPT)


def test_every_import_module_and_config_the_script_names_exists():
    text = "\n".join(line for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#"))
    imports = re.findall(r"^\s*from ([\w.]+) import ([\w, ]+)", text, flags=re.M)
    imports += re.findall(r"[;'\"]\s*from ([\w.]+) import ([\w, ]+)", text)
    modules = re.findall(r"python -m ([\w.]+)", text)
    configs = re.findall(r"(configs/[\w/.{},$\"-]+\.yaml)", text)
    assert imports and modules and configs  # the patterns still match the script's shape
    for module, names in imports:
        loaded = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(loaded, name), f"bench/gpu_owner.sh imports {name} from {module}, which has none"
    for module in modules:
        if module != "pytest":
            assert importlib.util.find_spec(module) is not None, f"bench/gpu_owner.sh runs {module}: not found"
    for pattern in configs:
        expanded = [pattern]
        if "${flow}" in pattern:  # the loop over the 2D flows
            flows = re.search(r"for flow in ([\w ]+);", text).group(1).split()
            expanded = [pattern.replace('"${flow}"', f).replace("${flow}", f) for f in flows]
        for path in expanded:
            assert (tr.ROOT / path.strip('"')).is_file(), f"bench/gpu_owner.sh names {path}: no such file"


@pytest.mark.parametrize("markexpr, sees_gpus", [
    ("", False), ("not bench", False), ("slow", False), ("not cuda", False), ("slow and not cuda", False),
    ("cuda", True), ("cuda and not slow", True), ("(cuda) or distributed", True), ("not bench and cuda", True),
    ("cuda or not cuda", True), ("not (cuda)", False), ("not (slow or cuda)", False), ("not (not cuda)", True),
    ("not not cuda", True), ("not (slow) and cuda", True),
])
def test_only_a_session_that_selects_the_cuda_tests_sees_the_gpus(markexpr, sees_gpus):
    assert gpus_for_the_session(markexpr) is sees_gpus


def test_a_cpu_session_hides_the_gpus_from_its_tests_and_their_processes(tmp_path):
    # What keeps README's line on the CPU on a GPU machine: CUDA_VISIBLE_DEVICES="" before torch
    # initialises CUDA. Shown here by a session of its own on a stand-in test file.
    (tmp_path / "test_probe.py").write_text(
        "import os, subprocess, sys\n"
        "def test_probe():\n"
        "    child = subprocess.run([sys.executable, '-c', 'import os; print(repr(os.environ.get(\"CUDA_VISIBLE_DEVICES\")))'],\n"
        "                           capture_output=True, text=True, check=True).stdout.strip()\n"
        "    print('seen', repr(os.environ.get('CUDA_VISIBLE_DEVICES')), child)\n")
    env = {k: v for k, v in tr.env().items() if k != "CUDA_VISIBLE_DEVICES"}
    # The probe has no mark, so it runs under either expression; the second one selects `cuda`.
    for markexpr, seen in (("not cuda", "'' ''"), ("cuda or not cuda", "None None")):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "tests.conftest",
                               "-c", str(tr.ROOT / "pyproject.toml"), "-m", markexpr, str(tmp_path / "test_probe.py")],
                              cwd=tr.ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert f"seen {seen}" in proc.stdout, (markexpr, proc.stdout[-2000:], proc.stderr[-2000:])


def test_the_processes_the_suite_starts_keep_the_callers_pythonpath(tmp_path, monkeypatch):
    # A dependency found only through PYTHONPATH (the GPU image's wheels unpacked into a folder, a
    # cluster's module system) must reach every child, with the checkout (or its copy) ahead of it.
    deps = tmp_path / "deps"
    deps.mkdir()
    (deps / "probe_dependency.py").write_text("FOUND = True\n")
    monkeypatch.setenv("PYTHONPATH", str(deps))
    probe = ("import probe_dependency, entry, os; "
             "print(probe_dependency.FOUND, os.path.dirname(os.path.dirname(entry.__file__)))")
    for env in (tr.env(), tr.bare_env()):
        out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.stdout.split() == ["True", str(tr.ROOT)], out.stderr[-2000:]
    # Every test that sets a child's PYTHONPATH does it through tr.python_path (or faults' prepend).
    replaced = [f"{path.name}:{n}" for path in sorted((tr.ROOT / "tests").glob("*.py"))
                for n, line in enumerate(path.read_text().splitlines(), 1)
                if re.search(r"[\"']PYTHONPATH[\"']\]?\s*[:=]\s*str\(", line) and "pathsep" not in line]
    assert not replaced, f"these lines replace the caller's PYTHONPATH (use tr.python_path): {replaced}"


def test_the_processes_the_suite_starts_keep_the_sessions_gpu_visibility(tmp_path, monkeypatch):
    # conftest hides the GPUs from a CPU session through CUDA_VISIBLE_DEVICES; a child started with
    # an environment of its own must keep it (test_evaluate's torchrun saw the H200 and refused
    # two processes on one GPU, 2026-12-04).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    probe = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    for env in (tr.env(), tr.bare_env()):
        out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.stdout.strip() == "''", out.stderr[-2000:]
    # No test builds a child's environment from a bare literal (which drops it); tr.bare_env does.
    literal = [f"{path.name}:{n}" for path in sorted((tr.ROOT / "tests").glob("*.py")) if path.name != "tiny_run.py"
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if re.search(r"env\s*=\s*\{\s*[\"'](PATH|PYTHONPATH|OMP_NUM_THREADS)[\"']", line)]
    assert not literal, f"these child environments drop the session's GPU visibility (use tr.bare_env): {literal}"
