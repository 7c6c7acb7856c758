"""Recovery inside the study: a plan's [study.fault] kills one rank of one arm on its first attempt, and the study
resumes that arm from its newest complete state in the same run directory (nshard/study/runner.py); the report and
results.json say what the recovery redid and cost, and the arm's time counts the failed attempt.

The fast tests check the plan key's refusals, the runner's bookkeeping and the report on a synthetic study; the slow
one runs a tiny study whose candidate loses a rank and compares its parameter root with its uninterrupted twin's (the
kill/resume tests' shared reference, tests/runs.py resume_reference).
"""

from __future__ import annotations

import copy
import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nshard.analysis.report import analyze, write_outputs
from nshard.run.plan import PlanError, plan_from_dict
from nshard.study import runner

PLAN = {"model": {"spec": "tiny"}, "train": {"updates": 6}, "checkpoint": {"every": 2},
        "study": {"fault": {"arm": "powersgd", "rank": 1, "update": 3}}}


def fault_plan(checkpoint: dict | None = None, **fault):
    raw = copy.deepcopy(PLAN)
    raw["study"]["fault"].update(fault)
    if checkpoint is not None:
        raw["checkpoint"] = checkpoint
    return plan_from_dict(raw)


def test_a_declared_fault_is_read_and_becomes_the_arms_nshard_fault():
    plan = fault_plan(phase="save", update=4)
    assert (plan.study.fault.arm, plan.study.fault.env()) == ("powersgd", "1:4:save")
    assert plan_from_dict({"model": {"spec": "tiny"}}).study.fault is None


def test_the_fault_reaches_its_own_arms_first_attempt_and_nothing_else():
    declared = fault_plan().study.fault
    assert runner.attempt_fault(declared, "powersgd", 1) == "1:3:update"
    assert runner.attempt_fault(declared, "powersgd", 2) is None  # the resumed attempt
    assert runner.attempt_fault(declared, "dense", 1) is None  # another arm
    assert runner.attempt_fault(None, "powersgd", 1) is None


@pytest.mark.parametrize("fault, checkpoint, error", [
    ({"arm": "nope"}, None, "study.fault.arm='nope' is not an arm; arms are ['one-rank', 'dense', 'powersgd']"),
    ({"arm": ""}, None, "study.fault.arm is missing: name the arm"),
    ({"rank": 2}, None, "study.fault.rank=2: arm powersgd has ranks 0..1; kill one of those"),
    ({"rank": -1}, None, "study.fault.rank=-1 must not be negative"),
    ({"update": 7}, None, "study.fault.update=7 is beyond train.updates=6: the arm finishes before it; choose an "
                          "update up to 6"),
    ({"update": 2}, None, "study.fault.update=2 comes before the first complete state (checkpoint.every = 2 saves it "
                          "after update 2), so the arm could only restart from scratch; choose an update above 2, or "
                          "checkpoint.every = 1"),
    ({"update": 3}, {"every": 0}, "study.fault.update=3 needs a complete state saved before it, but checkpoint.every "
                                  "= 0 saves one only at the end, so the arm could only restart from scratch; set "
                                  "checkpoint.every between 1 and 2"),
    ({"update": 3, "phase": "save"}, None, "study.fault.update=3 with phase = \"save\": no state is saved after "
                                           "update 3 (checkpoint.every = 2); choose a multiple of 2 or train.updates"),
    ({"phase": "diverge"}, None, "study.fault.phase='diverge': use \"update\""),
    ({"when": 3}, None, "unknown plan key study.fault.when: known keys are arm, phase, rank, update"),
    ({"rank": "1"}, None, "study.fault.rank must be int, got str '1'"),
])
def test_a_bad_fault_is_refused_naming_the_field_and_the_fix(fault, checkpoint, error):
    with pytest.raises(PlanError) as caught:
        fault_plan(checkpoint, **fault)
    assert error in str(caught.value)


def test_a_fault_that_is_not_a_table_is_refused():
    with pytest.raises(PlanError, match=r"study.fault must be a \[study.fault\] table \(arm, rank, update, phase\)"):
        plan_from_dict({**PLAN, "study": {"fault": "1:3"}})


def test_a_save_fault_at_a_save_or_the_last_update_is_accepted():
    assert fault_plan(update=4, phase="save").study.fault.update == 4
    assert fault_plan({"every": 4}, update=6, phase="save").study.fault.update == 6  # the final save


