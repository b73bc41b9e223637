"""Fine-tuning from a finished run (`finetune.from`, issue 50 item 4): a fine-tuned run at step 0
predicts what its source predicts on the source's tasks (also after a task is added); a bad source
exits 2 with one line and writes nothing; a changed source retrains what depends on it; a config
of data, source and logging takes every other section from the source's config.json.

The source runs are `tests.inference_runs.finished_run`'s (seeded untrained weights of every
stage the evaluation loads); a fine-tuned run at step 0 is its stages' models as their builds
start them (`from_source` over the stage's model, placed with the config's seed), exported."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from entry.config.load import ConfigError, config_hash, config_to_dict, load_config
from entry.distributed.process_group import DistInfo
from entry.inference import load_run
from entry.models.files import description_bytes, write_weights_with
from entry.stages.record import SPECS, STAGES
from entry.stages.source import NEW_FIELDS_ATTR, NEW_ROWS_ATTR, TASK_TABLE
from entry.stages.stage_build import from_source, place_model, place_with_copy, scale_new_rows
from entry.storage.run_folder import run_dir_for, weights_file, write_run_header
from entry.training.finetune import check_source
from entry.training.stage_record import stage_inputs, stage_status, write_done
from tests.inference_runs import finished_run, tree_1d, tree_2d
from tests.tiny_run import env, run_here

INFO = DistInfo(0, 1, 0, torch.device("cpu"), None, 0)
TASKED = ("operator", "diffusion", "consistency")
"""The 1D source's stages with a task table."""


def logging_of(root, name: str) -> dict:
    return {"run_dir": str(root / "runs"), "run_name": name, "progress": False, "wandb": {"mode": "disabled"}}


def finetune_tree(root, source, tasks: list[dict], name: str = "ft", **finetune) -> dict:
    """The three-key config: the new data, the source run, where to write."""
    return {"data": {"tasks": tasks}, "finetune": {"from": str(source), **finetune}, "logging": logging_of(root, name)}


def step0_run(cfg):
    """The run folder of `cfg` with each stage its source trained as its build starts it: built
    with the config's seed, the source's weights transferred (`from_source`), exported."""
    run_dir = run_dir_for(cfg)
    write_run_header(run_dir, cfg, INFO)
    for spec in STAGES:
        if spec.evaluated and spec.applies(cfg):
            model = place_model(from_source(lambda s=spec: s.model(cfg), cfg, spec.name), cfg, INFO)
            state = model.state_dict()
            write_weights_with(weights_file(run_dir, spec.name), lambda tmp, s=state: torch.save(s, tmp),
                               description_bytes(model))
    return run_dir


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("source")
    _, run = finished_run(root, tree_1d(root), generate=False)
    return root, run


def given(run, n: int = 3):
    s = load_run(run)
    g = s.tasks[0].given_steps
    return torch.randn(n, g, 1, 32, generator=torch.Generator().manual_seed(1))


def test_a_finetuned_run_at_step_0_predicts_what_its_source_predicts(source, tmp_path):
    root, run = source
    tasks = config_to_dict(load_run(run).config)["data"]["tasks"]
    cfg = load_config(tree=finetune_tree(tmp_path, run, tasks))
    ft = load_run(step0_run(cfg))
    src = load_run(run)
    u = given(run)
    for variant in ("operator", "operator+diffusion", "operator+consistency"):
        a = src.rollout(u, 4, variant=variant, seed=5)
        b = ft.rollout(u, 4, variant=variant, seed=5)
        assert torch.equal(a, b), variant
    # The weights themselves are the source's (no task was added: every tensor).
    for name in ("autoencoder", *TASKED):
        mine = torch.load(weights_file(ft.run_dir, name), weights_only=True)
        theirs = torch.load(weights_file(run, name), weights_only=True)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), name


def test_a_finetuned_average_starts_at_the_source_from_one_read(source, tmp_path):
    """`operator.ema_decay` when fine-tuning: the model and its moving average both start at the
    source's weights, the source file is read once, and the average is a frozen copy that the
    model's steps leave alone."""
    root, run = source
    tasks = config_to_dict(load_run(run).config)["data"]["tasks"]
    cfg = load_config(tree=finetune_tree(tmp_path, run, tasks), overrides=["operator.ema_decay=0.99"])
    reads = []
    start = from_source(lambda: SPECS["operator"].model(cfg), cfg, "operator")

    def counted():
        reads.append(1)
        return start()

    model, average = place_with_copy(counted, cfg, INFO, copied=cfg.operator.ema_decay > 0)
    assert len(reads) == 1
    theirs = torch.load(weights_file(run, "operator"), weights_only=True)
    for placed in (model, average):
        mine = placed.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert all(p.requires_grad for p in model.parameters())
    assert not any(p.requires_grad for p in average.parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, theirs[k]) for k, v in average.state_dict().items())
    assert place_with_copy(counted, cfg, INFO, copied=False)[1] is None


