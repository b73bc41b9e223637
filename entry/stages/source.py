"""Fine-tuning's start: a stage model, freshly built by its stage's build, given the weights its
source run (`finetune.from`) exported for that stage.

Every tensor is the source's, but three kinds:
- the task tables (`TASK_TABLE`, the operator's and denoisers' task-id embedding, one row per
  task): a task of the new config that the source trained on (same name and parameter) takes the
  source's row; a new task keeps the row the model was built with, a seeded draw (`place_model`
  seeds the build with `training.seed`) of the model's own initialisation (std 0.02);
- the statistics the stage measures on the new run's data (`MEASURED`: the diffusion residual's
  sigma_data, the steady prior's solution mean): the new run's, since the step's loss weights
  use them;
- nothing else: a tensor of another shape, or one only one side has, is a `CheckpointError`
  (entry.training.finetune refuses such a source before anything runs).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from core.models.denoiser import SIGMA_DATA_KEY, SOLUTION_MEAN_KEY
from core.models.field_codec import dataset_buffer_key, field_key
from entry.config.errors import CheckpointError
from entry.config.from_run import recorded_tree, source_folder
from entry.config.load import load_config
from entry.config.schema import Config, TaskConfig
from entry.models.build import dataset_key, source_field_codec
from entry.storage.run_folder import weights_file

__all__ = ["TASK_TABLE", "MEASURED", "NEW_ROWS_ATTR", "NEW_FIELDS_ATTR", "source_config", "source_stages",
           "source_weights", "task_rows", "new_fields", "forecasts_new_fields", "new_datasets", "transfer_state",
           "start_from"]

TASK_TABLE = "task_embed.weight"
"""State-dict key suffix of a task-id table (`core.models.conditioning.ConditionEmbedding.task_embed`)."""
MEASURED = (SIGMA_DATA_KEY, SOLUTION_MEAN_KEY)
"""State-dict key suffixes of what a stage measures on its data: kept as the new run built them."""
NEW_ROWS_ATTR = "finetune_new_rows"
"""Attribute of a task table's `nn.Embedding` (the module, which sharding keeps) naming its rows the
source did not have and their learning-rate scale: `(rows, scale)` (entry.stages.stage_build)."""
NEW_FIELDS_ATTR = "finetune_new_fields"
"""Attribute of a field codec half's embedding table (an `nn.ParameterDict`) naming the embeddings
of fields the source's codec did not have and their learning-rate scale: `(keys, scale)`."""


def task_key(task: TaskConfig) -> tuple[str, float]:
    """What makes two configs' tasks the same task: its name and parameter."""
    return task.name, task.param


def source_config(cfg: Config) -> Config:
    """The config the source run recorded; `ConfigError` for a folder that holds none."""
    return load_config(tree=recorded_tree(source_folder(cfg.finetune.source)))


def source_stages(source: Config) -> list[str]:
    """The training stages the source run trained (selected and applicable), in order."""
    from entry.stages.record import selected_training_stages  # the records import this module's users

    return selected_training_stages(source)


def source_weights(cfg: Config, stage: str) -> Path | None:
    """The source run's weights of `stage`, or None when the config fine-tunes nothing or the
    source did not train that stage (it then trains from the config's initialisation)."""
    if not cfg.finetune.source:
        return None
    if stage not in source_stages(source_config(cfg)):
        return None
    return weights_file(source_folder(cfg.finetune.source), stage)


def task_rows(source: Config, cfg: Config) -> list[int | None]:
    """For each task of `cfg`, its row in the source's task table (None: a task the source
    did not train on)."""
    rows = {task_key(t): i for i, t in enumerate(source.data.tasks)}
    return [rows.get(task_key(t)) for t in cfg.data.tasks]


def new_fields(cfg: Config) -> list[str]:
    """The fields this config's field codec has and its source's codec has not (new embeddings);
    [] when the config fine-tunes no field codec."""
    theirs = source_field_codec(cfg) if cfg.latent.codec == "fields" else None
    if theirs is None:
        return []
    known = {n for _, fields in theirs["datasets"] for n in fields}
    return list(dict.fromkeys(n for t in cfg.data.tasks for n in t.spec.channels if n not in known))


def forecasts_new_fields(cfg: Config) -> bool:
    """Whether the codec fits its new fields (`new_fields`) by the source operator's forecast as well as
    by reconstruction (`finetune.new_fields: forecast`): False when it meets no new field."""
    return cfg.finetune.new_fields == "forecast" and bool(new_fields(cfg))