@pytest.mark.parametrize("fault", ['[study.fault]  # one worker\narm = "powersgd" # [sic]\nrank = 1\nupdate = 3\n',
                                   '[study]\nfault = {arm = "powersgd", rank = 1, update = 3}\n'])
def test_the_warm_up_plan_drops_the_fault_and_nothing_else(fault):
    """As a table of its own or inline (how a plan with --set overrides is written: nshard/cli.py's toml_text)."""
    import tomllib

    text = f'name = "x"\n[train]\nupdates = 6\n{fault}\n[[study.arms]]\nname = "powersgd"\n[checkpoint]\nevery = 2\n'
    assert tomllib.loads(runner.without_fault(text)) == {"name": "x", "train": {"updates": 6},
                                                         "checkpoint": {"every": 2},
                                                         "study": {"arms": [{"name": "powersgd"}]}}
    plain = text.replace(fault, "")
    assert runner.without_fault(plain) == plain


def fake_point(tmp_path: Path, update: int, written_at: float):
    """A ResumePoint whose manifest records `written_at` (what recovery_record reads)."""
    from nshard.run.state import ResumePoint, state_name

    state = tmp_path / "state" / state_name(update)
    state.mkdir(parents=True)
    stamp = datetime.datetime.fromtimestamp(written_at, datetime.timezone.utc).isoformat()
    (state / "manifest.json").write_text(json.dumps({"update": update, "written_at": stamp}))
    return ResumePoint(state, update)


def test_seconds_lost_are_the_failed_attempts_wall_time_after_the_resumed_state(tmp_path):
    failed = {"log": "logs/powersgd-attempt-1.log", "wall_s": 50.0, "started_at": 1000.0, "updates_reached": 5}
    record = runner.recovery_record(fake_point(tmp_path / "a", 4, 1030.0), failed)
    assert (record["resumed_from_update"], record["updates_redone"]) == (4, 1)
    assert record["seconds_lost"] == pytest.approx(20.0) and record["failed_wall_s"] == 50.0
    # A state older than the attempt (it resumed from it too): every second of the attempt is lost.
    assert runner.recovery_record(fake_point(tmp_path / "b", 4, 900.0), failed)["seconds_lost"] == pytest.approx(50.0)
    # An attempt the study did not record (the study itself was stopped): what it lost is unknown, not zero.
    unknown = runner.recovery_record(fake_point(tmp_path / "c", 4, 900.0), None)
    assert unknown["seconds_lost"] is None and unknown["updates_redone"] is None


def test_only_failed_attempts_with_the_final_inputs_are_counted():
    attempts = [{"rc": -9, "wall_s": 30.0, "plan_sha256": "old", "ds_config_sha256": "d"},
                {"rc": 1, "wall_s": 20.0, "plan_sha256": "p", "ds_config_sha256": "d"},
                {"rc": 0, "wall_s": 70.0, "plan_sha256": "p", "ds_config_sha256": "d"}]
    assert runner.attempt_cost(attempts, "p", "d") == {"failed_attempts": 1, "failed_attempts_s": 20.0}


def test_updates_reached_reads_the_consecutive_metrics_lines(tmp_path):
    assert runner.updates_reached(tmp_path) == 0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"update": u}) + "\n" for u in (1, 2, 3)) + '{"upd')
    assert runner.updates_reached(tmp_path) == 3


def test_a_recovered_arm_counts_its_failed_attempt_and_the_report_shows_the_recovery(tmp_path):
    """The synthetic study of tests/test_analysis.py: the candidate's 80 s beat the baseline's 100 s; with a failed
    attempt of 30 s it takes 110 s, and the speed screen judges that."""
    from test_analysis import make_study

    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    assert analyze(root)["screens"]["speed"]["passed"]
    study = json.loads((root / "study.json").read_text())
    candidate = study["arms"][2]
    candidate.update(failed_attempts=1, failed_attempts_s=30.0, attempts=[{}, {}], recovery=[
        {"resumed_from_update": 4, "updates_reached": 5, "updates_redone": 1, "seconds_lost": 12.5,
         "failed_wall_s": 30.0, "failed_log": "logs/powersgd-attempt-1.log", "state": "update-000004"}])
    (root / "study.json").write_text(json.dumps(study))
    results = write_outputs(root)
    arm = results["arms"][2]
    assert arm["execution"]["complete_process_s"] == pytest.approx(110.0)
    assert arm["execution"]["final_process_s"] == pytest.approx(80.0)
    assert arm["execution"]["device_seconds"] == pytest.approx(220.0)
    assert results["screens"]["speed"]["speedups"]["powersgd"]["complete_process"] == pytest.approx(100 / 110)
    assert not results["screens"]["speed"]["passed"]
    assert arm["recovery"] == [{"resumed_from_update": 4, "updates_reached": 5, "updates_redone": 1,
                                "seconds_lost": 12.5, "failed_wall_s": 30.0,
                                "failed_log": "logs/powersgd-attempt-1.log"}] and arm["attempts"] == 2
    assert json.loads((root / "results.json").read_text())["arms"][2]["recovery"] == arm["recovery"]
    report = (root / "report.md").read_text()
    assert "| Failed attempts, their wall time (counted above) | none | none | 1, 30.00 s |" in report
    assert ("| Recovery: resumed from update, updates redone, seconds lost | — | — "
            "| update 4, 1 redone, 12.50 s lost |") in report
    assert "Seconds lost: the failed attempt's wall seconds after that state was written" in report


