"""Complete resumable state: a rank SIGKILLed mid-run (or mid-save) and the run resumed with --resume ends
bit-identical to an uninterrupted run, at stage 0, ZeRO-1 and ZeRO-2 with PowerSGD; states that do not
fit this command line are refused with one clear line, and a newest state whose files do not match its
manifest is passed over for the newest one that verifies (tests/test_red_team_resume.py resumes from it).

The kill points come from the trainer's test-only fault hook, NSHARD_FAULT=RANK:UPDATE[:PHASE] (nshard/run/fault.py).
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from nshard.run.state import MANIFEST, StateError, find_resumable, sealed_states
from runs import (REPO, RESUME_EVERY as EVERY, RESUME_PLAN as PLAN, RESUME_POWERSGD as POWERSGD,
                  RESUME_UPDATES as UPDATES, final_params, launch, receipts, resume_config as config, resume_plan,
                  resume_reference, run_env, tiny_config)


@pytest.fixture(scope="module")
def plan(runs_root):
    return resume_plan(runs_root)


def uninterrupted(plan, root, stage: int, bf16: bool = False):
    """The reference: the same plan and ds_config, run once per session without a fault (shared with
    tests/test_elastic.py, which continues its states on another world size)."""
    return resume_reference(root, stage, bf16)


def run_json(out) -> dict:
    return json.loads((out / "run.json").read_text())


def kill_and_resume(plan, root, stage: int, fault: str, bf16: bool = False, overlap: bool = False):
    out = root / f"killed-z{stage}{'-bf16' if bf16 else ''}{'-overlap' if overlap else ''}-{fault.replace(':', '-')}"
    # The first case goes through DeepSpeed's runner (its launch.py stops the surviving rank), the others start warm.
    runner = (stage, bf16, fault, overlap) == (0, False, "1:5", False)
    killed = launch(out, config(stage, bf16, overlap), plan=plan, check=False, env={"NSHARD_FAULT": fault},
                    runner=runner)
    assert killed.returncode != 0, "the fault hook did not stop the run"
    assert run_json(out)["status"] == "running"
    launch(out, config(stage, bf16, overlap), plan=plan, extra_args=["--resume"], runner=runner)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage,bf16,fault,resumed_from,overlap", [
    (0, False, "1:5", 4, False),       # rank 1 killed after update 5: the state of update 4 is the newest
    (0, False, "0:6:save", 4, False),  # rank 0 killed mid-save after update 6: that state was never sealed
    (1, False, "0:3", 2, False),
    (2, False, "1:4:save", 2, False),
    (0, True, "1:3", 2, False),        # bf16 compute (the CPU main job's path): fp32 masters, moments and error memory
    # nshard.overlap_backward, killed and resumed with it: the bits of the uninterrupted run without it
    (0, False, "1:5", 4, True),
])
def test_killed_run_resumes_bit_identical(plan, runs_root, stage, bf16, fault, resumed_from, overlap):
    whole = uninterrupted(plan, runs_root, stage, bf16)
    out = kill_and_resume(plan, runs_root, stage, fault, bf16, overlap)
    assert run_json(out)["parameter_root"] == run_json(whole)["parameter_root"]
    got, want = final_params(out), final_params(whole)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # Receipts and metrics cover the whole run once, and say where it resumed.
    assert run_json(out)["status"] == "complete" and run_json(out)["resumed_from_update"] == resumed_from
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["update"] for m in lines] == list(range(1, UPDATES + 1))
    whole_lines = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in lines] == [m["loss"] for m in whole_lines]
    for r, w in zip(receipts(out), receipts(whole)):
        assert r["updates"] == UPDATES and r["resumed_from_update"] == resumed_from
        assert r["update_compressed"] == w["update_compressed"] and r["update_grad_bytes"] == w["update_grad_bytes"]
        assert [s["update"] for s in r["state_saves"]] == list(range(EVERY, UPDATES + 1, EVERY))
    # The newest two states are kept; no half-made save is left behind.
    assert [p.name for p in sealed_states(out)] == ["update-000006", "update-000008"]
    assert not list((out / "state").glob(".tmp-*"))


@pytest.mark.slow
def test_replica_divergence_stops_the_run_and_keeps_the_last_state(plan, runs_root):
    out = runs_root / "diverged"
    proc = launch(out, config(0), plan=plan, check=False, env={"NSHARD_FAULT": "1:3:diverge"})
    assert proc.returncode != 0
    assert proc.stderr.count("after update 3 the replicas diverged") == 2, proc.stderr[-3000:]
    assert [p.name for p in sealed_states(out)] == ["update-000002"]
    assert run_json(out)["status"] == "running"


@pytest.fixture
def state_copy(plan, runs_root, tmp_path):
    """A copy of a finished run directory whose states can be altered."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted(plan, runs_root, 0), out)
    return out


