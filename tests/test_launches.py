"""The launch inventory and budget (tests/launches.py) and the warm launcher (tests/warm.py) against DeepSpeed's."""

import json
import subprocess
import sys

import pytest
import torch

import launches
from runs import REPO, cached_run, final_params, launch, receipts, tiny_config


def record(test, kind="warm", shared=None, key="k", seconds=1.0):
    return {"test": test, "kind": kind, "config": {"command": key}, "key": key, "shared": shared, "started": 0,
            "seconds": seconds}


@pytest.mark.parametrize("argv,kind", [
    ([".venv/bin/deepspeed", "--num_gpus", "1", "nshard/train.py"], "deepspeed"),
    (["/usr/bin/mpirun", "-np", "2", "python", "x.py"], "mpirun"),
    (["torchrun", "--nproc_per_node", "2", "nshard/train.py"], "torchrun"),
    ([sys.executable, "nshard/train.py", "--plan", "p"], "train"),
    ([sys.executable, str(REPO / "nshard/train.py"), "--resume"], "train"),
    ([sys.executable, "-m", "nshard.study", "--plan", "p"], "study"),
    (["bash", "launch/study.sh"], "study"),
    (["bash", str(REPO / "launch/demo.sh"), "ds_configs/dense.json"], "script"),
    ([sys.executable, "-m", "launch.zero_stages", "--out", "x"], "script"),
    ([sys.executable, "launch/gpu_reducers.py", "--device", "cpu"], "script"),
    ([sys.executable, "-m", "launch.mutants", "--help"], None),
    ([sys.executable, "-m", "nshard.evidence.store", "verify", "x"], None),
    ([sys.executable, "-c", "import torch"], None),
    (["git", "status"], None),
    (["bash", "launch/hosts.sh", "up"], None),
])
def test_commands_that_launch_are_told_from_those_that_do_not(argv, kind):
    assert launches.classify(argv) == kind


def test_budget_counts_own_launches_per_file_and_each_shared_run_once():
    records = [record("tests/test_a.py::t1"), record("tests/test_a.py::t1"), record("tests/test_b.py::t[x]"),
               record("tests/test_b.py::u", shared="ds-dense")]
    requests = [{"test": "tests/test_b.py::u", "name": "ds-dense"}, {"test": "tests/test_c.py::v", "name": "ds-dense"},
                {"test": "tests/test_c.py::v", "name": "psgd-z0"}]
    assert launches.budget_counts(records, requests) == {"test_a.py": 2, "test_b.py": 1, launches.SHARED: 2}


def test_one_launch_too_many_fails_with_one_line_naming_the_test():
    records = [record("tests/test_a.py::t1"), record("tests/test_a.py::t2"), record("tests/test_a.py::t2")]
    budget = {"test_a.py": 3, launches.SHARED: 1}
    assert launches.over_budget(records, [], budget) is None
    line = launches.over_budget(records + [record("tests/test_a.py::t1")], [], budget)
    assert "\n" not in line and line.startswith("launch budget: test_a.py 4 > 3 (t1 2, t2 2)")
    assert "tests/launch_budget.txt" in line
    shared = launches.over_budget([], [{"test": "tests/test_c.py::v", "name": "x"},
                                       {"test": "tests/test_d.py::w", "name": "y"}], budget)
    assert shared.startswith("launch budget: shared runs 2 > 1 (tests/test_c.py::v, tests/test_d.py::w)")
    assert "test_new.py 1 > 0" in launches.over_budget([record("tests/test_new.py::t")], [], budget)


def test_the_budget_file_is_read_and_a_malformed_line_is_named(tmp_path):
    assert launches.read_budget()[launches.SHARED] > 0  # the suite's own file parses
    bad = tmp_path / "budget.txt"
    bad.write_text("# a comment\ntest_a.py 3  # why\nshared runs 2\ntest_b.py three\n")
    with pytest.raises(ValueError, match=r"budget.txt:4: 'test_b.py three': write `FILE COUNT`"):
        launches.read_budget(bad)
    bad.write_text("test_a.py 3  # why\nshared runs 2\n")
    assert launches.read_budget(bad) == {"test_a.py": 3, "shared runs": 2}


def test_the_table_comes_back_from_the_records(tmp_path):
    records = [record("tests/test_a.py::t1", key="one", seconds=2.0), record("tests/test_b.py::t2", key="one"),
               record("tests/test_a.py::t1", kind="deepspeed", key="two", shared="ds-dense", seconds=10.0)]
    path = tmp_path / "inventory.md"
    launches.write_inventory(path, records, [{"test": "tests/test_a.py::t1", "name": "ds-dense"}])
    text = path.read_text()
    assert text.startswith("3 launches (warm 2, deepspeed 1), 13 s in all; 2 configurations.")
    assert "| `one` | warm | 2 | 3 / 1.5 | test_a.py::t1, test_b.py::t2 |" in text
    assert "| `two` (shared `ds-dense`) | deepspeed | 1 | 10 / 10.0 | test_a.py::t1 |" in text
    again = subprocess.run([sys.executable, str(REPO / "tests/launches.py"), str(path.with_suffix(".json"))],
                           capture_output=True, text=True, check=True).stdout
    assert again == text
    budget = subprocess.run([sys.executable, str(REPO / "tests/launches.py"), str(path.with_suffix(".json")),
                             "--budget"], capture_output=True, text=True, check=True).stdout
    assert budget.splitlines() == ["shared runs 1", "test_a.py 1", "test_b.py 1"]