# ---------------------------------------------------------------- a tiny study that loses a worker


def recovery_plan(tmp: Path, runs_root: Path) -> Path:
    """tests/runs.py's kill/resume plan (8 updates, a state every 2) as a one-arm study whose arm loses rank 1 after
    update 5 on its first attempt. Its uninterrupted twin is the kill/resume tests' shared reference
    (runs.resume_reference): the same plan sections and ds_config, launched once per session."""
    from runs import RESUME_PLAN, resume_config

    (tmp / "powersgd.json").write_text(json.dumps(resume_config(0)))
    plan = tmp / "tiny-recovery.toml"
    plan.write_text(RESUME_PLAN + '\n[study]\ncandidate = "powersgd"\nspeed_baseline = "powersgd"\n'
                    + "eval_max_new_tokens = 8\neval_batch_size = 16\nvalidate_regenerate = false\n"
                    + '\n[study.fault]\narm = "powersgd"\nrank = 1\nupdate = 5\n'
                    + f'\n[[study.arms]]\nname = "powersgd"\nranks = 2\nds_config = "{tmp / "powersgd.json"}"\n')
    return plan


@pytest.mark.slow
def test_a_study_that_loses_a_worker_resumes_the_arm_bit_identical_to_its_uninterrupted_twin(tmp_path, runs_root):
    from runs import REPO, resume_reference, run_env

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "nshard.study", "--plan", str(recovery_plan(tmp_path, runs_root)),
                           "--out", str(out)], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    arms = {a["name"]: a for a in json.loads((out / "study.json").read_text())["arms"]}
    first, resumed = arms["powersgd"]["attempts"]
    assert first["rc"] != 0 and first["fault"] == "1:5:update" and first["resumed_from_update"] is None
    assert resumed["rc"] == 0 and resumed["fault"] is None and resumed["resumed_from_update"] == 4
    assert "export NSHARD_FAULT=1:5:update" in Path(first["log"]).read_text()
    assert "NSHARD_FAULT" not in Path(resumed["log"]).read_text()
    assert not (out / "failed").exists()  # resumed in its own run directory, not restarted from scratch
    # The resumed run continued the killed one's state: the receipts say so, and its weights are the twin's, bit
    # for bit.
    run = json.loads((out / "arms/powersgd/run.json").read_text())
    assert run["resumed_from_update"] == 4
    results = json.loads((out / "results.json").read_text())
    by_name = {a["name"]: a for a in results["arms"]}
    twin = json.loads((resume_reference(runs_root, 0) / "run.json").read_text())
    assert len(by_name["powersgd"]["parameter_root"]) == 64
    assert by_name["powersgd"]["parameter_root"] == run["parameter_root"] == twin["parameter_root"]
    # What the recovery redid and cost: rank 0 finished update 5 before the launcher stopped it.
    [recovery] = by_name["powersgd"]["recovery"]
    assert (recovery["resumed_from_update"], recovery["updates_reached"], recovery["updates_redone"]) == (4, 5, 1)
    assert 0 < recovery["seconds_lost"] < first["wall_s"] == recovery["failed_wall_s"]
    execution = by_name["powersgd"]["execution"]
    assert execution["failed_attempts"] == 1 and execution["failed_attempts_s"] == pytest.approx(first["wall_s"])
    assert execution["complete_process_s"] == pytest.approx(execution["final_process_s"] + first["wall_s"])
    assert execution["device_seconds"] == pytest.approx(2 * execution["complete_process_s"])
    report = (out / "report.md").read_text()
    assert "| Recovery: resumed from update, updates redone, seconds lost | update 4, 1 redone, " in report
