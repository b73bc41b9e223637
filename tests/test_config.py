"""Configs: strict loading with full key paths, overrides, stable hashing, exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from entry.config.load import ConfigError, config_hash, load_config
from tests import tiny_run as tr

ROOT = Path(__file__).resolve().parents[1]
# A `_*.yaml` file is a base: only a config that names it (`base:`) is whole (tests/test_config_base.py).
CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("_"))


def quickstart_tree() -> dict:
    return yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.data.tasks and cfg.latent.tokens > 0


def test_unknown_key_names_path_and_suggests():
    tree = quickstart_tree()
    tree["operator"]["pdet"]["group_sise"] = 4
    with pytest.raises(ConfigError) as e:
        load_config(tree=tree)
    msg = str(e.value)
    assert "operator.pdet.group_sise" in msg and "did you mean 'operator.pdet.group_size'" in msg


@pytest.mark.parametrize("override, needle", [
    ("operator.steps=abc", "operator.steps must be an integer"),
    ("operator.steps=1.5", "operator.steps must be an integer"),
    ("training.compile=3", "training.compile must be true or false"),
    ("training.parallel=zero", "training.parallel must be one of 'fsdp', 'ddp', 'none'"),
    ("operator.pdet.depths=4", "operator.pdet.depths must be a list"),
    ("data.tasks.0.name=heat1d", "data.tasks[0].name must be one of"),
])
def test_wrong_type_names_path_and_allowed(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(tree=quickstart_tree(), overrides=[override])
    assert needle in str(e.value)


@pytest.mark.parametrize("override, needle", [
    ("operator.lr=-1", "operator.lr must be > 0"),
    ("data.split.test_fraction=0.9", "data.split.test_fraction must be in [0.0, 0.5]"),
    ("operator.pdet.num_heads=3", "operator.pdet.hidden_dim (64) must be divisible by num_heads (3)"),
    ("operator.pdet.group_size=3", "operator.pdet.group_size must be even, got 3"),  # was the model's traceback
    ("latent.hidden=6", "latent.hidden: codec grid's learned correction has 4 attention heads"),  # likewise
    ("consistency.sample_steps=3", "consistency.sample_steps must be 1 or 2"),
    ("consistency.sigma_mid=1.5", "consistency.sigma_mid must lie in [0, 1)"),
    ("consistency.sigma_mid=1e-3", "consistency.sigma_mid (0.001) must lie above diffusion.sigma_min"),
    ("diffusion.sampler=ode", "set diffusion.continuous_levels=true"),
    ("diffusion.sample_steps=1", "diffusion.sample_steps must be >= 2"),
    ("data.tasks.1.param=0", "data.tasks[1].param must be > 0"),
    ("stages=[operator, trian]", "unknown stage(s) ['trian']"),
    ("data.task_weights=[1, 2]", "data.task_weights must hold one positive number per task (3)"),
    ("data.task_weights=[1, 0, 1]", "data.task_weights must hold one positive number per task (3)"),
])
def test_out_of_range_names_path(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(tree=quickstart_tree(), overrides=[override])
    assert needle in str(e.value)


def test_missing_required_key():
    tree = quickstart_tree()
    del tree["latent"]["dim"]
    with pytest.raises(ConfigError, match=r"missing required key\(s\) \['latent.dim'\]"):
        load_config(tree=tree)
    # The grid codec (the default) needs its token count; the conv codec takes it from its patch.
    del tree["latent"]["tokens"]
    tree["latent"]["dim"] = 16
    with pytest.raises(ConfigError, match=r"latent.tokens: codec grid needs the tokens per field"):
        load_config(tree=tree)


def test_overrides_apply_and_parse_yaml_values():
    cfg = load_config(tree=quickstart_tree(), overrides=[
        "operator.pdet.depths=[2, 1]", "operator.lr=1e-3", "training.compile=true", "data.tasks.2.nx=16"])
    assert cfg.operator.pdet.depths == (2, 1)
    assert cfg.operator.lr == 1e-3 and isinstance(cfg.operator.lr, float)
    assert cfg.training.compile is True
    assert cfg.data.tasks[2].nx == 16


@pytest.mark.parametrize("changed, kept", [("operator", "diffusion"), ("diffusion", "operator")])
def test_a_set_key_changes_that_key_alone_where_a_yaml_alias_shares_its_section(tmp_path, changed, kept):
    tree = quickstart_tree()
    tree.setdefault("diffusion", {})["pdet"] = tree["operator"]["pdet"]  # dumped as an anchor and its alias
    path = tmp_path / "aliased.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert "*id001" in path.read_text()
    plain = load_config(path)
    heads = 1 if plain.operator.pdet.num_heads != 1 else 2
    cfg = load_config(path, overrides=[f"{changed}.pdet.num_heads={heads}"])
    assert getattr(cfg, changed).pdet.num_heads == heads
    assert getattr(cfg, kept).pdet == getattr(plain, kept).pdet


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(tree=quickstart_tree(), overrides=["operator.steps"])
    with pytest.raises(ConfigError, match="list index below 3"):
        load_config(tree=quickstart_tree(), overrides=["data.tasks.7.nx=3"])


def test_config_is_frozen():
    cfg = load_config(tree=quickstart_tree())
    with pytest.raises(AttributeError):
        cfg.operator.steps = 3  # type: ignore[misc]


def test_hash_ignores_key_order_and_logging_but_not_math():
    tree = quickstart_tree()
    reordered = dict(reversed(list(tree.items())))
    reordered["operator"] = dict(reversed(list(tree["operator"].items())))
    base = config_hash(load_config(tree=quickstart_tree()))
    assert config_hash(load_config(tree=reordered)) == base
    assert config_hash(load_config(tree=quickstart_tree(), overrides=["logging.run_name=other",
                                                                      "logging.wandb.mode=online"])) == base
    assert config_hash(load_config(tree=quickstart_tree(), overrides=["operator.lr=0.00123"])) != base
    # Same value written as int or float hashes the same: the hash sees the typed config.
    assert config_hash(load_config(tree=quickstart_tree(), overrides=["data.tasks.2.param=1"])) == base


def test_section_hash_tracks_only_its_sections():
    a = load_config(tree=quickstart_tree())
    b = load_config(tree=quickstart_tree(), overrides=["operator.lr=0.00123"])
    assert config_hash(a, sections=("data", "latent")) == config_hash(b, sections=("data", "latent"))


def test_check_config_command_exits_2_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    tree = quickstart_tree()
    tree["trainng"] = {}
    bad.write_text(yaml.safe_dump(tree))
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = subprocess.run([sys.executable, "-m", "entry.check_config", "--config", str(bad)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=tr.bare_env())
    assert proc.returncode == 2, proc.stderr
    assert "unknown key 'trainng'" in proc.stderr and "did you mean 'training'" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_missing_data_file_names_key_and_exits_2(tmp_path):
    tree = quickstart_tree()
    tree["data"].update(root=str(tmp_path / "nowhere"), generate_if_missing=False)
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(tree))
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = subprocess.run([sys.executable, "-m", "entry.check_config", "--config", str(cfg_file)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=tr.bare_env())
    assert proc.returncode == 2, proc.stderr
    assert "data.tasks[0].path" in proc.stderr and "1D_Advection_Sols_beta0.1.hdf5" in proc.stderr
    assert "python -m pipelines.generate --task advection1d" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _with_run_name(name: str) -> dict:
    tree = quickstart_tree()
    tree["logging"]["run_name"] = name
    return tree


@pytest.mark.parametrize("name", ["../../tmp/escape", "..", ".", "/tmp/abs", "a/b", "runs/", "a\\b", " ", " padded",
                                  "nul\0byte"])
def test_a_run_name_is_a_name_not_a_path(name):
    """A run name that is a path would write the run folder outside logging.run_dir (`..`: the
    repository root would become a run folder); the loader refuses it, naming the key and the fix."""
    with pytest.raises(ConfigError) as e:
        load_config(tree=_with_run_name(name))
    assert str(e.value).startswith("logging.run_name must be a plain folder name") and "use a plain name" in str(e.value)


def test_an_empty_run_name_is_the_config_hash_and_a_plain_one_is_kept():
    from entry.storage.run_folder import run_dir_for

    cfg = load_config(tree=_with_run_name(""))
    assert run_dir_for(cfg).name == f"run-{config_hash(cfg)}"
    assert run_dir_for(load_config(tree=_with_run_name("my_run-2.v1"))).name == "my_run-2.v1"


def test_every_command_refuses_a_run_name_that_escapes(tmp_path, capfd):
    """A training command exits 2 with one line naming logging.run_name, and creates nothing."""
    from entry.operator import main

    tree = _with_run_name("quickstart")
    tree["logging"]["run_dir"] = str(tmp_path / "runs")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(tree))
    for name in ("../escape", "..", str(tmp_path / "abs")):
        assert main(["--config", str(tmp_path / "cfg.yaml"), "--set", f"logging.run_name={name}"]) == 2
        lines = capfd.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("config error: logging.run_name"), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]


@pytest.mark.parametrize("name", ["quickstart.yaml", "burgers.yaml"])
def test_configs_other_tests_read_whole_name_no_base(name):
    """Tests read these files with yaml.safe_load and edit the tree (test_multinode, test_pipeline_e2e,
    test_precision): a `base:` there would leave them a part of the config, named relative to a copy."""
    tree = yaml.safe_load((ROOT / "configs" / name).read_text())
    assert "base" not in tree
    assert load_config(tree=tree) == load_config(ROOT / "configs" / name)


def test_the_consistency_target_decay_is_not_a_weight_average(tmp_path):
    """`ema_decay` means one thing (a moving average of a stage's exported weights); the
    consistency stage's target network decays by `consistency.target_decay`."""
    from entry.config.load import ConfigError, load_config
    from tests import tiny_run

    tree = tiny_run.tiny_tree(tmp_path)
    assert load_config(tree=tree, overrides=["consistency.target_decay=0.9"]).consistency.target_decay == 0.9
    with pytest.raises(ConfigError, match="target_decay"):
        load_config(tree=tree, overrides=["consistency.ema_decay=0.95"])


@pytest.mark.parametrize("tasks, needle", [
    ([{"name": "burgers1d", "param": 0.01}, {"name": "swe2d", "param": 1.0, "nx": 32}], "different channel counts"),
    ([{"name": "burgers1d"}], "param must be > 0"),
    ([{"layout": "auto"}], "needs path"),
    ([{"name": "swe2d", "param": 1.0, "nx": 32, "resolution": 48}], "multiple of nx"),
    ([{"name": "burgers1d", "param": 0.01, "hdf5": {"fields": [{"key": "u", "axes": "n t x"}]}}], "layout: hdf5"),
    ([{"name": "burgers1d", "param": 0.01, "t_end": -1.0}], "t_end must be >= 0"),
    ([{"name": "darcy2d", "param": 1.0, "nx": 32, "t_end": 1.0}], "darcy2d is steady: remove t_end"),
    ([{"layout": "auto", "path": "any.h5", "t_end": 1.0}], "t_end applies to generated tasks"),
])
def test_tasks_a_run_cannot_train_are_refused_in_one_line(tasks, needle):
    tree = quickstart_tree()
    tree["data"]["tasks"] = tasks
    with pytest.raises(ConfigError) as e:
        load_config(tree=tree)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_loaded_config_pickles_to_an_equal_config(tmp_path):
    """A config crosses to a child process (the dry run's planner) by pickle: the operator's
    section, whose class the model registry makes at run time, comes back equal, settings and all."""
    import pickle

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["operator.arch=transformer", "operator.transformer.depth=3"])
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and type(again.operator) is type(cfg.operator) and again.operator.settings.depth == 3


