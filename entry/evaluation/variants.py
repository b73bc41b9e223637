"""What a run's evaluation scores: the exported weights it needs, loaded frozen, and the variants
they make (the operator alone, refined by the denoiser or the consistency model, the steady prior),
each as a step function for `core.evaluation`, as the stages' record says (`StageSpec.predict`)."""

from __future__ import annotations

from pathlib import Path

from core.evaluation import StepFnFor
from core.steps.common import SampleNoise
from entry.config.load import ConfigError
from entry.config.schema import Config
from entry.data.files import data_inputs, require_same_data, require_task_file, task_path
from entry.distributed.process_group import DistInfo
from entry.evaluation.long_rollout import member_seed
from entry.models.files import maker_for
from entry.models.weights import load_frozen
from entry.stages.record import STAGES, StageSpec, stage_spec
from entry.storage.atomic import read_json
from entry.storage.run_folder import stage_done_file, weights_file


def required_weights(cfg: Config, run_dir: Path) -> dict[str, Path]:
    """Stage -> weight file this evaluation loads, the stages' record saying which it needs
    (`StageSpec.evaluated`); a required one that is missing is a ConfigError."""
    wanted = [spec for spec in STAGES if spec.evaluated and spec.applies(cfg)]
    for spec in wanted:
        if spec.evaluated == "required" and not weights_file(run_dir, spec.name).is_file():
            raise ConfigError(f"missing weight file {weights_file(run_dir, spec.name)}: train that stage first with "
                              f"`python -m entry.{spec.name} --config CFG` (or run entry.pipeline)")
    return {spec.name: weights_file(run_dir, spec.name) for spec in wanted
            if weights_file(run_dir, spec.name).is_file()}


def checked_data(cfg: Config, run_dir: Path, weights: dict[str, Path]) -> dict[str, str | None]:
    """The task files' fingerprints (`entry.data.files.data_inputs`), once every file is present
    (else a `ConfigError`) and every stage whose `weights` the evaluation scores was trained on
    them: its done file's data fingerprints (`stage_inputs`) differing from these is a `DataError`,
    as its scores would describe neither version. Weights without a readable done file (exported
    by hand) are not checked."""
    for i, task in enumerate(cfg.data.tasks):
        require_task_file(task_path(cfg, task), i)
    for stage in weights:
        try:
            done = read_json(stage_done_file(run_dir, stage)) or {}
        except ValueError:
            continue  # an unreadable done file counts as absent
        inputs = done.get("inputs")
        if isinstance(inputs, dict) and isinstance(inputs.get("data"), dict):
            require_same_data(cfg, inputs["data"], f"stage {stage} was trained on it")
    return data_inputs(cfg)


def variant_name(spec: StageSpec) -> str:
    """The name its scores carry: "<refined>+<name>" for a refiner of stage <refined>'s prediction
    (`StageSpec.refines`: "operator+diffusion"), else its own."""
    return f"{spec.refines}+{spec.name}" if spec.refines else spec.name


STOCHASTIC = tuple(variant_name(spec) for spec in STAGES if spec.samples)
"""Variants that sample noise: an ensemble of them has members that differ."""


def variants(cfg: Config, models: dict, steady: bool, *, member: int = 0) -> dict[str, StepFnFor]:
    """Latent step functions to evaluate for one task, each made per batch of samples, one per stage
    with a prediction (`StageSpec.predict`) whose weights are in `models`, of the steady tasks' or the
    dynamic ones' cache kind; a refiner refines what the model of the stage it refines
    (`StageSpec.refines`) predicts. The samplers draw their noise per sample (``SampleNoise``), so
    scores do not depend on how the test set is split over ranks and batches. ``member`` k picks
    ensemble member k's noise (``member_seed``; member 0 is the single-sample evaluation's)."""
    seed = member_seed(cfg.training.seed, member)
    kind = "steady" if steady else "dynamic"
    out: dict[str, StepFnFor] = {}
    for spec in STAGES:
        if spec.predict is None or spec.cache_kind != kind or spec.name not in models:
            continue

        def step_fn_for(ids, t, spec=spec):
            noise = SampleNoise(seed, ids, t) if spec.samples else None
            predict = spec.predict(cfg, models[spec.name], noise)
            if not spec.refines:
                return predict
            refined = models[spec.refines]
            return lambda z, dt, tid: predict(refined(z, dt, tid), dt, tid)
        out[variant_name(spec)] = step_fn_for
    return out


def load_models(cfg: Config, weights: dict[str, Path], info: DistInfo) -> dict:
    """Stage -> its frozen model, loaded from `weights` (stage -> file). Each is rebuilt from the
    description beside its weights (entry.models.files), so it fits them whatever the config
    says now; weights exported before descriptions were written are built from the config."""
    def from_config(stage: str):
        return lambda: stage_spec(stage).model(cfg)

    return {stage: load_frozen(maker_for(path, from_config(stage)), path, info, compile=cfg.training.compile)
            for stage, path in weights.items()}
