"""Attacks on --resume. A refused resume leaves the run directory byte-identical (prepared/, run.json,
metrics.jsonl, states); a damaged newest state is passed over for the newest complete one, kept as evidence,
and the run still ends on the uninterrupted run's parameter root; a state whose weights do not hash to the root
it recorded is refused after loading. Real 2-rank DeepSpeed runs of the tiny model: one finished run per session,
copied and attacked by each test.
"""

import json
import shutil

import pytest

from nshard.files import file_sha256
from nshard.run.state import MANIFEST, StateError, find_resumable, sealed_states
from runs import REPO, cached_run, launch, tiny_config

UPDATES, EVERY = 4, 2
REPLAY = "red-team-replay.jsonl"
"""Found beside the plan (not from the working directory): the same plan bytes can name other replay text."""
PLAN = (REPO / "launch/plans/tiny.toml").read_text().replace("updates = 3", f"updates = {UPDATES}").replace(
    'replay_file = "launch/data/replay_general.jsonl"', f'replay_file = "{REPLAY}"') + (
    f"\n[checkpoint]\nevery = {EVERY}\nreplica_check_every = 1\nkeep = 2\n")
CONFIG = tiny_config(stage=0, nshard={"reducer": "powersgd", "rank": 4, "dense_warmup_updates": 1})
NEWEST, OLDER = "update-000004", "update-000002"


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("red-team-plan")
    shutil.copyfile(REPO / "launch/data/replay_general.jsonl", folder / REPLAY)
    (folder / "plan.toml").write_text(PLAN)
    return folder / "plan.toml"


@pytest.fixture
def run_copy(plan, runs_root, tmp_path):
    """A copy of one uninterrupted run (states of updates 2 and 4 kept) for a test to attack."""
    out = tmp_path / "run"
    shutil.copytree(cached_run(runs_root, "red-team-whole", CONFIG, plan=plan), out)
    return out


def tree(out) -> dict[str, str]:
    """Every file's SHA-256 and every directory under a run directory: what "byte-identical" compares."""
    return {p.relative_to(out).as_posix(): file_sha256(p) if p.is_file() else "dir" for p in sorted(out.rglob("*"))}


def run_json(out) -> dict:
    return json.loads((out / "run.json").read_text())


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def resume(out, plan, ds_config=None, check=False):
    return launch(out, ds_config if ds_config is not None else out / "ds_config.json", plan=plan,
                  extra_args=["--resume"], check=check)


def stop_before_export(out) -> None:
    """Leave the run as a kill after its last state was sealed leaves it: no model/, no receipts, status running."""
    shutil.rmtree(out / "model")
    shutil.rmtree(out / "receipts")
    body = run_json(out)
    (out / "run.json").write_text(json.dumps({key: body[key] for key in RUNNING_KEYS} | {"status": "running"}))


RUNNING_KEYS = ("plan", "plan_sha256", "ds_config_sha256", "world_size", "updates", "written_at")
"""What run.json holds while a fresh run trains (nshard.run.training.write_run_json)."""


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("attack,message", [
    ("replay", "another prepared inputs"),  # same plan bytes, edited replay text: caught only once inputs are built
    ("ds_config", "another ds_config"),     # caught before any process group
])
def test_refused_resume_leaves_the_run_directory_byte_identical(run_copy, plan, tmp_path, attack, message):
    ds_config = None
    if attack == "replay":
        moved = tmp_path / "moved-plan"
        moved.mkdir()
        shutil.copyfile(plan, moved / "plan.toml")
        text = (plan.parent / REPLAY).read_text()
        assert "Rome." in text
        (moved / REPLAY).write_text(text.replace("Rome.", "Milan.", 1))
        plan = moved / "plan.toml"
    else:
        ds_config = tiny_config(stage=0, nshard={"reducer": "powersgd", "rank": 2, "dense_warmup_updates": 1})
    before = tree(run_copy)
    proc = resume(run_copy, plan, ds_config)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "nshard: error" in line]
    assert errors and all(message in line for line in errors), proc.stderr[-3000:]
    assert tree(run_copy) == before