def test_a_new_task_gets_a_new_row_and_leaves_the_source_tasks_predictions_bitwise(source, tmp_path):
    root, run = source
    tasks = config_to_dict(load_run(run).config)["data"]["tasks"]
    new = {**tasks[0], "param": 0.4}
    # The source's task first: a refiner's noise ids follow the task's place (the model's rows do not).
    cfg = load_config(tree=finetune_tree(tmp_path, run, [tasks[0], new]))
    ft = load_run(step0_run(cfg))
    src = load_run(run)
    u = given(run)
    for variant in ("operator", "operator+diffusion", "operator+consistency"):
        assert torch.equal(src.rollout(u, 4, variant=variant, seed=5, task=0),
                           ft.rollout(u, 4, variant=variant, seed=5, task=0)), variant
    # The operator's prediction of a task does not depend on its place in the config.
    shuffled = load_config(tree=finetune_tree(tmp_path, run, [new, tasks[0]], name="shuffled"))
    assert torch.equal(src.rollout(u, 4, task=0), load_run(step0_run(shuffled)).rollout(u, 4, task=1))
    for name in TASKED:
        (key,) = [k for k in torch.load(weights_file(run, name), weights_only=True) if k.endswith(TASK_TABLE)]
        theirs = torch.load(weights_file(run, name), weights_only=True)[key]
        mine = torch.load(weights_file(ft.run_dir, name), weights_only=True)[key]
        assert mine.shape[0] == 2 and torch.equal(mine[0], theirs[0]), name
        # The new row is the model's own seeded initialisation (std 0.02), not a copy of the source's.
        fresh = place_model(lambda s=SPECS[name]: s.model(cfg), cfg, INFO).state_dict()[key]
        assert torch.equal(mine[1], fresh[1]) and not torch.equal(mine[1], theirs[0]), name


