"""`python -m bench.transfer --held-out NAME[:PARAM] [--held-out-config CFG] [--base CFG] [--set k=v]
[--ns 8,16,...,512] [--steps S] [--codec-steps S] [--lrs 3e-4,1e-3,3e-3] [--new-lr-scales 1,10] [--sweep-n N]
[--seeds 0,1,2] [--rollout-steps 10] [--guard-seeds 0,1,2] [--freeze autoencoder] [--new-fields forecast]
[--select last|best] [--tag T] [--out FILE.jsonl] [--jobs J] [--run-timeout-s S] [--report-only] [--allow-dirty]`

How much pretraining on a mixture of PDEs buys a PDE it never saw (issue 50, item 5):

1. **Pretrain** on the base config's tasks (default configs/universal/pretrain.yaml; generated or declared files)
   without the held-out one (``--held-out``; a task the base does not hold, such as the Kolmogorov flow, comes
   from ``--held-out-config`` and reads the base's data root).
2. **Per training-set size N** of ``--ns``, the held-out task's first N training trajectories
   (``data.tasks[i].train_trajectories``; its validation and test splits unchanged) train a **fine-tuned** model
   (``finetune.from`` the pretrained run) and a **scratch** model (the same config, no source): the same architecture
   and the same optimizer steps (``--steps`` of the operator, ``--codec-steps`` of the codec; default the base's),
   each with its own operator learning rate, chosen among ``--lrs`` on the held-out task's validation split at
   ``--sweep-n`` (default the largest N; seed 0's run of the chosen rate is that size's seed-0 result). The fine-tuned
   arm's sweep also tries each of ``--new-lr-scales`` (`finetune.new_lr_scale`: the rate of what fine-tuning adds, new
   field embeddings and task rows, over the rest), since a new field's embedding starts untrained beside a trained
   codec; the scratch model has nothing new to scale. ``--select best``: both arms keep their lowest validation's
   weights (``evaluation.select``, ten validations a run), not the base's choice: a budget that lets scratch converge
   at the top N overfits a few trajectories, and Poseidon's fine-tuned and scratch runs alike keep their best
   (scOT/train.py: ``load_best_model_at_end``). The pretraining and the guard rail keep the base's selection (one
   pretraining serves both).
3. **Scores**: the held-out task's test one-step nRMSE and the nRMSE of a ``--rollout-steps`` rollout (eval.json, the
   same test trajectories for every run); EG = top / N*, N* the smallest N whose fine-tuned score matches the scratch
   model's at the top N, interpolated in log N (`bench.transfer_gain`), for each score. Seeds: the first of
   ``--seeds`` at every N, all of them at the top N (both arms) and, once N* is known, at the sizes around it (fine-
   tuned).
4. **Guard rail**: each source task's test scores from the mixture model against a single-task model trained on it
   alone for its share of the mixture's steps (the mixture's over its task count, or by ``data.task_weights``: the
   mixture trains for the sum). ``--guard-seeds`` (default the first of ``--seeds``) adds seeds to both: each task
   alone at each of them, then the mixture again at each but the first (a pretraining each; the fine-tuned arm starts
   from the first's), so that a ratio near the bar can be set against the seeds' spread.

``--jobs J`` trains up to J runs at once, each with the machine's cores over J as its threads (``OMP_NUM_THREADS``,
unless set): the guard rail's single-task runs beside the pretraining, then a sweep's trials, a size's seeds and the
sizes of one arm side by side. On a small CPU, where one run leaves a core half idle, two jobs finish the measurement
sooner; each run is the same training, so its scores do not depend on J beyond the float order of its thread count.

Every training is `python -m entry.pipeline` on a config derived from the base (`bench.transfer_runs`): stages
autoencoder, cache, operator, evaluate; the runs' order and ``--jobs``: `bench.transfer_measure`. Records (one JSON
line each, `bench.result_store`: a re-run trains only what is missing) carry the commit, whether the tree was dirty,
each task file's fingerprint, the base config's hash and the budget; a store holding records of other data, another
base config, held-out task or budget, or of a dirty tree (for a clean run) is refused. Results:
``bench/results/transfer-<date>-<tag>.{jsonl,md,png}`` (``--out``); the runs' configs are written beside the runs, in
``<logging.run_dir>/transfer-<tag>-configs/``. A run's folder is named by its config's hash
(`bench.transfer_runs.run_name`), not by the tag: two measurements that need the same training (one pretraining for
two held-out PDEs, one scratch arm for two pretrainings) train it once. A SIGTERM to the command reaches the runs
training (`bench.child_runs`): each checkpoints, and the same command resumes them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch

from bench.child_runs import forwarding_sigterm
from bench.provenance import ROOT, record_stamp, refuse_dirty, training_device
from bench.race import SELECTS, parse_numbers
from bench.result_store import records
from bench.transfer_measure import measure
from bench.transfer_report import report, write_plot
from bench.transfer_runs import Budget, held_out_index
from entry.config.cli import exits_on_user_error
from entry.config.load import ConfigError, config_hash, config_to_dict, load_config
from entry.config.schema import NEW_FIELD_LOSSES
from entry.data.files import data_inputs, ensure_data, task_split
from entry.evaluation.task_frames import task_label
from entry.storage.run_folder import run_dir_for
from pipelines.work_pool import close_workers

PROTOCOL_NS = [8, 16, 32, 64, 128, 256, 512]
"""The issue's training-set sizes."""
STAMPED = ("held_out", "base_hash", "data_fingerprint", "budget", "pretrain_budget", "sweep", "freeze", "select",
           "new_fields")