def test_task_weights_become_the_smallest_integers_in_their_ratios_and_need_balanced_sampling():
    cfg = load_config(tree=quickstart_tree(), overrides=["data.task_weights=[0.5, 0.25, 0.75]"])
    assert cfg.data.integer_task_weights() == [2, 1, 3]
    assert load_config(tree=quickstart_tree()).data.integer_task_weights() is None
    with pytest.raises(ConfigError, match="task_weights set the shares of task_sampling: balanced"):
        load_config(tree=quickstart_tree(), overrides=["data.task_weights=[1, 1, 1]",
                                                       "data.task_sampling=proportional"])


@pytest.mark.parametrize("override", ["data.tasks.0.param=0.2", "data.tasks.0.nx=512", "data.tasks.0.samples=99",
                                      "data.tasks.0.reduce_t=7", "data.tasks.1.initial_step=3",
                                      "data.tasks.0.t_end=1.5", "data.tasks.1.seed=7"])
def test_every_setting_of_a_task_is_in_the_hash(override):
    """Two configs whose tasks differ never share a run folder, done files or a latent cache."""
    assert config_hash(load_config(tree=quickstart_tree(), overrides=[override])) != \
        config_hash(load_config(tree=quickstart_tree()))


@pytest.mark.parametrize("name, recorded", [("quickstart.yaml", "c2845308ee477472"),
                                            ("multitask.yaml", "0a26b604faae43d2"),
                                            ("reduced/ns2d.yaml", "1a27f8068b630631")])
def test_shipped_configs_keep_the_hash_their_recorded_runs_carry(name, recorded):
    """Run folders, done files and latent caches are keyed by the config hash: a key added to the
    schema (hashed only when set) must leave every existing config's hash as it was, or every
    recorded run retrains. The values are these configs' hashes as of 2026-11-27 (e7e9283); multitask.yaml's
    since 2026-11-29, when its Burgers and Darcy tasks took their single-task configs' seed (their files)."""
    assert config_hash(load_config(ROOT / "configs" / name)) == recorded


def test_the_codec_loss_by_default_weighs_each_field_alike_for_the_field_codec_only():
    from entry.stages.autoencoder import autoencoder_step_config

    grid = load_config(tree=quickstart_tree())
    assert autoencoder_step_config(grid).loss == "squared_relative"
    fields = load_config(tree=quickstart_tree(), overrides=["latent.codec=fields", "latent.hidden=16"])
    assert autoencoder_step_config(fields).loss == "nrmse"
    chosen = load_config(tree=quickstart_tree(), overrides=["latent.codec=fields", "latent.hidden=16",
                                                            "autoencoder.loss=mse"])
    assert autoencoder_step_config(chosen).loss == "mse"
