"""What a config computes, apart from where its files live and how its run is driven.

A stage is complete, and a latent cache matches, when the math that made it is the same: the
config keys that change numbers, plus the content of the files it read (recorded separately, as
fingerprints). Two kinds of key are left out of that identity:

- locations (`data.root`, `data.tasks[i].path`, `training.cache_dir`): the files they name are
  fingerprinted by content, so an identical copy elsewhere is the same input;
- run control (`RUN_CONTROL_KEYS`): how often to checkpoint, how many loader threads, time-outs,
  what to do after a fault. They change neither the batches nor the steps.

`entry.config.load.config_hash` stays the hash of the whole config (what a run folder records).
"""

from __future__ import annotations

from entry.config.load import hashed_tree, tree_hash
from entry.config.schema import STAGE_CONFIGS, Config

__all__ = ["LOCATION_KEYS", "RUN_CONTROL_KEYS", "math_tree", "math_hash"]

LOCATION_KEYS = {"data": ("root",), "training": ("cache_dir",), "finetune": ("from",)}
"""Keys that say where files are, not what they hold (each task's `path` too; a fine-tuning
source run's weights are fingerprinted in the done files, entry.training.stage_record)."""

RUN_CONTROL_KEYS = {"data": ("generate_if_missing",),
                    "training": ("checkpoint_every", "keep_checkpoints", "num_workers", "prefetch_factor",
                                 "timeout_s", "debug", "on_oom", "max_skips_in_a_row"),
                    "evaluation": ("plot_samples", "max_test_samples", "lead_windows", "ensemble_members", "split",
                                   "time_rollout"),
                    **{name: section.RUN_CONTROL_KEYS for name, section in STAGE_CONFIGS.items()
                       if section.RUN_CONTROL_KEYS}}
"""Keys that change how a run is driven, not what it computes. The loader draws the same batches
with any number of threads (the sampler, not the workers, orders them); `on_oom` and
`max_skips_in_a_row` decide only what a fault does; the evaluation keys and the keys a stage's
section declares (`StageConfig.RUN_CONTROL_KEYS`: the refiners' samplers, the diffusion sampler and
its levels, the consistency model's 1 or 2 steps and its re-noising level) shape the test report,
which no stage's weights depend on."""


def _without(tree: dict, keys: dict[str, tuple[str, ...]]) -> dict:
    return {section: ({k: v for k, v in value.items() if k not in keys.get(section, ())}
                      if isinstance(value, dict) else value)
            for section, value in tree.items()}


def math_tree(cfg: Config, sections: tuple[str, ...] | None = None) -> dict:
    """The config as a plain tree without reporting (`logging`), locations and run control (and
    the `HASHED_WHEN_SET` keys left at their defaults, as every config hash).

    Takes the config and the top-level sections to keep (None: all). Returns a JSON-ready dict.
    """
    tree = {k: v for k, v in hashed_tree(cfg).items() if sections is None or k in sections}
    tree = _without(_without(tree, LOCATION_KEYS), RUN_CONTROL_KEYS)
    if isinstance(tree.get("data"), dict):
        tasks = tree["data"].get("tasks", [])
        tree["data"] = {**tree["data"], "tasks": [{k: v for k, v in t.items() if k != "path"} for t in tasks]}
    return tree


def math_hash(cfg: Config, sections: tuple[str, ...] | None = None) -> str:
    """16-hex-digit hash of `math_tree(cfg, sections)`: equal for configs that compute the same."""
    return tree_hash(math_tree(cfg, sections))