def test_a_grid_codec_fine_tunes_at_a_resolution_its_source_never_saw(source, tmp_path):
    root, run = source
    tasks = config_to_dict(load_run(run).config)["data"]["tasks"]
    cfg = load_config(tree=finetune_tree(tmp_path, run, [{**tasks[0], "nx": 64}]))
    assert check_source(cfg)  # not refused as another model: the codec keeps the source's cosine modes
    ft = load_run(step0_run(cfg))
    theirs = torch.load(weights_file(run, "autoencoder"), weights_only=True)
    mine = torch.load(weights_file(ft.run_dir, "autoencoder"), weights_only=True)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    # The source's linear path reads a field of its cosine modes (4 a cell, 8 cells) at 64 points as at 32.
    cells, modes = 8, 4
    coef = torch.randn(cells, modes, generator=torch.Generator().manual_seed(2))
    k = torch.arange(modes)

    def sampled(points: int) -> torch.Tensor:
        s = (torch.arange(points // cells) + 0.5) / (points // cells)
        basis = torch.where(k == 0, 1.0, 2 ** 0.5) * torch.cos(torch.pi * k * s[:, None])  # [points/cell, modes]
        return (coef @ basis.T).reshape(1, 1, points)

    encoder = ft.models["autoencoder"].encoder
    linear = [encoder.linear["1d"].encode(encoder.cell_coefficients(sampled(n))) for n in (32, 64)]
    torch.testing.assert_close(linear[1], linear[0], atol=1e-4, rtol=1e-4)
    rolled = ft.rollout(torch.randn(2, ft.tasks[0].given_steps, 1, 64, generator=torch.Generator().manual_seed(1)), 3)
    assert rolled.shape[-1] == 64 and rolled.isfinite().all()


def test_three_keys_take_every_other_section_from_the_source(source, tmp_path):
    root, run = source
    src = load_run(run).config
    tasks = config_to_dict(src)["data"]["tasks"]
    cfg = load_config(tree=finetune_tree(tmp_path, run, tasks))
    mine, theirs = config_to_dict(cfg), config_to_dict(src)
    for section in mine:
        if section not in ("logging", "finetune", "derived"):
            assert mine[section] == theirs[section], section
    assert cfg.finetune.source == str(run) and cfg.logging.run_name == "ft"
    assert any(str(run) in line for line in cfg.derived) and any("operator" in line for line in cfg.derived)
    # A section the config gives is merged over the source's key by key; --set applies before the merge.
    over = load_config(tree={**finetune_tree(tmp_path, run, tasks), "operator": {"lr": 1e-4}},
                       overrides=["training.seed=9"])
    assert over.operator.lr == 1e-4 and over.operator.pdet == src.operator.pdet and over.training.seed == 9
    # The recorded config of a fine-tuned run loads alone (it names its latent: nothing is taken again).
    again = load_config(tree=config_to_dict(cfg))
    assert config_hash(again) == config_hash(cfg) and again.derived == cfg.derived


def test_the_finetune_section_is_strict_and_leaves_other_configs_hashes_alone(tmp_path):
    tree = tree_1d(tmp_path)
    plain = load_config(tree=tree)
    assert "finetune" not in config_to_dict(plain) or config_hash(plain) == config_hash(
        load_config(tree={**tree, "finetune": {"from": "", "freeze": [], "new_lr_scale": 1.0}}))
    with pytest.raises(ConfigError, match=r"unknown key 'finetune.source'.*'from'"):
        load_config(tree={**tree, "finetune": {"source": "x"}})
    with pytest.raises(ConfigError, match="finetune.freeze has unknown training stage"):
        load_config(tree={**tree, "finetune": {"from": "x", "freeze": ["cache"]}})
    with pytest.raises(ConfigError, match="finetune.from is empty"):
        load_config(tree={**tree, "finetune": {"freeze": ["autoencoder"]}})
    with pytest.raises(ConfigError, match="new_lr_scale must be > 0"):
        load_config(tree={**tree, "finetune": {"new_lr_scale": 0}})


def test_a_changed_source_retrains_the_stages_that_start_from_it(source, tmp_path):
    root, run = source
    copy = tmp_path / "src"
    shutil.copytree(run, copy)
    tasks = config_to_dict(load_run(run).config)["data"]["tasks"]
    cfg = load_config(tree=finetune_tree(tmp_path, copy, tasks))
    run_dir = step0_run(cfg)
    for stage in ("autoencoder", "operator", "diffusion"):
        write_done(run_dir, stage, cfg, stage_inputs(cfg, run_dir, stage))
        assert stage_status(run_dir, stage, cfg) == (True, "complete"), stage
    # The source's diffusion weights change: diffusion retrains; the codec and operator stand.
    state = torch.load(weights_file(copy, "diffusion"), weights_only=True)
    key = next(k for k, v in state.items() if v.is_floating_point() and v.numel() > 1)
    state[key] = state[key] + 1
    torch.save(state, weights_file(copy, "diffusion"))
    done, why = stage_status(run_dir, "diffusion", cfg)
    assert not done and "source diffusion" in why
    assert stage_status(run_dir, "autoencoder", cfg)[0] and stage_status(run_dir, "operator", cfg)[0]
    # A run that fine-tunes nothing records no source (its done files are as they were).
    plain = load_config(tree=tree_1d(tmp_path))
    assert "source" not in stage_inputs(plain, run_dir_for(plain), "operator")


def _pipeline(cfg_path, *overrides: str) -> subprocess.CompletedProcess:
    args = [x for o in overrides for x in ("--set", o)]
    return subprocess.run([sys.executable, "-m", "entry.pipeline", "--config", str(cfg_path), *args],
                          capture_output=True, text=True, timeout=240, env=env())


def _pipeline_here(capfd, cfg_path, *overrides: str) -> subprocess.CompletedProcess:
    """`_pipeline` as entry.pipeline's `main` in this process."""
    from entry.pipeline import main

    return run_here(main, ["--config", str(cfg_path), *[x for o in overrides for x in ("--set", o)]], capfd)


def test_a_bad_source_exits_2_with_one_line_and_writes_nothing(source, tmp_path, capfd):
    root, run = source
    tasks = config_to_dict(load_run(run).config)["data"]["tasks"]
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run, unfinished)
    weights_file(unfinished, "operator").unlink()
    empty = tmp_path / "empty"
    empty.mkdir()
    root2d = tmp_path / "r2d"
    root2d.mkdir()
    _, run2d = finished_run(root2d, tree_2d(root2d), generate=False)
    fitted = tree_2d(root2d)  # a conv codec whose linear path is fitted to its 16 x 16 grid
    fitted["latent"]["linear"], fitted["logging"]["run_name"] = "global", "global"
    _, run_global = finished_run(root2d, fitted, generate=False)
    wide = tree_1d(root2d)  # a 1D grid codec of 16 tokens (a 2D task's count too)
    wide["latent"]["tokens"], wide["logging"]["run_name"] = 16, "wide"
    _, run_1d = finished_run(root2d, wide, generate=False)
    ns = [{"name": "ns2d", "param": 0.001, "samples": 20, "nx": 16, "nt": 6, "initial_step": 2}]
    dr32 = [{**config_to_dict(load_run(run2d).config)["data"]["tasks"][0], "nx": 32}]
    phase = [{"name": "allen_cahn2d", "param": 0.001, "samples": 20, "nx": 16, "nt": 6, "initial_step": 2}]
    cases = [  # (source, tasks, overrides, what the line says)
        (tmp_path / "missing", tasks, [], "is not a folder"),
        (empty, tasks, [], "config.json is missing"),
        (unfinished, tasks, [], "operator.pt is missing"),
        (run, tasks, ["operator.pdet.hidden_dim=32"], "incompatible model: the source's operator model differs"),
        (run2d, ns, [], "incompatible model: the source's codec reads 2 fields, the new data have 3"),
        (run_global, dr32, [], "fitted to its data's [16, 16] grid (latent.linear: global), the new data are on [32"),
        (run_1d, phase, [], "the source's codec serves [1]D fields, the new data have [2]D ones"),
    ]
    for i, (src, task_list, overrides, says) in enumerate(cases):
        tree = finetune_tree(tmp_path, src, task_list, name=f"bad{i}")
        tree["data"]["root"] = str(tmp_path / "data")
        cfg_path = tmp_path / f"bad{i}.yaml"
        cfg_path.write_text(yaml.safe_dump(tree))
        # The first case as a user meets it; the others through the same `main` in this process
        # (a process start costs ~3 CPU-seconds; the refusal's path is one for every case).
        out = _pipeline(cfg_path, *overrides) if i == 0 else _pipeline_here(capfd, cfg_path, *overrides)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (says, out.stderr[-2000:])
        assert lines[0].startswith("config error: finetune.from") and says in lines[0], lines[0]
        assert not (tmp_path / "runs" / f"bad{i}").exists() and not (tmp_path / "data").exists(), says


def test_check_source_refuses_a_frozen_task_table_for_other_tasks(source, tmp_path):
    root, run = source
    tasks = config_to_dict(load_run(run).config)["data"]["tasks"]
    same = load_config(tree=finetune_tree(tmp_path, run, tasks, freeze=["autoencoder", "operator"]))
    check_source(same)  # the same tasks: every stage may be frozen
    other = load_config(tree=finetune_tree(tmp_path, run, [*tasks, {**tasks[0], "param": 0.4}],
                                           freeze=["autoencoder"]))
    lines = check_source(other)  # the codec has no task table; the start-up block names what starts where
    assert "starting from its weights: operator, diffusion, consistency" in lines[1]
    assert "frozen, copied from it: autoencoder" in lines[1] and lines[2].endswith(": advection1d_param0.4")
    with pytest.raises(ConfigError, match="frozen operator keeps the source's task table"):
        check_source(load_config(tree=finetune_tree(tmp_path, run, [*tasks, {**tasks[0], "param": 0.4}],
                                                    freeze=["operator"])))
    steady = load_config(tree=finetune_tree(tmp_path, run, tasks, freeze=["steady"]))
    with pytest.raises(ConfigError, match="did not train steady"):
        check_source(steady)


def test_new_lr_scale_scales_the_new_rows_updates_only():
    def stepped(scale: float) -> torch.Tensor:
        torch.manual_seed(0)
        table = torch.nn.Embedding(3, 4)
        if scale != 1.0:
            setattr(table, NEW_ROWS_ATTR, (torch.tensor([2]), scale))
        opt = torch.optim.AdamW(table.parameters(), lr=1e-2)
        scale_new_rows(opt, table)
        start = table.weight.detach().clone()
        table(torch.tensor([0, 1, 2])).square().sum().backward()
        opt.step()
        return table.weight.detach() - start

    one, ten = stepped(1.0), stepped(10.0)
    assert torch.equal(one[:2], ten[:2])  # the source's rows step as before
    torch.testing.assert_close(ten[2], 10 * one[2])


class _Tabled(torch.nn.Module):
    """A task table of 4 rows (over 3 ranks FSDP2 gives rank 2 none) before one block."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(4, 3)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 2)])
        setattr(self.table, NEW_ROWS_ATTR, (torch.tensor([1, 2]), 10.0))

    def blocks(self):
        return list(self.layers)

    def forward(self, ids):
        return self.layers[0](self.table(ids))


def _tabled_step(model: torch.nn.Module) -> None:
    """One AdamW step of ``model`` with its new rows' rate scaled (`scale_new_rows`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scale_new_rows(opt, model)
    model(torch.tensor([0, 1, 2, 3, 3])).square().sum().backward()
    opt.step()


def _tabled_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from entry.distributed.sharding import full_state_dict, wrap_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    info = DistInfo(rank, world, rank, torch.device("cpu"), "gloo", 0)
    model = wrap_model(_Tabled(), info, parallel="fsdp", precision="fp32")
    _tabled_step(model)
    state = full_state_dict(model, info)
    if rank == 0:
        torch.save(state, out)
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_new_lr_scale_under_fsdp2_steps_the_sharded_table_as_one_process_steps_it(tmp_path, world):
    """Each rank scales the new rows its shard holds (rows 1 and 2: one on each of 2 ranks; over 3
    ranks rank 2's shard is empty): the gathered table is the one-process table's."""
    import torch.multiprocessing as mp

    from tests.tiny_run import free_port

    mp.start_processes(_tabled_rank, args=(world, free_port(), str(tmp_path / "sd.pt")), nprocs=world,
                       start_method="fork")  # fork: a spawned child would import this module again
    one = _Tabled()
    _tabled_step(one)
    got = torch.load(tmp_path / "sd.pt")
    for key, value in one.state_dict().items():
        torch.testing.assert_close(got[key], value, msg=key)


def test_new_lr_scale_scales_a_new_field_embedding_s_updates_only():
    def stepped(scale: float) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        embed = torch.nn.ParameterDict({"f_u": torch.nn.Parameter(torch.randn(4)),
                                        "f_new": torch.nn.Parameter(torch.randn(4))})
        if scale != 1.0:
            setattr(embed, NEW_FIELDS_ATTR, (["f_new"], scale))
        opt = torch.optim.AdamW(embed.parameters(), lr=1e-2)
        scale_new_rows(opt, embed)
        start = {k: v.detach().clone() for k, v in embed.items()}
        (embed["f_u"] * embed["f_new"]).sum().backward()
        opt.step()
        return {k: v.detach() - start[k] for k, v in embed.items()}

    one, ten = stepped(1.0), stepped(10.0)
    assert torch.equal(one["f_u"], ten["f_u"])  # the source's field steps as before
    torch.testing.assert_close(ten["f_new"], 10 * one["f_new"])


def test_the_pipeline_fine_tunes_with_a_frozen_codec_and_the_operator_starts_from_the_source(tmp_path):
    """End to end on a tiny trained source: the frozen codec is the source's file, its done file
    records the source; the operator's build (the stage's own) starts from the source's weights."""
    import logging

    from tests.tiny_run import tiny_tree

    tree = tiny_tree(tmp_path)
    tree["stages"] = ["autoencoder", "cache", "operator", "evaluate"]
    tree["operator"]["steps"] = 3
    tree["evaluation"].update(max_test_samples=2, plot_samples=0)
    (tmp_path / "src.yaml").write_text(yaml.safe_dump(tree))
    assert _pipeline(tmp_path / "src.yaml").returncode == 0
    source = tmp_path / "runs" / "base"
    ft = finetune_tree(tmp_path, source, tree["data"]["tasks"], freeze=["autoencoder"])
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(ft))
    out = _pipeline(tmp_path / "ft.yaml")
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "runs" / "ft"
    assert weights_file(run, "autoencoder").read_bytes() == weights_file(source, "autoencoder").read_bytes()
    done = yaml.safe_load((run / "autoencoder.done.json").read_text())
    assert done["frozen"] and set(done["inputs"]["source"]) == {"autoencoder"}
    assert set(yaml.safe_load((run / "operator.done.json").read_text())["inputs"]["source"]) == {"autoencoder",
                                                                                                "operator"}
    assert (run / "eval.json").is_file()
    cfg = load_config(tmp_path / "ft.yaml")
    parts = SPECS["operator"].build(cfg, INFO, run, logging.getLogger("test"))
    theirs = torch.load(weights_file(source, "operator"), weights_only=True)
    mine = parts.model.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    if hasattr(parts.loader, "close"):
        parts.loader.close()
