"""What a finished stage leaves in the run folder, and whether it is still complete.

A stage is complete when its done file (`<stage>.done.json`) records the hash of the config
sections its result depends on (`STAGE_SECTIONS`) and the fingerprints of the inputs it read
(data files, earlier stages' weights) as they are now. Exported weights are `<stage>.pt`.
"""

from __future__ import annotations

from pathlib import Path

from entry.config.identity import math_hash, math_tree
from entry.config.load import tree_hash
from entry.config.schema import Config
from entry.data.files import data_inputs, require_same_data
from entry.stages.record import STAGES
from entry.training.finetune import source_inputs
from entry.storage.atomic import atomic_write_json, read_json
from entry.storage.run_folder import stage_done_file, weights_file
from entry.storage.weights_fingerprint import weights_fingerprint

__all__ = ["STAGE_SECTIONS", "STAGE_INPUT_WEIGHTS", "stage_done_file", "weights_file",
           "stage_hash", "resume_hash", "stage_inputs", "write_done", "stage_status", "stage_is_complete"]


STAGE_SECTIONS = {spec.name: spec.sections for spec in STAGES}
"""Config sections each stage's result depends on (`entry.stages.record.StageSpec.sections`)."""


def stage_hash(cfg: Config, stage: str) -> str:
    """Hash of what the config sections `stage` depends on (`STAGE_SECTIONS`) compute
    (`entry.config.identity.math_hash`: locations and run control left out); the whole config's
    math for a name it does not list."""
    return math_hash(cfg, STAGE_SECTIONS.get(stage))


RESUME_FREE_KEYS = {"evaluation": ("rollout_steps", "val_rollout_steps"), "training": ("max_train_s",)}
"""Keys a checkpoint resumes across although they change what a finished stage is: validation's
rollout length (it may pick other best weights from then on, never other training steps) and the
time budget (like `steps`: training longer or shorter from the same point)."""


def resume_hash(cfg: Config, stage: str) -> str:
    """`stage_hash` without the stage's `steps` and `RESUME_FREE_KEYS`: a checkpoint resumes across
    changes of these (training longer, validating longer rollouts), never across others."""
    tree = math_tree(cfg, STAGE_SECTIONS.get(stage))
    if isinstance(tree.get(stage), dict):
        tree[stage] = {k: v for k, v in tree[stage].items() if k != "steps"}
    for section, keys in RESUME_FREE_KEYS.items():
        if isinstance(tree.get(section), dict):
            tree[section] = {k: v for k, v in tree[section].items() if k not in keys}
    return tree_hash(tree)


STAGE_INPUT_WEIGHTS = {spec.name: spec.weights_read for spec in STAGES}
"""Earlier stages whose exported weights each stage's result depends on (`StageSpec.weights_read`)."""


def stage_inputs(cfg: Config, run_dir: Path, stage: str) -> dict:
    """Provenance of what `stage` reads: `{"data": {task key: fingerprint}, "weights": {stage:
    fingerprint}}` and, fine-tuning, `"source": {stage: fingerprint}` (the source run's weights it
    starts from, entry.training.finetune.source_inputs): data files by their bytes
    (`pipelines.file_facts.data_fingerprint`), weights by the tensors they hold
    (`entry.storage.weights_fingerprint`); None for a file that is absent."""
    def weights(path: Path) -> str | None:
        return weights_fingerprint(path) if path.is_file() else None

    found = {"data": data_inputs(cfg),
             "weights": {s: weights(weights_file(run_dir, s)) for s in STAGE_INPUT_WEIGHTS.get(stage, ())}}
    source = source_inputs(cfg, stage)
    # Only a fine-tuning run records its source: the done files of the others stay as they were.
    return {**found, "source": source} if source else found


def write_done(run_dir: Path, stage: str, cfg: Config, inputs: dict, fields: dict | None = None) -> Path:
    """Rank 0: mark `stage` complete, atomically: its config sections' hash, the provenance of its
    inputs as they were when it started (`stage_inputs`), and `fields`. A data file that changed
    since then is a `DataError` (`require_same_data`) and the stage is not marked complete."""
    require_same_data(cfg, inputs.get("data", {}), f"stage {stage} started")
    done = {"stage": stage, "config_hash": stage_hash(cfg, stage), "inputs": inputs, **(fields or {})}
    return atomic_write_json(stage_done_file(run_dir, stage), done)


def stage_status(run_dir: Path, stage: str, cfg: Config) -> tuple[bool, str]:
    """(whether `stage` is complete in `run_dir` for the config sections and the inputs it depends
    on, why not). An unreadable done file (a crash while it was written by an older version)
    counts as absent, and the reason names it."""
    path = stage_done_file(run_dir, stage)
    try:
        done = read_json(path)
    except ValueError as e:
        return False, f"its done file is unreadable ({e}); treating the stage as not complete"
    if done is None:
        return False, "it has not completed"
    if done.get("config_hash") != stage_hash(cfg, stage):
        return False, f"its config sections changed (hash {done.get('config_hash')} -> {stage_hash(cfg, stage)})"
    recorded, now = done.get("inputs"), stage_inputs(cfg, run_dir, stage)
    if recorded != now:
        changed = [f"{kind} {key}" for kind in ("data", "weights", "source")
                   for key in sorted(set((recorded or {}).get(kind, {})) | set(now.get(kind, {})))
                   if (recorded or {}).get(kind, {}).get(key) != now.get(kind, {}).get(key)]
        return False, f"its inputs changed since it ran ({', '.join(changed) or 'no provenance recorded'})"
    return True, "complete"


def stage_is_complete(run_dir: Path, stage: str, cfg: Config) -> bool:
    """Whether `stage` finished in `run_dir` for the config sections and inputs it depends on."""
    return stage_status(run_dir, stage, cfg)[0]