def resumable(out, plan, world=2, ds_config=None):
    if ds_config is None:
        ds_config = out / "ds_config.json"
    return find_resumable(out, plan, ds_config, world)


@pytest.mark.slow
def test_newest_complete_state_is_found_and_checked(state_copy, plan):
    point = resumable(state_copy, plan)
    assert point.state.name == "update-000008" and point.update == 8 and point.skipped == ()
    (state_copy / "state" / "update-000010").mkdir()  # no manifest: never used
    point = resumable(state_copy, plan)
    assert point.state.name == "update-000008" and [s["state"] for s in point.skipped] == ["update-000010"]


@pytest.mark.slow
@pytest.mark.parametrize("change,message", [
    ("world", "another world size"),
    ("plan", "another plan"),
    ("ds_config", "another ds_config"),
])
def test_states_that_do_not_fit_are_refused(state_copy, plan, tmp_path, change, message):
    kwargs = {}
    if change == "world":
        kwargs["world"] = 3
    elif change == "plan":
        plan = tmp_path / "other.toml"
        plan.write_text(PLAN.replace("seed = 0", "seed = 1"))
    elif change == "ds_config":
        kwargs["ds_config"] = tmp_path / "other.json"
        kwargs["ds_config"].write_text(json.dumps(tiny_config(stage=0, nshard={**POWERSGD, "rank": 2})))
    with pytest.raises(StateError, match=message):
        resumable(state_copy, plan, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("change,message", [
    ("flip", "rank-1.pt does not match its manifest's SHA-256"),
    ("truncate", "mp_rank_00_model_states.pt does not match its manifest's SHA-256"),
    ("remove", "rank-1.pt, which its manifest lists, is missing"),
    ("extra", "rank-2.pt, which its manifest does not list"),
    ("manifest", "not an nshard-state/1 manifest"),
])
def test_damaged_newest_state_is_passed_over(state_copy, plan, change, message):
    state = state_copy / "state" / "update-000008"
    if change == "flip":
        data = bytearray((state / "rank-1.pt").read_bytes())
        data[len(data) // 2] ^= 1
        (state / "rank-1.pt").write_bytes(bytes(data))
    elif change == "truncate":
        data = (state / "deepspeed" / "mp_rank_00_model_states.pt").read_bytes()
        (state / "deepspeed" / "mp_rank_00_model_states.pt").write_bytes(data[: len(data) // 2])
    elif change == "remove":
        (state / "rank-1.pt").unlink()
    elif change == "extra":
        (state / "rank-2.pt").write_bytes(b"from another run")
    elif change == "manifest":
        (state / MANIFEST).write_text(json.dumps({"files": {}}))
    point = resumable(state_copy, plan)
    assert point.state.name == "update-000006" and point.update == 6
    assert [s["state"] for s in point.skipped] == ["update-000008"] and message in point.skipped[0]["why"]


@pytest.mark.slow
def test_resume_refusal_is_one_line_and_exit_2(state_copy, plan):
    """Run as one process (world size 1) against a two-rank state: refused before any process group."""
    proc = subprocess.run([sys.executable, "nshard/train.py", "--ds_config", str(state_copy / "ds_config.json"),
                           "--plan", str(plan), "--out", str(state_copy), "--resume"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("nshard: error")]
    assert len(errors) == 1 and "another world size (2 there, 1 now)" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_state_of_other_prepared_inputs_is_refused_once_they_are_built(state_copy, plan):
    """Same plan file, other inputs (e.g. an edited replay file): caught after tokenizing, on every rank."""
    manifest_path = state_copy / "state" / "update-000008" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["prepared_identity"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    proc = launch(state_copy, config(0), plan=plan, extra_args=["--resume"], check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("was made with another prepared inputs") == 2, proc.stderr[-3000:]
