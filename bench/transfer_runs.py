"""The runs of a transfer measurement (`bench.transfer`): each a config tree derived from the base
config's tree (its tasks, step budget, learning rate, seed, fine-tuning source changed; nothing
else), written beside the results and trained by the product's pipeline (`python -m
entry.pipeline` in a subprocess, `bench.race.run_pipeline`), then read back from its run folder:
the test scores of eval.json, the operator's validation curve and training seconds.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import orjson
import yaml

from bench.race import run_pipeline
from bench.race_train import kept_validation
from entry.config.load import ConfigError, config_hash, load_config
from entry.evaluation.task_frames import task_label
from entry.storage.run_folder import stage_done_file

STAGES = ["autoencoder", "cache", "operator", "evaluate"]
"""What every run of the measurement trains and scores: the codec and the operator."""
VAL_POINTS = 10
"""Validations per run (the last after the last step): the curve the flatness check reads."""


class Budget(NamedTuple):
    """What every run of one arm comparison gets: optimizer steps of each stage and the rollout scored."""

    steps: int
    """Operator optimizer steps."""
    codec_steps: int
    """Codec (autoencoder) optimizer steps."""
    rollout_steps: int
    """Predicted steps of the test and validation rollouts (the issue's 10)."""


def held_out_index(tree: dict, spec: str) -> int:
    """The index in ``tree``'s ``data.tasks`` of the task ``spec`` names (``NAME`` or ``NAME:PARAM``);
    a ConfigError unless exactly one task is named so."""
    name, _, param = spec.partition(":")
    try:
        value = float(param) if param else None
    except ValueError:
        raise ConfigError(f"--held-out {spec}: give NAME or NAME:PARAM, PARAM a number") from None
    tasks = tree["data"]["tasks"]
    hits = [i for i, t in enumerate(tasks) if t["name"] == name and (value is None or t["param"] == value)]
    if len(hits) != 1:
        known = ", ".join(f"{t['name']}:{t['param']:g}" for t in tasks)
        raise ConfigError(f"--held-out {spec} names {len(hits)} of the tasks ({known}): name one (NAME:PARAM when "
                          "two share a name; --held-out-config only for a task the base does not hold)")
    return hits[0]


def run_tree(base: dict, *, role: str, tasks: list[dict], budget: Budget, seed: int, lr: float | None = None,
             source: str = "", freeze: tuple[str, ...] = (), new_lr_scale: float = 1.0,
             weights: list[float] = (), select: str | None = None, new_fields: str = "reconstruction") -> dict:
    """``base`` with ``tasks`` (``weights``: their shares of a batch; empty, equal shares), the stages
    `STAGES`, ``budget``'s steps (warm-ups capped at a tenth of them), validation `VAL_POINTS` times (the
    weights kept: ``select``'s, None the base's ``evaluation.select``), the operator's ``lr`` (None: the
    base's), ``seed`` and, with ``source``, fine-tuning from that run folder (``freeze``: its stages kept;
    ``new_lr_scale``: the rate of what fine-tuning adds, over the rest's; ``new_fields``: what new field
    embeddings learn from). Its run name: `run_name` of the
    tree and ``role`` (what the run is to its measurement)."""
    tree = copy.deepcopy(base)
    tree.pop("derived", None)
    tree["data"]["tasks"] = tasks
    tree["data"]["task_weights"] = list(weights)
    tree["stages"] = list(STAGES)
    for stage, steps in (("operator", budget.steps), ("autoencoder", budget.codec_steps)):
        tree[stage]["steps"] = steps
        tree[stage]["warmup_steps"] = min(tree[stage].get("warmup_steps", 0), steps // 10)
    if lr is not None:
        tree["operator"]["lr"] = lr
    tree["training"]["seed"] = seed
    tree["evaluation"].update(rollout_steps=budget.rollout_steps, val_rollout_steps=budget.rollout_steps,
                              val_every=max(1, budget.steps // VAL_POINTS))
    if select is not None:
        tree["evaluation"]["select"] = select
    tree["finetune"] = {"from": source, "freeze": list(freeze), "new_lr_scale": new_lr_scale,
                        "new_fields": new_fields} if source else {}
    tree["logging"]["run_name"] = run_name(tree, role)
    return tree


def run_name(tree: dict, role: str) -> str:
    """``transfer-<hash>-<role>``, the hash `config_hash`'s of ``tree`` (every key but logging's): a run is
    named by what it trains, not by the measurement that asks for it, so that measurements sharing a run (one
    pretraining for two held-out PDEs, one scratch arm for two pretrainings) train it once and reuse its folder."""
    return f"transfer-{config_hash(load_config(tree=tree))[:10]}-{role}"  # the loader copies what it edits


def val_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{stage: [(step, validation nRMSE)]} of a run's validated stages (the operator's rollouts, the
    codec's reconstructions; metrics.jsonl, read once; a step logged twice keeps its last)."""
    points: dict[str, dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_bytes().splitlines():
        rec = orjson.loads(line)
        if "stage" in rec and "val_nrmse" in rec:
            points.setdefault(rec["stage"], {})[rec["step"]] = rec["val_nrmse"]
    return {stage: sorted(curve.items()) for stage, curve in points.items()}


def train(tree: dict, folder: Path, *, timeout_s: float | None = None) -> dict:
    """Write ``tree`` to ``folder``/<run name>.yaml and train it with entry.pipeline (a subprocess;
    an interrupted attempt in its run folder resumed from its checkpoint, since a transfer run is
    scored on its steps, not its time; stopped after ``timeout_s``). Returns what the records keep of
    it: run folder, config hash, the test scores of each task (``{label: {"one_step", "rollout", "codec"}}``: the
    operator's one-step nRMSE and nRMSE over the scored rollout, the codec's reconstruction nRMSE), the
    operator's validation curve and the validation of the weights kept (`bench.race_train.kept_validation`:
    ``select``, ``val_nrmse_kept``), the codec's validation curve (``codec_val_curve``), the operator's steps
    and training seconds (validation excluded)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{tree['logging']['run_name']}.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    cfg, run_dir = run_pipeline(SimpleNamespace(config=path, overrides=[]), [], timeout_s=timeout_s,
                                fresh=False)
    scored = orjson.loads((run_dir / "eval.json").read_bytes())["tasks"]
    test = {}
    for label in (task_label(cfg, i) for i in range(len(cfg.data.tasks))):
        op = scored[label]["variants"]["operator"]
        codec = scored[label].get("codec", {}).get("reconstruction_nrmse")
        test[label] = {"one_step": op["one_step_nrmse"], "rollout": op["nrmse"], "codec": codec}
    curves = val_curves(run_dir)
    curve = curves.get("operator", [])
    done = orjson.loads(stage_done_file(run_dir, "operator").read_bytes())
    return {"run_dir": str(run_dir), "config": str(path), "config_hash": config_hash(cfg), "test": test,
            "val_curve": [list(p) for p in curve], **kept_validation(curve, cfg.evaluation.select),
            "codec_val_curve": [list(p) for p in curves.get("autoencoder", [])],
            "steps": cfg.operator.steps, "codec_steps": cfg.autoencoder.steps, "lr": cfg.operator.lr,
            "seed": cfg.training.seed, "train_s": done["final_metrics"]["train_wall_s"]}
