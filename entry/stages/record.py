"""The stages, each defined once: its record (`StageSpec`, entry.stages.spec) is `SPEC` in
entry/stages/<name>.py beside its build, its step settings, its probe and its prediction, and
`STAGES` collects them in the pipeline's order (`entry.config.schema.STAGE_NAMES`, the order of
`Config`'s stage sections). Everything that walks the stages reads `STAGES`: the pipeline's order
and what a stage command builds first (entry.training.stage_sequence), the runner
(entry.training.runner, through `StageSpec.build`), the done files' hashes and provenance
(entry.training.stage_record), the memory plan (entry.plan) and the dry-run estimate
(entry.training.estimate) through `StageSpec.probe`, validation and the evaluation's variants through
`StageSpec.predict`. A stage's command (entry/<name>.py) runs its record.
"""

from __future__ import annotations

import importlib

from entry.config.schema import STAGE_NAMES, Config
from entry.stages.spec import StageSpec

EVALUATE = "evaluate"
"""The last name of `STAGE_NAMES`: the evaluation, which trains nothing and has no record."""


def _records() -> tuple[StageSpec, ...]:
    """`SPEC` of entry/stages/<name>.py for every stage name but the evaluation, in pipeline order."""
    specs = []
    for name in STAGE_NAMES:
        if name == EVALUATE:
            continue
        # Only the stages' own modules, never a command (tests/test_layers.py).
        spec = importlib.import_module(f"entry.stages.{name}").SPEC
        assert spec.name == name, f"entry/stages/{name}.py holds the record of {spec.name!r}"
        specs.append(spec)
    return tuple(specs)


STAGES: tuple[StageSpec, ...] = _records()
"""Every stage, in the order the pipeline runs them (evaluation, not a stage of training, follows)."""

SPECS = {spec.name: spec for spec in STAGES}
TRAINING_STAGES = tuple(spec.name for spec in STAGES if spec.trains)


def stage_spec(name: str) -> StageSpec:
    """The record of stage `name`; a `ValueError` naming the stages for another name."""
    if name not in SPECS:
        raise ValueError(f"no stage named {name!r}; stages: {list(SPECS)}")
    return SPECS[name]


def applicable(cfg: Config, name: str) -> bool:
    """Whether stage `name` has anything to do for `cfg` (evaluation always has)."""
    return name not in SPECS or SPECS[name].applies(cfg)


def selected_training_stages(cfg: Config, names: list[str] | None = None) -> list[str]:
    """The training stages among `names` (default: those `cfg.stages` selects) that have something to
    train on, in order."""
    return [name for name in (cfg.stages if names is None else names)
            if name in TRAINING_STAGES and applicable(cfg, name)]


def upstream(names: list[str]) -> set[str]:
    """Every stage the stages `names` read, transitively (their inputs' inputs too), not `names`."""
    wanted: set[str] = set()
    todo = list(names)
    while todo:
        for dep in SPECS[todo.pop()].reads:
            if dep not in wanted:
                wanted.add(dep)
                todo.append(dep)
    return wanted


def input_stages(cfg: Config, name: str) -> list[str]:
    """Every stage `name` needs done before it runs, in pipeline order (its inputs' inputs too);
    for `evaluate`, the training stages `cfg.stages` selects and theirs."""
    roots = selected_training_stages(cfg) if name == EVALUATE else [name]
    wanted = upstream(roots) | (set(roots) if name == EVALUATE else set())
    return [spec.name for spec in STAGES if spec.name in wanted and spec.applies(cfg)]