"""What a store's records must share with this measurement to be reused by it."""


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, default=ROOT / "configs" / "universal" / "pretrain.yaml",
                   help="the mixture's config, the held-out task among its tasks")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the base config (every run's config derives from it)")
    p.add_argument("--held-out", required=True, help="the task left out of pretraining, NAME or NAME:PARAM: one of "
                   "the base's, or of --held-out-config's")
    p.add_argument("--held-out-config", type=Path, default=None, help="a config holding the held-out task when the "
                   "base has none (e.g. configs/reduced/ns2d_kolmogorov.yaml); its task joins the base's data")
    p.add_argument("--ns", default=",".join(map(str, PROTOCOL_NS)), help="training-set sizes of the held-out task")
    p.add_argument("--steps", type=int, default=None, help="operator steps of every fine-tuned and scratch run")
    p.add_argument("--codec-steps", type=int, default=None, help="codec steps of every fine-tuned and scratch run")
    p.add_argument("--lrs", default="3e-4,1e-3,3e-3", help="operator learning rates each arm's sweep tries")
    p.add_argument("--new-lr-scales", default="1,10", help="finetune.new_lr_scale values the fine-tuned arm's sweep "
                   "tries with each of --lrs")
    p.add_argument("--sweep-n", type=int, default=None, help="the size the sweep runs at (default the largest)")
    p.add_argument("--seeds", default="0,1,2", help="seeds at the top N and around N*; the first everywhere")
    p.add_argument("--guard-seeds", default="", help="seeds of the guard rail's single-task runs and mixtures "
                   "(default: the first of --seeds, which it always includes)")
    p.add_argument("--rollout-steps", type=int, default=10, help="predicted steps of the scored rollout")
    p.add_argument("--freeze", default="", help="stages the fine-tuned runs keep as pretrained (e.g. autoencoder)")
    p.add_argument("--new-fields", default="reconstruction", choices=NEW_FIELD_LOSSES, help="finetune.new_fields")
    p.add_argument("--select", default=None, choices=SELECTS, help="the weights the fine-tuned and scratch runs "
                   "keep: their last or their lowest validation's (default the base's evaluation.select)")
    p.add_argument("--tag", default=None, help="names the results and the runs' configs folder (default: the "
                   "held-out task's name)")
    p.add_argument("--out", type=Path, default=None, help="results, JSON lines (default "
                   "bench/results/transfer-<date>-<tag>.jsonl)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once, each with the cores over J threads "
                   "(module docstring)")
    p.add_argument("--run-timeout-s", type=float, default=None, help="stop a run of the pipeline after this long")
    p.add_argument("--report-only", action="store_true", help="write the report and plot of what --out holds, "
                   "training nothing (a measurement under way or stopped: what is missing shows as owed)")
    p.add_argument("--allow-dirty", action="store_true", help="run from a work tree with uncommitted changes "
                   "(development only: the records and the report say so)")
    return p.parse_args(argv)


class Plan:
    """The checked arguments and the trees every run derives from."""

    def __init__(self, args: argparse.Namespace):
        self.tree = config_to_dict(load_config(args.base, args.overrides))
        if args.held_out_config is not None:  # the held-out task joins the base's (its data root, its split)
            other = config_to_dict(load_config(args.held_out_config))
            task = other["data"]["tasks"][held_out_index(other, args.held_out)]
            self.tree["data"]["tasks"].append(task)
            if self.tree["data"]["task_weights"]:  # a share for it, never drawn: it is left out of the mixture
                self.tree["data"]["task_weights"].append(1.0)
        self.held = held_out_index(self.tree, args.held_out)  # a ConfigError when the base has it too
        cfg = load_config(tree=self.tree)
        self._seed_tasks(cfg)
        if len(cfg.data.tasks) < 2:
            raise ConfigError(f"--base {args.base} has one task: the mixture needs another beside the held-out one")
        if cfg.data.task_sampling != "balanced":
            raise ConfigError("the guard rail gives each single-task run its share of the mixture's steps, which "
                              "balanced sampling fixes (equal, or data.task_weights): set data.task_sampling=balanced")
        self.ns = sorted(set(parse_numbers(args.ns, "--ns", int)))
        self.lrs = parse_numbers(args.lrs, "--lrs")
        self.scales = parse_numbers(args.new_lr_scales, "--new-lr-scales")
        self.seeds = list(dict.fromkeys(parse_numbers(args.seeds, "--seeds", int)))
        # The first seed's guard rail is always run: its mixture model is the pretraining itself.
        more_guard = parse_numbers(args.guard_seeds, "--guard-seeds", int) if args.guard_seeds else []
        self.guard_seeds = list(dict.fromkeys([self.seeds[0], *more_guard]))
        self.sweep_n = self.ns[-1] if args.sweep_n is None else args.sweep_n
        if self.ns[0] < 1 or min(self.lrs) <= 0 or min(self.scales) <= 0 or self.sweep_n not in self.ns:
            raise ConfigError(f"--ns takes sizes >= 1, --lrs and --new-lr-scales positive numbers, --sweep-n one of "
                              f"--ns ({args.ns})")
        steps = cfg.operator.steps if args.steps is None else args.steps
        codec = cfg.autoencoder.steps if args.codec_steps is None else args.codec_steps
        if steps < 1 or codec < 1 or args.rollout_steps < 1:
            raise ConfigError("--steps, --codec-steps and --rollout-steps must be >= 1")
        self.budget = Budget(steps, codec, args.rollout_steps)
        self.pretrain_budget = Budget(cfg.operator.steps, cfg.autoencoder.steps, args.rollout_steps)
        shares = self.source_weights() or [1.0] * (len(cfg.data.tasks) - 1)
        self.single_budgets = [Budget(max(1, int(cfg.operator.steps * w / sum(shares))),
                                      max(1, int(cfg.autoencoder.steps * w / sum(shares))), args.rollout_steps)
                               for w in shares]
        if args.jobs < 1:
            raise ConfigError(f"--jobs {args.jobs}: give the count of runs to train at once, 1 or more")
        self.freeze, self.new_fields = tuple(s for s in args.freeze.split(",") if s), args.new_fields
        self.select = args.select
        if set(self.freeze) - {"autoencoder"}:
            raise ConfigError(f"--freeze {args.freeze}: only the codec (autoencoder) may be kept as pretrained; "
                              "a stage with a task table trains on the held-out task's new row")
        self.label, self.cfg = task_label(cfg, self.held), cfg
        self.tag = args.tag or self.label
        self.folder = run_dir_for(cfg).parent / f"transfer-{self.tag}-configs"

    def _seed_tasks(self, cfg) -> None:
        """Write into the tree the seed each generated task's place gives it, so that it keeps it when it trains
        alone (the held-out runs, the guard rail: one file per task), and -1 for a declared file (read as it is);
        a ConfigError when a source draws from the held-out task's seed: two solvers that draw their starts alike
        (Allen-Cahn and the activator, two flows) would pretrain on the trajectories it is tested on."""
        tasks = self.tree["data"]["tasks"]
        for i, task in enumerate(tasks):
            task["seed"] = -1 if task["layout"] else cfg.data.task_seed(i)
        seed = tasks[self.held]["seed"]
        shared = [task_label(cfg, i) for i, t in enumerate(tasks) if i != self.held and t["seed"] == seed >= 0]
        if shared:
            raise ConfigError(f"{', '.join(shared)} draws its trajectories from seed {seed}, as the held-out "
                              f"{task_label(cfg, self.held)} does: their starts may be the ones it is scored on; "
                              f"give it another data seed (data.tasks[].seed)")

    def candidates(self, arm: str) -> list[tuple[float, float]]:
        """The (operator learning rate, new_lr_scale) pairs ``arm``'s sweep tries."""
        return [(lr, scale) for lr in self.lrs for scale in (self.scales if arm == "finetuned" else [1.0])]

    def held_task(self, n: int) -> dict:
        """The held-out task's entry, trained on its first ``n`` trajectories."""
        return {**self.tree["data"]["tasks"][self.held], "train_trajectories": n}

    def sources(self) -> list[dict]:
        """The mixture's task entries: the base's, less the held-out one."""
        return [t for i, t in enumerate(self.tree["data"]["tasks"]) if i != self.held]

    def source_weights(self) -> list[float]:
        """The mixture's ``data.task_weights``: the base's, less the held-out task's (empty: equal shares)."""
        return [w for i, w in enumerate(self.tree["data"]["task_weights"]) if i != self.held]

    def source_labels(self) -> list[str]:
        """The mixture's task labels in its task order, as its eval.json names them."""
        cfg = load_config(tree={**self.tree, "data": {**self.tree["data"], "tasks": self.sources(),
                                                       "task_weights": self.source_weights()}})
        return [task_label(cfg, i) for i in range(len(cfg.data.tasks))]


def stamp_of(plan: Plan, args: argparse.Namespace) -> dict:
    """What every record carries: the held-out task, where it was made (`record_stamp`: machine,
    processor, commit and dirtiness, torch), each task file's fingerprint (by label), the budgets, the base config
    (its path, overrides and hash: every run's config derives from it) and the date."""
    prints = data_inputs(plan.cfg)
    scales = {"new_lr_scales": plan.scales} if plan.scales != [1.0] else {}  # 1 alone: a store from before the option
    return {"held_out": plan.label, "base_hash": config_hash(plan.cfg),
            **record_stamp(training_device()),
            "data_fingerprint": {task_label(plan.cfg, i): fp for i, fp in enumerate(prints.values())},
            "budget": plan.budget._asdict(), "pretrain_budget": plan.pretrain_budget._asdict(),
            "sweep": {"lrs": plan.lrs, "n": plan.sweep_n, **scales}, "freeze": list(plan.freeze), "select": plan.select,
            **({"new_fields": plan.new_fields} if plan.new_fields != "reconstruction" else {}),  # older stores: absent
            "base": str(args.base), "overrides": list(args.overrides),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def check_store(store: Path, stamp: dict, *, clean: bool) -> None:
    """Refuse (ConfigError) a result file holding a record this measurement would reuse but could not
    have made: another held-out task, another base config (its hash: a model, codec or task changed), other
    data, another budget, or (for a clean run) a dirty tree."""
    for rec in records(store):
        payload = rec.get("payload") or {}
        for key in STAMPED:
            if payload.get(key) != stamp.get(key):
                raise ConfigError(f"{store} holds {rec.get('model')} seed {rec.get('seed')} made with another {key} "
                                  f"({payload.get(key)}): give another --out")
        if clean and payload.get("dirty"):
            raise ConfigError(f"{store} holds {rec.get('model')} made from a dirty work tree: give another --out, or "
                              "run with --allow-dirty")


def deviations(plan: Plan) -> list[str]:
    """The report's line naming what differs from the issue's protocol (sizes, seeds, rollout), or none."""
    differ = [f"sizes {plan.ns} (the issue's {PROTOCOL_NS})" if plan.ns != PROTOCOL_NS else "",
              f"seeds {plan.seeds} (the issue's 3)" if len(plan.seeds) < 3 else "",
              f"a {plan.budget.rollout_steps}-step rollout (the issue's 10)" if plan.budget.rollout_steps != 10 else ""]
    differ = [d for d in differ if d]
    return [f"**Reduced**: {'; '.join(differ)}; the scratch model's convergence at the top N is checked below."] \
        if differ else []


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    """The command (module docstring): takes its arguments, returns the exit code (2: a user error)."""
    args = _args(argv)
    plan = Plan(args)
    refuse_dirty(args.allow_dirty, "bench.transfer")
    if args.jobs > 1 and "OMP_NUM_THREADS" not in os.environ:  # the runs side by side share the cores
        threads = max(1, len(os.sched_getaffinity(0)) // args.jobs)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the runs' (subprocesses)
        torch.set_num_threads(threads)  # this process's, which every record's stamp names as the runs'
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    store = args.out or ROOT / "bench" / "results" / f"transfer-{today}-{plan.tag}.jsonl"
    if args.report_only and not records(store):
        raise ConfigError(f"--report-only: {store} holds no records: give the measurement's --out")
    ensure_data(plan.cfg)
    close_workers()  # the data are ready: idle generation workers would only hold memory
    rows, _ = task_split(plan.cfg, plan.held, "train")
    if plan.ns[-1] > len(rows):
        raise ConfigError(f"--ns {plan.ns[-1]}: the held-out task's training split holds {len(rows)} trajectories; "
                          "lower --ns, or generate more (its data.tasks entry's samples)")
    stamp = stamp_of(plan, args)
    check_store(store, stamp, clean=not args.allow_dirty)
    if not args.report_only:
        with forwarding_sigterm():  # a preempted measurement's runs checkpoint, and the command resumes them
            measure(plan, args, store, stamp)
    command = "python -m bench.transfer " + " ".join(sys.argv[1:] if argv is None else argv)
    made = sorted({(str(r["payload"].get("git_commit")), r["payload"].get("threads")) for r in records(store)})
    head = [f"# Transfer to {plan.label} (issue 50)", "", f"`{command}`", "",
            f"Date {stamp['date']}, commit {stamp['git_commit']}{' (dirty tree)' if stamp['dirty'] else ''}, "
            f"torch {stamp['torch']}; data fingerprints: {stamp['data_fingerprint']}.",
            "Records made at " + "; ".join(f"commit {c[:10]} ({t} thread{'' if t == 1 else 's'} a run)"
                                           for c, t in made) + ".",
            f"Every fine-tuned and scratch run: {plan.budget.steps} operator and {plan.budget.codec_steps} codec "
            f"steps; pretraining: {plan.pretrain_budget.steps} and {plan.pretrain_budget.codec_steps}; the rollout "
            f"scored: {plan.budget.rollout_steps} steps" + (f"; the weights they keep: their {plan.select} "
                                                            f"validation's (--select)." if plan.select else ".")]
    head += deviations(plan)
    text = report(store, plan.ns, plan.seeds, head, plan.guard_seeds)
    md = store.with_suffix(".md")
    md.write_text(text + "\n")
    plot = write_plot(store, plan.ns, plan.seeds, plan.label, store.with_suffix(".png"))
    print(text)
    print(f"wrote {store}, {md} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