@pytest.mark.slow
def test_damaged_newest_state_falls_back_to_the_newest_complete_one(run_copy, plan):
    whole_root, whole_metrics = run_json(run_copy)["parameter_root"], metrics(run_copy)
    stop_before_export(run_copy)
    flip_byte(run_copy / "state" / NEWEST / "rank-1.pt")
    damaged = tree(run_copy / "state" / NEWEST)
    proc = resume(run_copy, plan, check=True)
    assert f"resumed from state {OLDER} (update 2)" in proc.stdout, proc.stdout[-3000:]
    assert f"skipped {NEWEST}" in proc.stdout
    body = run_json(run_copy)
    assert body["status"] == "complete" and body["parameter_root"] == whole_root
    record = body["resumed_from"]
    assert record["state"] == OLDER and record["update"] == 2 and body["resumed_from_update"] == 2
    [skipped] = record["skipped"]
    assert skipped["state"] == NEWEST and "rank-1.pt does not match its manifest's SHA-256" in skipped["why"]
    # The damaged state is evidence: set aside whole, out of reach of --resume and of the pruning of old states.
    assert tree(run_copy / skipped["kept_at"]) == damaged
    assert [p.name for p in sealed_states(run_copy)] == [OLDER, NEWEST]
    # Updates 3 and 4 were trained again: metrics.jsonl holds each update once, with the uninterrupted losses.
    assert [(m["update"], m["loss"]) for m in metrics(run_copy)] == [(m["update"], m["loss"]) for m in whole_metrics]


@pytest.mark.slow
def test_state_whose_weights_do_not_match_its_recorded_root_is_refused(run_copy, plan):
    manifest_path = run_copy / "state" / NEWEST / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    true_root = manifest["parameter_root"]
    assert true_root == run_json(run_copy)["parameter_root"]  # the last state holds the exported weights
    manifest["parameter_root"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    before = tree(run_copy)
    proc = resume(run_copy, plan)
    assert proc.returncode != 0
    refusal = (f"{NEWEST}: the loaded weights have parameter root {true_root}, but the state recorded parameter "
               f"root {'0' * 64} when it was saved")
    assert proc.stderr.count(refusal) == 2, proc.stderr[-3000:]  # every rank stops
    assert tree(run_copy) == before


@pytest.mark.slow
def test_state_without_its_marker_is_passed_over(run_copy, plan):
    (run_copy / "state" / NEWEST / MANIFEST).unlink()
    point = find_resumable(run_copy, plan, run_copy / "ds_config.json", 2)
    assert point.state.name == OLDER and point.update == 2
    assert [s["state"] for s in point.skipped] == [NEWEST] and "no manifest.json" in point.skipped[0]["why"]


@pytest.mark.slow
def test_no_state_that_verifies_is_one_refusal_naming_each(run_copy, plan):
    flip_byte(run_copy / "state" / NEWEST / "deepspeed" / "mp_rank_00_model_states.pt")
    (run_copy / "state" / OLDER / "rank-0.pt").unlink()
    with pytest.raises(StateError, match="no state .* verifies") as refusal:
        find_resumable(run_copy, plan, run_copy / "ds_config.json", 2)
    assert NEWEST in str(refusal.value) and f"{OLDER}: rank-0.pt, which its manifest lists, is missing" in str(refusal.value)


@pytest.mark.slow
def test_metrics_that_stop_before_the_state_are_refused(run_copy, plan):
    lines = (run_copy / "metrics.jsonl").read_text().splitlines()
    (run_copy / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")
    with pytest.raises(StateError, match="metrics.jsonl"):
        find_resumable(run_copy, plan, run_copy / "ds_config.json", 2)