def new_datasets(cfg: Config) -> list[str]:
    """The datasets (`entry.models.build.dataset_key`) of this config's tasks that its source's field
    codec has not: their normalisation is fitted on this run's data. A field's mean and scale are a
    statistic of the data, like `MEASURED`: one name can differ 100-fold between datasets (the
    velocity of two flows), and a codec fed fields at another scale than it learned starts far from
    what it learned. The source's datasets keep theirs, so the source's tasks predict at step 0 what
    the source predicts. [] when the config fine-tunes no field codec."""
    theirs = source_field_codec(cfg) if cfg.latent.codec == "fields" else None
    if theirs is None:
        return []
    known = {key for key, _ in theirs["datasets"]}
    return list(dict.fromkeys(dataset_key(t) for t in cfg.data.tasks if dataset_key(t) not in known))


def transfer_state(own: dict[str, torch.Tensor], source: dict[str, torch.Tensor], rows: list[int | None],
                   path: Path, *, grown: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The state dict a model whose own state is `own` starts from: `source`'s tensors, its task
    tables' rows mapped by `rows` (`task_rows`) over `own`'s, the `MEASURED` ones `own`'s, and the
    keys `grown` (a field codec's new fields, which the source lacks) `own`'s. Raises
    `CheckpointError` naming `path` for a tensor of another shape or one only one side has."""
    missing, extra = sorted(set(own) - set(source) - set(grown)), sorted(set(source) - set(own))
    if missing or extra:
        raise CheckpointError(f"incompatible model: the source weights {path} do not hold this config's model "
                              f"(keys only here: {missing[:3]}, only there: {extra[:3]}); fine-tune with the "
                              f"source's model settings (leave the model sections out of the config)")
    out = {}
    for key, mine in own.items():
        if key in grown:
            out[key] = mine
            continue
        theirs = source[key]
        if key.endswith(MEASURED):
            out[key] = mine
        elif key.endswith(TASK_TABLE) and theirs.shape[1:] == mine.shape[1:]:
            table = mine.clone()
            for i, r in enumerate(rows):
                if r is not None:
                    table[i] = theirs[r]
            out[key] = table
        elif theirs.shape != mine.shape:
            raise CheckpointError(f"incompatible model: {key} of the source weights {path} is "
                                  f"{list(theirs.shape)}, this config's model has {list(mine.shape)}; fine-tune "
                                  f"with the source's model settings (leave the model sections out of the config)")
        else:
            out[key] = theirs
    return out


def start_from(model: nn.Module, path: Path, rows: list[int | None], *, new_lr_scale: float,
               new_only: bool = False) -> nn.Module:
    """`model` (freshly built, unwrapped) with the weights at `path` transferred into it
    (`transfer_state`), in place; its task tables marked with their new rows when they have any
    and `new_lr_scale` is not 1 (`NEW_ROWS_ATTR`). `new_only`: every parameter the source had is
    frozen (requires_grad off), so that training moves only a field codec's new field embeddings.
    Returns `model`."""
    try:
        source = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - missing, truncated or garbage: one answer
        raise CheckpointError(f"finetune.from: the source weights {path} are unreadable "
                              f"({type(e).__name__}: {e}); name a finished run folder") from None
    # A field codec grown by datasets the source's lacks: their normalisation and their new fields'
    # embeddings are new.
    fields = [n for n in getattr(model, "fields", ()) if f"encoder.embed.{field_key(n)}" not in source]
    tables = {dataset_buffer_key(k) for k in getattr(model, "datasets", ())} - {
        k.rsplit(".", 1)[-1] for k in source if k.startswith("encoder.scales.")}
    grown = tuple(k for k in model.state_dict() if k.rsplit(".", 1)[-1] in {field_key(n) for n in fields} | tables)
    model.load_state_dict(transfer_state(model.state_dict(), source, rows, path, grown=grown))
    if fields:
        model.start_new_fields(fields)
    if new_only:
        for name, param in model.named_parameters():
            param.requires_grad_(name in grown)
    new = [i for i, r in enumerate(rows) if r is None]
    if new_lr_scale != 1.0:
        for name, module in model.named_modules():
            if new and f"{name}.weight".endswith(TASK_TABLE):
                setattr(module, NEW_ROWS_ATTR, (torch.tensor(new), new_lr_scale))
            if fields and name.endswith("embed") and isinstance(module, nn.ParameterDict):
                setattr(module, NEW_FIELDS_ATTR, ([field_key(n) for n in fields], new_lr_scale))
    return model
