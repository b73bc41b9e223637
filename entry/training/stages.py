"""Which training stages a config has something to train for (shared by the pipeline, the dry-run
estimate and the planner, so none of them imports another for it)."""

from __future__ import annotations

from entry.config.schema import Config
from pipelines.tasks import get_task

TRAINING_STAGES = ("autoencoder", "operator", "diffusion", "consistency", "steady")


def _has_steady(cfg: Config) -> bool:
    return any(get_task(t.name).steady for t in cfg.data.tasks)


def _has_dynamic(cfg: Config) -> bool:
    return any(not get_task(t.name).steady for t in cfg.data.tasks)


def applicable(cfg: Config, name: str) -> bool:
    """Stages with nothing to train on are skipped (no steady task: no steady prior, ...)."""
    if name in ("operator", "diffusion", "consistency"):
        return _has_dynamic(cfg)
    if name == "steady":
        return _has_steady(cfg)
    return True


def selected_training_stages(cfg: Config) -> list[str]:
    """The training stages `cfg.stages` selects that have something to train on, in order."""
    return [name for name in cfg.stages if name in TRAINING_STAGES and applicable(cfg, name)]


STAGE_INPUTS = {"autoencoder": (), "cache": ("autoencoder",), "operator": ("cache",), "diffusion": ("operator",),
                "consistency": ("diffusion",), "steady": ("cache",)}
"""The stages whose results a stage reads (weights or the latent cache); the data come first for all."""


def input_stages(cfg: Config, name: str) -> list[str]:
    """Every stage `name` needs done before it runs, in pipeline order (its inputs' inputs too);
    for `evaluate`, the training stages `cfg.stages` selects and theirs."""
    wanted: set[str] = set()

    def add(stage: str) -> None:
        for dep in STAGE_INPUTS[stage]:
            if dep not in wanted:
                wanted.add(dep)
                add(dep)

    roots = selected_training_stages(cfg) if name == "evaluate" else [name]
    for root in roots:
        add(root)
    if name == "evaluate":
        wanted |= set(roots)
    order = ("autoencoder", "cache", "operator", "diffusion", "consistency", "steady")
    return [s for s in order if s in wanted and applicable(cfg, s)]
