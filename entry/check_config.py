"""`python -m entry.check_config --config CFG [--set k=v]`: validate a config and its data paths.

Prints the resolved config hash and each task's data file; exits 2 naming the problem.
Writes nothing.
"""

from __future__ import annotations

import sys

from entry.cli import exits_on_user_error, parse_config
from entry.config import config_hash
from entry.data import resolve_task_paths


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, _ = parse_config(argv, __doc__)
    paths = resolve_task_paths(cfg, require_existing=True)
    print(f"config ok, hash {config_hash(cfg)}")
    for task, path in zip(cfg.data.tasks, paths):
        state = "present" if path.exists() else "missing, will be generated"
        print(f"  {task.name} (param {task.param}): {path} [{state}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
