"""`python -m entry.check_config --config CFG [--set k=v]`: validate a config and its data paths.

Prints the resolved config hash, the training recipe (`training.precision` / `training.compile`)
as it resolves on this machine and on the other kind (CPU or CUDA), and each task's data file;
exits 2 naming the problem (a fine-tuning source that cannot serve too). Writes nothing.
"""

from __future__ import annotations

import sys

import torch

from entry.config.cli import exits_on_user_error, parse_config
from entry.config.load import config_hash
from entry.config.recipe import describe, resolve_config, resolve_training
from entry.data.files import resolve_task_paths


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    cfg, _ = parse_config(argv, __doc__, resolve=False)
    # Imported once the config has parsed, as entry.pipeline's: a source is checked against the stages'
    # records, which load the training steps and their TensorDicts (with torch._dynamo, 2 s).
    from entry.training.finetune import check_source

    paths = resolve_task_paths(cfg, require_existing=True)
    source_lines = check_source(cfg)  # a fine-tuning source: a finished run of a model this config builds
    cuda = torch.cuda.is_available()
    here = resolve_config(cfg, cuda=cuda)
    print(f"config ok, hash {config_hash(here)} (as resolved on this machine)")
    asked = f"training.precision: {cfg.training.precision}, training.compile: {str(cfg.training.compile).lower()}"
    other = "CPU" if cuda else "CUDA"
    print(f"  recipe on this machine ({'CUDA' if cuda else 'CPU'}): {describe(here.training)} ({asked})")
    print(f"  recipe on {other}: {describe(resolve_training(cfg.training, cuda=not cuda))}")
    for task, path in zip(cfg.data.tasks, paths):
        state = "present" if path.exists() else "missing, will be generated"
        print(f"  {task.name} (param {task.param}): {path} [{state}]")
    for line in (*cfg.derived, *source_lines):
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
