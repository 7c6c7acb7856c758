"""One run owns its --out (nshard/lock.py): a second study or trainer on it is refused at once naming the holder, a
kill -9'd holder's lock is taken over with a line saying so, and a refused run leaves nothing behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nshard.lock import lock_path
from runs import REPO, launch, run_env, tiny_config
from spawn import require

pytestmark = pytest.mark.slow


def one_arm_plan(tmp: Path) -> Path:
    """The tiny plan as a study of one arm (one rank, dense), trained long enough (40 updates) that
    the test can kill it while it trains."""
    (tmp / "dense.json").write_text(json.dumps(tiny_config("dense")))
    plan = tmp / "one-arm.toml"
    plan.write_text((REPO / "launch/plans/tiny.toml").read_text().replace("updates = 3", "updates = 40")
                    + '\n[study]\ncandidate = "one-rank"\nspeed_baseline = "one-rank"\neval_max_new_tokens = 4\n'
                    + f'\n[[study.arms]]\nname = "one-rank"\nranks = 1\nds_config = "{tmp / "dense.json"}"\n')
    return plan


def study_cmd(plan: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "nshard.study", "--plan", str(plan), "--out", str(out)]


def holder(path: Path) -> dict:
    """The lock file's record, {} while it is absent or not written yet."""
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def wait_for_holder(path: Path, proc: subprocess.Popen, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        record = holder(path)
        if record.get("pid"):
            return record
        time.sleep(0.05)
    raise AssertionError(f"{path} never named a holder (process exit {proc.poll()})")


def refused_line(stderr: str, prefix: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(prefix)]


def test_a_second_study_is_refused_and_a_killed_one_is_taken_over(tmp_path):
    plan, out = one_arm_plan(tmp_path), tmp_path / "out"
    first = subprocess.Popen(study_cmd(plan, out), cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        study_owner = wait_for_holder(lock_path(out), first)
        assert study_owner["pid"] == first.pid and study_owner["host"] == socket.gethostname()
        # A second study on the same --out: one line naming the holder, exit 2, while the first still runs.
        second = subprocess.run(study_cmd(plan, out), cwd=REPO, env=run_env(), capture_output=True, text=True,
                                timeout=120)
        assert first.poll() is None, "the first study ended before the second was refused: the test proves nothing"
        errors = refused_line(second.stderr, "nshard.study: error:")
        assert second.returncode == 2 and len(errors) == 1, second.stdout[-2000:] + second.stderr[-2000:]
        assert f"in use by pid {first.pid} on host {socket.gethostname()}" in errors[0]
        assert "[study] arm" not in second.stdout and "Traceback" not in second.stderr
        # kill -9 the study (and the trainer it launched: one session) while the arm trains.
        arm_owner = wait_for_holder(lock_path(out / "arms" / "one-rank"), first)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    assert holder(lock_path(out))["pid"] == first.pid  # the killed study's record stays: a stale lock
    assert not (out / "study.json").exists() and [p.name for p in (out / "logs").iterdir()] == ["one-rank-attempt-1.log"]
    killed_log = (out / "logs" / "one-rank-attempt-1.log").read_text()

    rerun = subprocess.run(study_cmd(plan, out), cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert (f"[study] taking over the stale lock {lock_path(out)} of pid {first.pid} on host "
            f"{socket.gethostname()}") in rerun.stdout
    # The killed attempt keeps its log and run directory; the new attempt has its own, with its trainer's takeover.
    assert (out / "logs" / "one-rank-attempt-1.log").read_text() == killed_log
    new_log = (out / "logs" / "one-rank-attempt-2.log").read_text()
    assert f"nshard: taking over the stale lock {lock_path(out / 'arms' / 'one-rank')} of pid {arm_owner['pid']}" in new_log
    assert sum(line.startswith("$ ") for line in killed_log.splitlines() + new_log.splitlines()) == 2
    arm = json.loads((out / "study.json").read_text())["arms"][0]
    assert arm["status"] == "complete" and [Path(a["log"]).name for a in arm["attempts"]] == ["one-rank-attempt-2.log"]
    assert not lock_path(out).exists() and not lock_path(out / "arms" / "one-rank").exists()

    # A second cohort from this study (its candidate failed its quality screen) is refused and leaves nothing.
    cohort = tmp_path / "cohort.toml"
    text = plan.read_text().replace("eval_seed = 7007", "eval_seed = 7107")
    text = text.replace("[data]\n", '[data]\nfamilies = ["cheapest", "acronym"]\n')
    cohort.write_text(text.replace("[study]", f'[cohort]\nfrom = "{out}"\nstart = "weights"\n\n[study]'))
    refused = subprocess.run(study_cmd(cohort, tmp_path / "runs" / "cohort"), cwd=REPO, env=run_env(),
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "did not pass its quality screen" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "runs").exists()


def test_a_second_trainer_is_refused_on_every_rank_and_a_killed_one_is_taken_over(tmp_path):
    ds = tmp_path / "dense.json"
    ds.write_text(json.dumps(tiny_config()))
    # The holder: a process that owns `busy` the way a study or a trainer's rank 0 does, until it is killed.
    busy = tmp_path / "busy"
    owner = subprocess.Popen([sys.executable, "-c", "import sys, time; from nshard.lock import acquire; "
                              "acquire(sys.argv[1]); print('held', flush=True); time.sleep(600)", str(busy)],
                             cwd=REPO, env=run_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "held"
        refused = launch(busy, ds, world=2, check=False, timeout=300)
    finally:
        owner.kill()
        owner.wait(timeout=60)
    errors = refused_line(refused.stderr, "nshard: error (rank")
    assert refused.returncode != 0 and len(errors) == 2, refused.stderr[-3000:]
    assert all(f"in use by pid {owner.pid} on host {socket.gethostname()}" in e for e in errors)
    assert not busy.exists()  # refused before anything was written

    out = tmp_path / "run"
    killed = launch(out, ds, world=1, env={"NSHARD_FAULT": "0:1"}, check=False, timeout=300)
    assert killed.returncode != 0 and holder(lock_path(out)).get("pid"), killed.stderr[-3000:]
    pid = holder(lock_path(out))["pid"]
    rerun = launch(out, ds, world=1, extra_args=["--overwrite"], timeout=300)
    assert f"nshard: taking over the stale lock {lock_path(out)} of pid {pid} on host {socket.gethostname()}" \
        in rerun.stdout, rerun.stdout[-3000:]
    assert json.loads((out / "run.json").read_text())["status"] == "complete" and not lock_path(out).exists()
    # A refusal once the lock is held (the directory exists, no --overwrite) leaves no lock file behind.
    again = launch(out, ds, world=1, check=False, timeout=300)
    assert again.returncode != 0 and "already exists" in again.stderr and not lock_path(out).exists()
    # A refusal for a directory whose parents did not exist removes the folders the lock made for itself.
    plan = tmp_path / "long.toml"
    plan.write_text((REPO / "launch/plans/tiny.toml").read_text().replace("max_length = 256", "max_length = 24"))
    too_long = launch(tmp_path / "a" / "b" / "run", ds, world=1, plan=plan, check=False, timeout=300)
    assert too_long.returncode != 0 and "model.max_length" in too_long.stderr, too_long.stderr[-3000:]
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("break_it,expect", [
    (lambda tmp, plan: (tmp / "dense.json").write_text("{not json"), "not valid JSON at line 1"),
    (lambda tmp, plan: plan.write_text(plan.read_text().replace("ranks = 1", "ranks = 2")
                                       .replace("[study]\n", f'[study]\nhostfile = "{tmp / "hosts"}"\n')),
     "has 1 slots but arm one-rank asks for ranks=2"),
])
def test_a_study_refused_for_its_ds_config_or_hostfile_leaves_nothing(tmp_path, break_it, expect):
    plan = one_arm_plan(tmp_path)
    (tmp_path / "hosts").write_text("localhost slots=1\n")
    break_it(tmp_path, plan)
    out = tmp_path / "runs" / "study"
    proc = subprocess.run(study_cmd(plan, out), cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    errors = refused_line(proc.stderr, "nshard.study: error:")
    assert proc.returncode == 2 and len(errors) == 1 and expect in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_another_hosts_lock_refuses_while_its_heartbeat_lives_and_is_taken_over_after(tmp_path):
    """flock may not reach another host: a record of another boot whose file was touched recently refuses; one whose
    heartbeat is older than STALE_S is taken over. The record is written as another host's holder would leave it."""
    from nshard import lock

    out = tmp_path / "run"
    path = lock.lock_path(out)
    path.write_text(json.dumps({"pid": 4242, "host": "node-b", "boot_id": "another-boot", "started_at": "T"}))
    with pytest.raises(lock.LockError, match=r"in use by pid 4242 on host node-b .*heartbeat 0 s old"):
        lock.acquire(out)
    assert json.loads(path.read_text())["host"] == "node-b"  # a refusal leaves the holder's record as it was
    old = time.time() - lock.STALE_S - 5
    os.utime(path, (old, old))
    lines = []
    with lock.acquire(out, note=lines.append) as owned:
        assert lines == [f"taking over the stale lock {path} of pid 4242 on host node-b (started T): its heartbeat "
                         "stopped"]
        assert json.loads(path.read_text())["pid"] == os.getpid() and owned.took_over["host"] == "node-b"
    assert not path.exists() and not out.exists()


def test_a_link_planted_as_the_lock_file_is_refused_and_its_target_untouched(tmp_path):
    """Anyone who can write a shared runs folder could plant PARENT/.NAME.lock as a link to a file of the user who
    runs there: the holder truncates and writes its lock file, so the lock must not follow it."""
    from nshard import lock

    victim = tmp_path / "elsewhere" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text("precious\n")
    out = tmp_path / "runs" / "run"
    out.parent.mkdir()
    path = lock.lock_path(out)
    path.symlink_to(victim)
    with pytest.raises(lock.LockError) as refused:
        lock.acquire(out)
    message = str(refused.value)
    print(f"refusal: {message}")
    assert message == (f"the lock file {path} is a symbolic link (to {victim}); nshard does not write through links: "
                       f"remove it (rm {path}) if no run of yours is using that --out, and start again")
    assert victim.read_text() == "precious\n" and path.is_symlink() and not out.exists()
    path.unlink()  # the fix the message names
    with lock.acquire(out):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("plant,problem", [
    (lambda path, victim: os.link(victim, path), "has 2 hard links (another name shares its contents)"),
    (lambda path, victim: os.mkfifo(path), "is not a regular file"),
    (lambda path, victim: path.mkdir(), "cannot open the lock file"),
    (lambda path, victim: (path.write_text(""), os.chown(path, 65534, 65534)), "is owned by uid 65534, not by this user"),
])
def test_a_lock_file_that_is_not_a_plain_file_of_ours_is_refused(tmp_path, plant, problem):
    from nshard import lock

    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")
    out = tmp_path / "run"
    require("owned by" not in problem or os.geteuid() == 0, "root (giving a file to another user)")
    plant(lock.lock_path(out), victim)
    with pytest.raises(lock.LockError, match=rf"{re.escape(problem)}.*remove it \(rm {re.escape(str(lock.lock_path(out)))}\)"):
        lock.acquire(out)
    assert victim.read_text() == "precious\n" and not out.exists()
