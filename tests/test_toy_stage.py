"""A stage is four files (docs/extending.md, "A stage"): its step (core/steps/<name>.py), its record
(entry/stages/<name>.py: build, step settings, probe, prediction and `SPEC`), its config section
(entry/config/schema.py: the section and its field on `Config`) and its command (entry/<name>.py).
The pipeline's order, the planner, the estimate, the hashes, the evaluation's variants and the
config's tables read the record and the section; no other module restates the stages (issue 48)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from entry.config.load import load_config
from entry.config.schema import STAGE_CONFIGS, STAGE_NAMES, Config
from entry.stages import record
from tests import tiny_run as tr

ROOT = Path(__file__).resolve().parents[1]


def _defines_spec(path: Path) -> bool:
    """Whether the module at `path` assigns `SPEC` at its top level."""
    return any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SPEC" for t in node.targets)
               for node in ast.parse(path.read_text()).body)


def test_every_record_module_is_a_stage_in_pipeline_order(tmp_path):
    """Each entry/stages/<name>.py with a `SPEC` is stage <name>, collected in `STAGE_NAMES` order
    (the order of `Config`'s stage sections, the cache after the codec, the evaluation last), and
    a training stage's record reads its own section, whose class says whether it keeps an average."""
    holders = sorted(p.stem for p in (ROOT / "entry" / "stages").glob("*.py") if _defines_spec(p))
    assert sorted(s.name for s in record.STAGES) == holders
    assert [s.name for s in record.STAGES] == [n for n in STAGE_NAMES if n != record.EVALUATE]
    assert STAGE_NAMES[-1] == record.EVALUATE and STAGE_NAMES.index("cache") == STAGE_NAMES.index("autoencoder") + 1
    assert record.TRAINING_STAGES == tuple(STAGE_CONFIGS) == tuple(
        f for f in Config.__dataclass_fields__ if f in STAGE_CONFIGS)
    cfg = load_config(tree=tr.tiny_tree(tmp_path))
    assert Config(data=cfg.data, latent=cfg.latent).stages == STAGE_NAMES  # the default runs every stage
    for spec in record.STAGES:
        if spec.trains:
            # isinstance: the operator's section is its class with the registry's sections added
            assert isinstance(spec.section(cfg), STAGE_CONFIGS[spec.name]), spec.name
            assert spec.averages == STAGE_CONFIGS[spec.name].KEEPS_AVERAGE, spec.name


STAGE_SPECIFIC = {
    "entry/config/schema.py": ({"autoencoder", "operator"}, "the cache follows the codec; the registry's kind"),
    "entry/config/from_data.py": ({"autoencoder", "operator", "steady"}, "the sections a data-derived config sets"),
    "entry/config/load.py": ({"operator"}, "a key removed from the operator's section, hashed as it was"),
    "entry/data/cache_plan.py": ({"autoencoder", "steady"}, "the encoder that writes the cache; a cache kind"),
    "entry/evaluation/scoring.py": ({"autoencoder"}, "the codec decodes every variant"),
    "entry/evaluation/table.py": ({"operator"}, "advice on the operator, which refiners are judged against"),
    "entry/evaluation/variants.py": ({"steady"}, "a cache kind"),
    "entry/inference/export.py": ({"autoencoder", "operator", "consistency"}, "the exported program's networks"),
    "entry/inference/surrogate.py": ({"autoencoder", "operator", "steady"}, "the codec, the default variant, a kind"),
    "entry/models/build.py": ({"autoencoder", "operator"}, "the registry's operator kind; the source codec a "
                                                           "fine-tuned field codec grows from"),
    "entry/stages/source.py": ({"autoencoder"}, "the source codec, whose fields a fine-tuned field codec extends"),
    "entry/training/finetune.py": ({"autoencoder"}, "a frozen codec cannot grow the new data's fields"),
    "entry/predict.py": ({"operator"}, "the default variant"),
    "entry/stages/spec.py": ({"autoencoder"}, "every stage depends on the codec's section"),
    "entry/training/estimate.py": ({"steady"}, "a cache kind"),
    "entry/training/memory_plan.py": ({"operator"}, "the operator's unroll_steps in the plan's line"),
    "entry/training/validation.py": ({"autoencoder", "steady"}, "the codec validation decodes with; a cache kind"),
    "core/models/pdet.py": ({"operator"}, "the registry's operator kind"),
    "core/models/registry.py": ({"operator"}, "the registry's operator kind"),
    "core/models/transformer.py": ({"operator"}, "the registry's operator kind"),
    "pipelines/inspect.py": ({"steady"}, "a task's steadiness"),
    "bench/accuracy.py": ({"steady"}, "a task's steadiness"),
    "bench/accuracy_scores.py": ({"autoencoder"}, "the codec decodes every variant"),
    "bench/epoch_time.py": ({"operator"}, "times the operator's epoch"),
    "bench/race.py": ({"operator", "steady"}, "ours races with the operator or the steady prior"),
    "bench/solver_pareto.py": ({"operator"}, "the default variant set beside the solver"),
    "bench/startup_time.py": ({"autoencoder", "steady"}, "the codec's weights; a cache kind"),
    "bench/transfer.py": ({"autoencoder"}, "transfer trains the codec and the operator, each for its steps"),
    "bench/transfer_runs.py": ({"autoencoder", "operator"}, "transfer trains the codec and the operator"),
}
"""Library modules that name a training stage for a reason of their own, with the names and why."""


def test_no_library_module_restates_the_stages():
    """Only a stage's own files (its record and its command) name the stages they read; any other
    module names a training stage only for a reason `STAGE_SPECIFIC` states, so a new stage needs
    no edit there."""
    own = {f"entry/stages/{n}.py" for n in STAGE_NAMES} | {f"entry/{n}.py" for n in STAGE_NAMES}
    found = {}
    for top in ("entry", "core", "pipelines", "bench"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            names = {node.value for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in STAGE_CONFIGS}
            if names and rel not in own:
                found[rel] = names
    extra = {f: sorted(n - STAGE_SPECIFIC.get(f, (set(),))[0]) for f, n in found.items()
             if n - STAGE_SPECIFIC.get(f, (set(),))[0]}
    assert extra == {}, f"modules that name stages: read the record (entry.stages.record) instead: {extra}"


TOY_STEP = '''"""The toy stage's step: the one-step latent MSE, scaled."""

from dataclasses import dataclass

from torch.func import functional_call

from core.steps.common import make_metrics, per_sample_mse


@dataclass(frozen=True)
class ToyStepConfig:
    scale: float = 1.0


def toy_step(model, params, batch, *, cfg, generator):
    pred = functional_call(model, params, (batch["z_t"], batch["dt"], batch["task_id"]))
    loss_B = cfg.scale * per_sample_mse(pred, batch["z_next"])
    return loss_B.mean(), make_metrics(latent_mse=loss_B.mean())
'''

TOY_RECORD = '''"""The toy stage's record and build: an operator-shaped model trained with the toy step."""

from core.steps.toy import ToyStepConfig, toy_step
from entry.distributed.memory_sim import StageProbe
from entry.models.build import build_operator
from entry.stages.parts import StageParts
from entry.stages.spec import BASE_SECTIONS, StageSpec, has_dynamic, latent_batch
from entry.stages.stage_build import latent_pair_loader, optimizer_for, place_model


def toy_step_config(cfg):
    return ToyStepConfig(scale=cfg.toy.scale)


def build(cfg, info, run_dir, logger):
    loader = latent_pair_loader(cfg, info, "dynamic", "train", global_batch=cfg.toy.batch_size)
    model = place_model(lambda: build_operator(cfg), cfg, info)
    optimizer, scheduler = optimizer_for(model, cfg.toy, info)
    return StageParts("toy", model, toy_step, toy_step_config(cfg), loader, optimizer, scheduler)


def predict(cfg, model, generator):
    return model


def probe(cfg):
    return StageProbe("toy", lambda: build_operator(cfg), toy_step, toy_step_config(cfg), latent_batch(cfg))


SPEC = StageSpec("toy", ("cache",), ("autoencoder",), BASE_SECTIONS + ("operator", "toy", "evaluation"), has_dynamic,
                 lambda c: c.toy, toy_step_config, probe, model=build_operator, evaluated="optional", build=build,
                 cache_kind="dynamic", predict=predict)
'''

TOY_COMMAND = '''"""`python -m entry.toy --config CFG`: train the toy stage."""

import sys

from entry.training.stage_command import stage_command

main = stage_command("toy", __doc__)

if __name__ == "__main__":
    sys.exit(main())
'''

TOY_SECTION = '''@dataclass(**_frozen)
class ToyConfig(StageConfig):
    """A toy stage."""

    RUN_CONTROL_KEYS = ("report_digits",)

    scale: float = 1.0
    """Loss scale."""
    report_digits: int = 3
    """Digits a report would show: run control."""


'''

CHECK = '''
import sys
import torch
from entry.config.identity import RUN_CONTROL_KEYS, math_hash
from entry.config.load import ConfigError, load_config
from entry.config.schema import STAGE_NAMES
from entry.distributed.process_group import DistInfo
from entry.evaluation.variants import STOCHASTIC, load_models, variants
from entry.storage.run_folder import run_dir_for, weights_file
from entry.stages import record
from entry.training.memory_plan import plan_stages
from entry.training.stage_record import stage_hash
import entry.stages.toy as toy
import entry.toy

cfg_path = sys.argv[1]
assert STAGE_NAMES[-3:] == ("steady", "toy", "evaluate"), STAGE_NAMES
assert record.stage_spec("toy") is toy.SPEC and "toy" in record.TRAINING_STAGES
assert RUN_CONTROL_KEYS["toy"] == ("report_digits",) and "toy" not in STOCHASTIC
cfg = load_config(cfg_path)
assert record.input_stages(cfg, "toy") == ["autoencoder", "cache"]
assert stage_hash(cfg, "toy") == stage_hash(load_config(cfg_path, ["toy.report_digits=5"]), "toy")
assert stage_hash(cfg, "toy") != stage_hash(load_config(cfg_path, ["toy.scale=2"]), "toy")
assert stage_hash(cfg, "operator") == stage_hash(load_config(cfg_path, ["toy.scale=2"]), "operator")
try:
    load_config(cfg_path, ["toy.ema_decay=0.9"])
    raise AssertionError("ema_decay accepted")
except ConfigError as e:
    assert "only the autoencoder, operator and steady stages" in str(e), e
# The command builds its inputs (the codec, the cache), trains, exports; the evaluation scores it.
assert entry.toy.main(["--config", cfg_path]) == 0
planned = load_config(cfg_path, ["training.precision=fp32", "training.compile=false"])
assert list(plan_stages(planned, world_size=1)["stages"]) == ["autoencoder", "operator", "toy"]
info = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)
path = weights_file(run_dir_for(cfg), "toy")
assert path.is_file(), path
models = load_models(cfg, {"toy": path}, info)
step = variants(cfg, models, steady=False)["toy"](torch.arange(2), torch.zeros(2, dtype=torch.long))
z = torch.randn(2, 8, 8)
assert step(z, torch.full((2,), 0.01), torch.zeros(2, dtype=torch.long)).shape == z.shape
print("toy stage ok")
'''


@pytest.mark.timeout(600)
def test_a_toy_stage_added_in_four_files_runs(tmp_path):
    """A copy of the code with a toy stage added in four files and nothing else edited: its name
    takes its place in the pipeline's order, the planner plans it, its hash reads its section
    (its run-control key excluded), the config refuses an average it keeps none of, its command
    builds its inputs and trains it, and the evaluation predicts with it."""
    code = tmp_path / "code"
    for top in ("entry", "core", "pipelines"):
        shutil.copytree(ROOT / top, code / top, ignore=shutil.ignore_patterns("__pycache__"))
    (code / "core/steps/toy.py").write_text(TOY_STEP)
    (code / "entry/stages/toy.py").write_text(TOY_RECORD)
    (code / "entry/toy.py").write_text(TOY_COMMAND)
    schema = code / "entry/config/schema.py"
    text = schema.read_text()
    section_at = text.index("@dataclass(**_frozen)\nclass TrainingConfig")
    field_at = text.index("    training: TrainingConfig = field(default_factory=TrainingConfig)")
    schema.write_text(text[:section_at] + TOY_SECTION + text[section_at:field_at]
                      + '    toy: ToyConfig = field(default_factory=ToyConfig)\n    """Toy stage."""\n'
                      + text[field_at:])
    tree = tr.tiny_tree(tmp_path)
    tree["autoencoder"]["steps"] = 1
    tree["toy"] = {"steps": 2, "batch_size": 8}
    tree["stages"] = ["autoencoder", "cache", "operator", "toy", "evaluate"]
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tree))
    env = {**tr.env(), "PYTHONPATH": tr.python_path(code)}
    done = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path / "tiny.yaml")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "toy stage ok" in done.stdout
