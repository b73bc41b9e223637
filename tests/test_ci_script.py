"""`.ci/run` is what a newcomer does: it builds a new virtual environment of its own and runs README's
test line verbatim inside it; it and the constraints refresher pass shellcheck; README's install lines
install the releases `constraints.txt` names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from tests import tiny_run as tr

CI = tr.ROOT / ".ci"


def test_ci_scripts_pass_shellcheck():
    tr.assert_shellcheck_passes(CI / "run", CI / "refresh-constraints")


def test_ci_runs_readmes_test_line_in_a_new_virtual_environment(tmp_path):
    # A stand-in project: .ci/run as it is, a README whose test line reports the interpreter it ran in.
    (tmp_path / ".ci").mkdir()
    shutil.copy(CI / "run", tmp_path / ".ci" / "run")
    report = tmp_path / "prefix.txt"
    (tmp_path / "README.md").write_text(
        "# stand-in\n\n```bash\n"
        f"pip install --help >/dev/null && python -c 'import sys; open(\"{report}\", \"w\").write(sys.prefix)' # pytest\n"
        "```\n")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    proc = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prefix = report.read_text()
    assert "ci: new virtual environment" in proc.stdout
    assert prefix not in (sys.prefix, sys.base_prefix)  # not the environment the suite runs in
    assert not os.path.exists(prefix)  # made for this run, removed after it


def test_readme_install_lines_use_the_constraints_file():
    readme = (tr.ROOT / "README.md").read_text()
    lines = [ln for ln in readme.splitlines() if re.match(r"^pip install torch==", ln) and "index-url" not in ln]
    assert len(lines) == 2 and all("-c constraints.txt" in ln for ln in lines), lines
    pinned = dict(ln.split("==", 1) for ln in (tr.ROOT / "constraints.txt").read_text().splitlines()
                  if ln and not ln.startswith("#"))
    assert "pytest" in pinned and "torch" in pinned and "+" not in pinned["torch"]