def test_a_ds_config_reads_as_its_stage_precision_and_reducer():
    plain = launches.describe_ds_config(tiny_config(stage=2, bf16=True, nshard={"reducer": "powersgd", "rank": 4}))
    assert plain.startswith("ZeRO-2 bf16 nshard powersgd r4 [")
    assert launches.describe_ds_config(tiny_config()).startswith("stage 0 DeepSpeed's reduction [")
    assert launches.describe_ds_config(tiny_config()) != launches.describe_ds_config(tiny_config(lr=1e-3))


@pytest.mark.slow
def test_warm_ranks_train_the_model_deepspeeds_runner_trains(runs_root, tmp_path):
    """The same configuration through DeepSpeed's runner (the shared run) and from a warm worker, which forks its
    ranks: the same bits and the same records. The launch goes to this process's worker for the session's
    environment itself, not through runs.launch, which NSHARD_TEST_RUNNER=1 would hand to the runner."""
    import tempfile
    from pathlib import Path

    import warm
    from runs import run_env

    real = cached_run(runs_root, "ds-dense", tiny_config())
    out = tmp_path / "warm"
    ds_config = tmp_path / "warm-ds_config.json"
    ds_config.write_text(json.dumps(tiny_config()))
    plan = REPO / "launch/plans/tiny.toml"
    args = ["--ds_config", str(ds_config), "--plan", str(plan), "--out", str(out)]
    with launches.launching("warm", launches.describe_launch(ds_config, 2, plan, None, [])), \
            tempfile.TemporaryDirectory(prefix="nshard-warm-") as logs:
        proc = warm.worker(run_env()).launch(args, 2, run_env(), Path(logs), 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got, want = final_params(out), final_params(real)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    for w, r in zip(receipts(out), receipts(real)):
        assert (w["rank"], w["world_size"], w["parameter_root"]) == (r["rank"], r["world_size"], r["parameter_root"])
        assert w["update_grad_bytes"] == r["update_grad_bytes"]
    assert json.loads((out / "run.json").read_text())["status"] == "complete"


@pytest.mark.slow
def test_a_warm_rank_that_fails_stops_its_peer_and_the_launch_exits_with_its_code(tmp_path):
    """As DeepSpeed's launch.py does: rank 1 is SIGKILLed after update 2 (nshard/run/fault.py), rank 0 would wait in
    its next collective for ever; the launch ends, non-zero, and the run is left running."""
    out = tmp_path / "killed"
    proc = launch(out, tiny_config(), world=2, env={"NSHARD_FAULT": "1:2"}, check=False)
    assert proc.returncode == -9 & 0xFF  # launch.py's sys.exit(-9), as its shell sees it: 247
    assert json.loads((out / "run.json").read_text())["status"] == "running"


@pytest.mark.slow
def test_each_signature_of_the_variables_read_at_import_gets_a_warm_worker_of_its_own(tmp_path):
    """A launch whose variables read at import differ from a worker's (a test's env=, or the session's own changed
    since the worker started) gets a worker started with them, not DeepSpeed's runner; two stay alive, the least
    recently used is closed, and a worker that was killed (an interrupted launch) or closed is never used again.
    Starts real workers, launches nothing."""
    import warm
    from runs import run_env

    plain, first_other, second_other = run_env(), run_env({"HF_NSHARD_TEST": "1"}), run_env({"HF_NSHARD_TEST": "2"})
    assert warm.signature({"NSHARD_FAULT": "1:2", "WANDB_MODE": "offline"}) == ()  # read at run time: any value
    assert warm.signature({"HF_HOME": "/h", "torch_home": "/t", "NSHARD_CACHE": "/c"}) == (("HF_HOME", "/h"),
                                                                                      ("torch_home", "/t"))
    pool = warm.Pool(size=2)
    try:
        first = pool.worker(plain)
        assert pool.worker({**plain, "NSHARD_FAULT": "1:2"}) is first
        second = pool.worker(first_other)
        assert second is not first and first.alive() and second.alive()
        assert pool.worker(plain) is first  # now the most recently used: the next new one closes `second`
        third = pool.worker(second_other)
        assert not second.alive() and first.alive() and third.alive() and list(pool.workers.values()) == [first, third]
        with pytest.raises(ValueError, match="HF_NSHARD_TEST"):
            first.launch(["--help"], 2, first_other, tmp_path, 60)
        assert first.alive() and not list(tmp_path.iterdir())  # refused before anything was asked of it
        first.kill()
        again = pool.worker(plain)
        assert again is not first and again.alive()
    finally:
        pool.close()
    assert not pool.workers and not again.alive() and not third.alive()
