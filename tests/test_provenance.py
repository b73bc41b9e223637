"""A bench record names the code it was made of: `commit_state`'s dirty flag and `refuse_dirty` look
at changes to the code only (a bench's own records in bench/results/, written as it runs, are not
one), and a folder outside any checkout is told apart from a clean tree."""

from __future__ import annotations

import subprocess

import pytest

import bench.provenance as provenance
from entry.config.load import ConfigError


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, timeout=30)


def test_the_dirty_flag_counts_changes_to_the_code_not_a_benchs_own_records(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "race.jsonl").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head, dirty = provenance.commit_state(tmp_path)
    assert len(head) == 40 and not dirty and provenance.uncommitted(tmp_path) == []
    (tmp_path / "bench" / "results" / "race.jsonl").write_text("{}\n{}\n")  # a record appended
    (tmp_path / "bench" / "results" / "new.md").write_text("report")
    assert provenance.commit_state(tmp_path) == (head, False) and provenance.uncommitted(tmp_path) == []
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance.commit_state(tmp_path) == (head, True) and provenance.uncommitted(tmp_path) == ["code.py"]
    assert provenance.uncommitted(tmp_path / "bench" / "results" / "race.jsonl") is None  # no checkout folder there


def test_a_folder_outside_any_checkout_is_not_a_clean_tree(tmp_path):
    folder = tmp_path / "bench" / "results"  # no git checkout above tmp_path either (pytest's own folder)
    folder.mkdir(parents=True)
    if subprocess.run(["git", "rev-parse"], cwd=folder, capture_output=True).returncode == 0:
        pytest.skip("the temporary folder lies inside a git checkout on this machine")
    assert provenance.uncommitted(folder) is None and provenance.commit_state(folder) == ("unknown", False)


def test_refuse_dirty_names_the_command_the_change_and_the_way_out(monkeypatch):
    for changed, says in ((["core/x.py"], "1 uncommitted change(s) outside bench/results/ (e.g. core/x.py)"),
                          (None, "no git checkout")):
        monkeypatch.setattr(provenance, "uncommitted", lambda root, c=changed: c)
        with pytest.raises(ConfigError) as err:
            provenance.refuse_dirty(False, "bench.example")
        line = str(err.value)
        assert line.startswith("bench.example: ") and says in line and "--allow-dirty" in line and "\n" not in line
        provenance.refuse_dirty(True, "bench.example")  # --allow-dirty: a development run goes on
    monkeypatch.setattr(provenance, "uncommitted", lambda root: [])
    provenance.refuse_dirty(False, "bench.example")  # a clean tree measures


def test_the_processor_is_the_first_cpus_model_family_and_number_and_torchs_instruction_set(tmp_path):
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\n"
                    "model name\t: AMD EPYC\nflags\t\t: fpu avx2\n\n"
                    "processor\t: 1\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: Other CPU\n")
    assert provenance.processor_name(torch.device("cpu"), info) == f"AMD EPYC (family 23, model 1), torch kernels {isa}"
    info.write_text("processor\t: 0\nmodel name\t: ARMv8 Processor\n")  # no family: the name alone
    assert provenance.processor_name(torch.device("cpu"), info) == f"ARMv8 Processor, torch kernels {isa}"
    missing = tmp_path / "absent"
    assert provenance.processor_name(torch.device("cpu"), missing) == f"unknown CPU, torch kernels {isa}"


def test_every_record_stamp_names_the_machine_the_processor_and_the_code(monkeypatch):
    import torch

    monkeypatch.setattr(provenance, "commit_state", lambda: ("a" * 40, True))
    stamp = provenance.record_stamp(torch.device("cpu"))
    assert stamp == {"device": provenance.device_slug(torch.device("cpu")),
                     "processor": provenance.processor_name(torch.device("cpu")), "git_commit": "a" * 40,
                     "dirty": True, "torch": torch.__version__, "threads": torch.get_num_threads()}


def test_every_run_folders_environment_names_the_cpu_it_ran_on():
    import torch

    from entry.storage.run_folder import environment

    env = environment()  # what a run writes to its environment.json
    assert env["processor"] == provenance.processor_name(torch.device("cpu"))
    assert env["processor"].split(", torch kernels ")[1] == torch.backends.cpu.get_cpu_capability()


@pytest.mark.parametrize("caller, after", [(None, []), ("", []), ("/a", ["/a"]), ("/a::/b:", ["/a", "/b"])])
def test_a_benchs_child_runs_this_checkout_first_and_never_its_working_folder(monkeypatch, caller, after):
    if caller is None:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    else:
        monkeypatch.setenv("PYTHONPATH", caller)
    monkeypatch.setenv("SOME_SETTING", "kept")
    env = provenance.checkout_env()
    assert env["PYTHONPATH"].split(":") == [str(provenance.ROOT), *after]  # no empty entry: no working folder
    assert env["SOME_SETTING"] == "kept"
