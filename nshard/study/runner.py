"""The study: train the plan's arms, commit them together, score the seed and every candidate,
validate the scores, and analyze (screens, report, plots).

    python -m nshard.study --plan PLAN [--out DIR] [--set SECTION.KEY=VALUE ...] [--exploratory]   (or nshard-study)

DIR (default runs/<plan name>, as launch/study.sh and nshard/train.py name it) holds study.json, arms/<arm>/ (one run directory each),
logs/, commitment.json, eval/<model>/, validation.json, results.json, report.md, plots/, and last
evidence.tar (+ .sha256): the study's evidence and source in one archive (nshard/evidence/archive.py). With
study.store set, the record is pushed there before any score (anchor.json says where and when), and the committed
models and the evidence archive after the report (results.json's "stored").
Running it again reuses every arm that finished with the same plan, ds_config, rank count and replay setting.
An interrupted arm (a killed rank, a stopped study; [study.fault] declares one) resumes from its newest complete
state that verifies; without one it starts again from scratch, its earlier run directory under failed/. A failed
arm keeps every attempt's log and is reported as failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from nshard import lock
from nshard.cli import SPELLING_NOTE, ArgumentParser, add_plan_overrides, plan_with_overrides, prog
from nshard.evidence.archive import ArchiveError, create_study_archive
from nshard.files import file_sha256, write_json_atomic
from nshard.log import log
from nshard.run.device import cuda_available
from nshard.study import growth as growth_mod
from nshard.study import placement as placement_mod
from nshard.seam.launch_env import free_port
from nshard.run.plan import REPO_ROOT, ArmSpec, Plan, PlanError, find_beside, load_plan

TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "train.py"
"""nshard/train.py of the nshard this runner was imported from (a checkout or an installed copy)."""


class StudyError(RuntimeError):
    """A study that cannot go on; the message says which step and what to do."""


def say(message: str) -> None:
    print(f"[study] {message}", flush=True)


def resolve_ds_config(path: str, plan_path: Path) -> Path:
    """A relative ds_config path is read from the working directory, else beside the plan (its folder or the
    nearest one above it that holds the path), else from the repository root."""
    for candidate in (Path(find_beside(path, plan_path)), REPO_ROOT / path):
        if candidate.is_file():
            return candidate.resolve()
    raise StudyError(f"study.arms ds_config {path} does not exist (looked in {Path.cwd()}, beside {plan_path} "
                     f"and in {REPO_ROOT}); fix the arm's ds_config path")


def launch_command(arm: ArmSpec, plan: Plan, plan_path: Path, ds_config: Path, run_dir: Path, port: int,
                   hosts: dict | None = None, resume: bool = False) -> list[str]:
    """DeepSpeed's own launcher: one rank, N local ranks, the plan's hostfile, or the emulated hosts (the one-rank
    arm on the first, through the same multi-node path, and a two-rank arm across both). resume: continue the run
    directory from its newest complete state (--resume) instead of starting it afresh (--overwrite)."""
    deepspeed = str(Path(sys.executable).with_name("deepspeed"))
    return [deepspeed, *launcher_where(arm, plan, hosts), "--master_port", str(port), str(TRAIN_SCRIPT),
            "--ds_config", str(ds_config), "--plan", str(plan_path), "--out", str(run_dir),
            "--resume" if resume else "--overwrite",
            *([] if arm.replay else ["--no_replay"]),
            *(["--grown", str(growth_mod.grown_dir(run_dir.parent.parent))] if arm.grown else [])]


def launcher_where(arm: ArmSpec, plan: Plan, hosts: dict | None = None) -> list[str]:
    """The launcher's placement arguments for one arm (a hostfile that does not fit the arm is refused here)."""
    from nshard.run.hostfile import parse_hostfile

    if hosts is not None:
        if arm.ranks > len(hosts["hosts"]):
            raise StudyError(f"arm {arm.name} asks for ranks={arm.ranks}; the emulated placement has "
                             f"{len(hosts['hosts'])} hosts of one rank each")
        return (["--hostfile", str(hosts["first"]), "--force_multi"] if arm.ranks == 1
                else ["--hostfile", str(hosts["all"])])
    if arm.ranks == 1 or not plan.study.hostfile:
        return ["--num_gpus", str(arm.ranks)]
    slots = parse_hostfile(plan.study.hostfile)
    if sum(slots.values()) != arm.ranks:
        raise StudyError(f"study.hostfile {plan.study.hostfile} has {sum(slots.values())} slots but arm "
                         f"{arm.name} asks for ranks={arm.ranks}; make them agree")
    where = ["--hostfile", plan.study.hostfile]
    if list(slots) == ["localhost"]:  # DeepSpeed's plain form would ssh to localhost
        where += ["--no_ssh_check", "--master_addr", "127.0.0.1"]
    return where


def check_arms(plan: Plan, plan_path: Path) -> None:
    """Before the study directory is touched: every arm's ds_config exists and parses, and the hostfile fits it."""
    from nshard.seam.ds_config import load_ds_config

    for arm in plan.study.arms:
        if not arm.interpolate:  # an interpolated arm launches nothing
            load_ds_config(resolve_ds_config(arm.ds_config, plan_path))
            launcher_where(arm, plan)


def arm_is_done(run_dir: Path, plan_sha: str, ds_sha: str, ranks: int, replay: bool = True) -> bool:
    """Finished earlier with the same inputs: complete run.json, same hashes and rank count, an exported model."""
    try:
        run = json.loads((run_dir / "run.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (run.get("status") == "complete" and run.get("plan_sha256") == plan_sha
            and run.get("ds_config_sha256") == ds_sha and run.get("world_size") == ranks
            and run.get("replay", True) == replay
            and (run_dir / "model" / "model.safetensors").is_file())


def logged_launch(cmd: list[str], log: Path, fault: str | None = None) -> tuple[int, float, float]:
    """Run a launcher command with its output (after the command line) in `log`: exit status, seconds, and the
    wall-clock time it started. fault: NSHARD_FAULT for this launch alone (nshard/run/fault.py); every other launch
    runs without one, whatever the study's own environment holds."""
    env = {k: v for k, v in os.environ.items() if k != "NSHARD_FAULT"}
    if fault:
        env["NSHARD_FAULT"] = fault
    t0, started_at = time.perf_counter(), time.time()
    with log.open("w") as f:
        f.write(("" if not fault else f"$ export NSHARD_FAULT={fault}\n") + "$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env).returncode
    return rc, time.perf_counter() - t0, started_at


def resume_point(run_dir: Path, plan_path: Path, ds_config: Path, ranks: int):
    """The state an interrupted attempt of the arm continues from: the newest complete state of its run directory that
    verifies and was made with these inputs (nshard/run/state.py: find_resumable, what the trainer's --resume picks;
    newer damaged states are passed over), or None: no such state, the arm starts from scratch."""
    from nshard.run.state import StateError, find_resumable

    if not (run_dir / "state").is_dir():
        return None
    try:
        return find_resumable(run_dir, plan_path, ds_config, ranks)
    except StateError:
        return None


def updates_reached(run_dir: Path) -> int:
    """The updates an attempt finished, as metrics.jsonl records them (rank 0 writes a line once an update is done;
    a resume drops the lines after its state, so read it before the resume starts)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    reached = 0
    for number, line in enumerate(lines, start=1):
        try:
            if json.loads(line).get("update") != number:
                break
        except (ValueError, AttributeError):
            break
        reached = number
    return reached


def recovery_record(point, failed: dict | None) -> dict:
    """What resuming from `point` after the failed attempt `failed` (None: an attempt the study did not record,
    because the study itself was stopped) redoes and loses. seconds_lost is the failed attempt's wall seconds after
    the resumed state was written (its manifest's written_at): the updates after that state, the failure and the
    teardown; all of its wall seconds when the state is older than the attempt."""
    written = datetime.datetime.fromisoformat(json.loads((point.state / "manifest.json").read_text())["written_at"])
    written_at = written.timestamp()
    record = {"resumed_from_update": point.update, "state": point.state.name, "state_written_at": written_at,
              "skipped_states": [dict(s) for s in point.skipped], "failed_log": None, "failed_wall_s": None,
              "updates_reached": None, "updates_redone": None, "seconds_lost": None}
    if failed is not None:
        wall, reached = failed["wall_s"], failed["updates_reached"]
        kept = min(max(written_at - failed["started_at"], 0.0), wall)
        record.update(failed_log=failed["log"], failed_wall_s=wall, updates_reached=reached,
                      updates_redone=max(reached - point.update, 0), seconds_lost=wall - kept)
    return record


def launch_attempt(arm: ArmSpec, plan: Plan, plan_path: Path, ds_config: Path, run_dir: Path, log: Path,
                   hosts: dict | None, point, fault: str | None) -> dict:
    """One launch of the arm into run_dir: from scratch (point None) or resumed from `point`; its record."""
    cmd = launch_command(arm, plan, plan_path, ds_config, run_dir, free_port(), hosts, resume=point is not None)
    how = "from scratch" if point is None else f"resumed from {point.state.name}"
    say(f"arm {arm.name}: training on {arm.ranks} rank(s) with {arm.ds_config}, {how}"
        + (f", with the plan's fault NSHARD_FAULT={fault}" if fault else "") + f" (log: {log})")
    rc, wall, started_at = logged_launch(cmd, log, fault)
    # Wall-clock ends of the launch (the receipts' process_start_at share the clock: emulated hosts share the
    # kernel), so the report can show the launch before the ranks' processes and the teardown after their receipts.
    return {"rc": rc, "log": str(log), "wall_s": wall, "started_at": started_at, "ended_at": time.time(),
            "at": datetime.datetime.now(datetime.timezone.utc).isoformat(), "plan_sha256": file_sha256(plan_path),
            "ds_config_sha256": file_sha256(ds_config), "resumed_from_update": None if point is None else point.update,
            "fault": fault, "updates_reached": None if rc == 0 else updates_reached(run_dir)}


def attempt_cost(attempts: list[dict], plan_sha: str, ds_sha: str) -> dict:
    """The failed attempts of the arm with its final inputs (plan and ds_config): how many, and their launcher wall
    seconds, which the arm's complete process group time counts (no receipt survives a killed rank)."""
    failed = [a for a in attempts if a["rc"] != 0 and a.get("plan_sha256") == plan_sha
              and a.get("ds_config_sha256") == ds_sha]
    return {"failed_attempts": len(failed), "failed_attempts_s": sum(a["wall_s"] for a in failed)}


def attempt_fault(declared, arm: str, number: int) -> str | None:
    """NSHARD_FAULT for attempt `number` of `arm`: the plan's [study.fault] on its own arm's first attempt only."""
    return declared.env() if declared and declared.arm == arm and number == 1 else None


def train_arm(arm: ArmSpec, plan: Plan, plan_path: Path, out: Path, previous: dict | None,
              hosts: dict | None = None) -> dict:
    """Train one arm unless it already finished with these inputs. An interrupted attempt (a killed rank, a
    stopped study) is continued with --resume from its newest complete state that verifies, in the same run
    directory, as long as each failed attempt saved a newer state than it started from; without such a state the
    arm starts from scratch (the earlier run directory kept under failed/). The plan's [study.fault] kills one
    rank of its arm on the arm's first attempt."""
    ds_config = resolve_ds_config(arm.ds_config, plan_path)
    run_dir = out / "arms" / arm.name
    plan_sha, ds_sha = file_sha256(plan_path), file_sha256(ds_config)
    attempts = list((previous or {}).get("attempts", []))
    entry = {"name": arm.name, "ranks": arm.ranks, "ds_config": str(ds_config), "ds_config_sha256": ds_sha,
             "run_dir": str(run_dir), "attempts": attempts}
    if arm_is_done(run_dir, plan_sha, ds_sha, arm.ranks, arm.replay):
        say(f"arm {arm.name}: finished earlier with the same plan and ds_config; reused")
        last = attempts[-1] if attempts else {}
        return {**entry, "status": "complete", "reused": True, "log": last.get("log"),
                "launcher_wall_s": last.get("wall_s"), "recovery": (previous or {}).get("recovery", []),
                **attempt_cost(attempts, plan_sha, ds_sha)}
    # A killed study recorded no attempt for the arm it was training, but left its log: the next number is free.
    number = len(attempts) + 1
    while (out / "logs" / f"{arm.name}-attempt-{number}.log").exists():
        number += 1
    fault = attempt_fault(plan.study.fault, arm.name, number)
    point = resume_point(run_dir, plan_path, ds_config, arm.ranks)
    recovery = []
    if point is not None:  # an attempt of an earlier study run was interrupted: continue it
        last = attempts[-1] if attempts else None
        recorded = last if last and last["log"] == str(out / "logs" / f"{arm.name}-attempt-{number - 1}.log") else None
        recovery = [*(previous or {}).get("recovery", []), recovery_record(point, recorded)]
    elif run_dir.exists():  # an unfinished or stale attempt with no state to continue stays in the evidence
        keep = out / "failed" / f"{arm.name}-attempt-{number - 1}"
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(keep, ignore_errors=True)
        run_dir.rename(keep)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    while True:
        log = out / "logs" / f"{arm.name}-attempt-{number}.log"
        attempt = launch_attempt(arm, plan, plan_path, ds_config, run_dir, log, hosts, point, fault)
        attempts.append(attempt)
        ok = attempt["rc"] == 0 and arm_is_done(run_dir, plan_sha, ds_sha, arm.ranks, arm.replay)
        if fault and ok:
            log.warning("arm %s: the plan's fault NSHARD_FAULT=%s did not stop it: the variable did not reach the "
                        "rank (local launches and the emulated hosts pass it; other hosts' sshd must accept NSHARD_* "
                        "variables)", arm.name, fault)
        if ok:
            break
        after = resume_point(run_dir, plan_path, ds_config, arm.ranks)
        if after is None or after.update <= (point.update if point else 0):
            break  # no newer complete state: a resume would repeat the attempt that just failed
        say(f"arm {arm.name}: attempt {number} failed (exit {attempt['rc']}) after update "
            f"{attempt['updates_reached']}; resuming from {after.state.name}")
        recovery.append(recovery_record(after, attempt))
        point, fault, number = after, None, number + 1
    status = "complete" if ok else "failed"
    wall = attempt["wall_s"]
    cost = attempt_cost(attempts, plan_sha, ds_sha)
    say(f"arm {arm.name}: {status} in {wall:.0f} s" + ("" if ok else f" (exit {attempt['rc']}); see {log}")
        + (f" after {cost['failed_attempts']} failed attempt(s) of {cost['failed_attempts_s']:.0f} s"
           if ok and cost["failed_attempts"] else ""))
    tail = [] if ok else log.read_text(errors="replace").splitlines()[-15:]
    return {**entry, "status": status, "reused": False, "log": str(log), "launcher_wall_s": wall,
            "rc": attempt["rc"], "launcher_started_at": attempt["started_at"], "launcher_ended_at": attempt["ended_at"],
            "error_tail": tail, "recovery": recovery, **cost}


WARM_UP_TRAIN = {"updates": 1, "global_batch_docs": 2, "microbatch_docs": 1}
"""The warm-up launch trains one update of two documents: enough to pass through every step an arm takes."""


def without_fault(text: str) -> str:
    """The plan text without its study.fault (written again by the plan writer, nshard/cli.py, only if it has one)."""
    import tomllib

    from nshard.cli import toml_text

    raw = tomllib.loads(text)
    if "fault" not in raw.get("study", {}):
        return text
    del raw["study"]["fault"]
    return toml_text(raw)


def warm_up_hosts(plan: Plan, plan_path: Path, out: Path, hosts: dict) -> dict:
    """One throwaway launch across every host before the first timed arm, through the launcher, ssh, interpreter,
    caches and link the arms use: what a first process on a host pays once (DeepSpeed's CPU collective compiled
    for that host's venv, the model and the venv read into its page cache, ssh and gloo set up) is paid here, so
    the first arm does not carry what the others reuse. Its receipts say what one-time work it did; the arms'
    receipts must then say none (the report shows each arm's start-up). Its run directory is removed after."""
    import re

    arm = next((a for a in plan.study.arms if a.ranks == len(hosts["hosts"])), plan.study.arms[0])
    text = plan_path.read_text()
    for key, value in WARM_UP_TRAIN.items():
        text, n = re.subn(rf"(?m)^{key} = \d+", f"{key} = {value}", text, count=1)
        if n != 1:
            raise StudyError(f"the host warm-up needs a '{key} = N' line in the plan's [train] section")
    text = without_fault(text)  # the one-update warm-up kills no rank (and its plan could not hold the update)
    warm_plan, run_dir = out / "warm-up.toml", out / "warm-up"
    warm_plan.write_text(text)
    log = out / "logs" / "warm-up.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = launch_command(arm, plan, warm_plan, resolve_ds_config(arm.ds_config, plan_path), run_dir, free_port(),
                         hosts)
    rc, wall, _ = logged_launch(cmd, log)
    receipts = [json.loads(p.read_text()) for p in sorted((run_dir / "receipts").glob("rank-*.json"))]
    if rc != 0 or len(receipts) != arm.ranks:
        raise StudyError(f"the warm-up launch on the emulated hosts failed (exit {rc}); see {log}: the arms would "
                         "fail the same way")
    shutil.rmtree(run_dir)
    warm_plan.unlink()
    work = sorted({w for r in receipts for w in (r.get("startup") or {}).get("one_time_work", [])})
    say(f"hosts warmed up in {wall:.0f} s by a {arm.ranks}-rank launch of one update"
        + (f" ({'; '.join(work)})" if work else " (no one-time work was left)"))
    return {"wall_s": wall, "ranks": arm.ranks, "ds_config": arm.ds_config, "log": str(log), "one_time_work": work}


def settle_state(arm: ArmSpec, plan: Plan, entry: dict) -> dict:
    """Keep the arm's final complete state only where the plan wants it (default: the candidate alone); the
    others' states go once the arm finished (the main job would otherwise leave gigabytes per arm)."""
    state = Path(entry["run_dir"]) / "state"
    keep = arm.keep_state if arm.keep_state is not None else arm.name == plan.study.candidate
    if entry["status"] != "complete" or not state.is_dir():
        return entry
    size = sum(p.stat().st_size for p in state.rglob("*") if p.is_file())
    if keep:
        return {**entry, "state": {"kept": True, "path": str(state), "bytes": size}}
    shutil.rmtree(state)
    say(f"arm {arm.name}: final state removed ({size / 1e9:.2f} GB); set keep_state = true on the arm to keep it")
    return {**entry, "state": {"kept": False, "removed_bytes": size}}


def in_plan_order(plan: Plan, trained: list[dict], out: Path, seed_dir: Path) -> list[dict]:
    """Every arm's study.json entry in the plan's order: the trained arms' as they finished, each interpolated
    arm made from its trained arm's export and the seed model (nshard/study/derived.py)."""
    from nshard.study.derived import derive_arm

    entries = {e["name"]: e for e in trained}
    for arm in plan.study.arms:
        if arm.interpolate:
            entries[arm.name] = derive_arm(arm, entries[arm.interpolate], out, seed_dir, say)
    return [entries[a.name] for a in plan.study.arms]


def commit_candidates(out: Path, seed_dir: Path, arms: dict[str, Path]) -> dict:
    """One record for all finished arms; an earlier record that names exactly the same models is kept."""
    from nshard.evidence import commit

    path = out / "commitment.json"
    fresh = commit.build_commitment(seed_dir, arms)
    if path.is_file():
        # An earlier record is evidence: a damaged one, or one naming other models, stops the study rather
        # than being replaced without a word (scores made under it would lose what vouched for them).
        old = commit.load_commitment(path)  # CommitError names the damage

        def key(record):
            return [(c["name"], c["files"], c["parameter_root"]) for c in record["candidates"]], record["seed"]["files"]
        if key(old) != key(fresh):
            raise commit.CommitError(f"{path} (record {old['record_sha256'][:16]}) commits other models than this "
                                     "run trained; keep it as evidence, move it aside and run the study again")
        say(f"commitment {old['record_sha256'][:16]} already names these candidates; kept")
        return old
    write_json_atomic(path, fresh)
    say(f"committed {len(arms)} candidate(s) before scoring: record {fresh['record_sha256'][:16]} ({path})")
    return fresh


def say_declared_power(plan: Plan, arms: dict[str, Path]) -> list[dict]:
    """Before any case is scored: the probability that a candidate equal to its control passes each paired screen
    at its number of cases (screens.expected_discordance), with a warning below 80%. A growth study's screen of grown
    against continued dense asks for an advantage, not parity, so only its first-cohort screen has one."""
    from nshard.analysis.report import declared_powers, power_lines

    if plan.study.candidate not in arms or plan.growth.first_cohort_margin_points:
        return []  # a declared growth screen said its powers before training (nshard/study/growth.py declare_screen)
    sets = json.loads((arms[plan.study.candidate] / "prepared" / "sets.json").read_text())
    controls = [] if plan.growth.enabled else [a.name for a in plan.study.arms
                                               if a.name != plan.study.candidate and a.name in arms]
    powers = declared_powers(sets, dataclasses.asdict(plan.screens), controls)
    for power, line in zip(powers, power_lines(powers)):
        say(f"declared power: {line[2:]}")
        if power.get("cases_for_90"):  # under 80%: declare more cases
            log.warning("%s", line[2:])
    return powers


def score_all(plan: Plan, out: Path, seed_dir: Path, arms: dict[str, Path], record: dict | None) -> dict[str, Path]:
    """Score the seed and every candidate (retention measured against the seed's losses); on a CPU of several cores
    every model's scoring batches are shared among a process per core (evaluate.side_by_side_layout)."""
    from nshard.evidence import commit
    from nshard.study.evaluate import (prepare_scoring, read_jsonl, read_seed_heldout, score_share, side_by_side,
                                       side_by_side_layout, write_scores)

    exploratory = record is None
    # The candidate's sets: a no-replay control has no retention documents of its own.
    reference_run = arms[reference_arm(plan, arms)]
    identity = json.loads((reference_run / "prepared" / "identity.json").read_text())["prepared_identity"]
    evals = {label: out / "eval" / label for label in ("seed", *arms)}
    todo = []
    for label, model_dir in [("seed", seed_dir), *((name, run / "model") for name, run in arms.items())]:
        summary_path = evals[label] / "summary.json"
        if summary_path.is_file():
            summary = json.loads(summary_path.read_text())
            same = (summary.get("commitment") == (record or {}).get("record_sha256")
                    and summary.get("prepared_identity") == identity
                    and summary.get("exploratory") == exploratory
                    and summary.get("model_files") == commit.model_files(model_dir)
                    and summary.get("with_seed_retention") == (label != "seed"))
            if same:
                say(f"score {label}: scored earlier under the same commitment; reused")
                continue
        say(f"score {label}: {model_dir}")
        todo.append(prepare_scoring(label, model_dir, reference_run, exploratory=exploratory,
                                    commitment=None if exploratory else out / "commitment.json"))
    if not todo:
        return evals
    max_new, batch_size = plan.study.eval_max_new_tokens, plan.study.eval_batch_size
    processes, threads = side_by_side_layout(len(todo[0].inputs), batch_size, max_new, cuda_available())
    jobs = [share for scoring in todo for share in scoring.shares(max_new, batch_size, processes)]
    if processes > 1:
        say(f"scoring {len(todo)} models in {processes} processes of {threads} thread(s) each, every model's "
            "batches shared among them")
    shares = side_by_side(score_share, jobs, processes, threads)
    for k, scoring in sorted(enumerate(todo), key=lambda kv: kv[1].label != "seed"):  # the seed's losses first
        is_seed = scoring.label == "seed"
        seed_rows = None if is_seed else read_jsonl(evals["seed"] / "retention.jsonl")
        write_scores(scoring, shares[k * processes:(k + 1) * processes], evals[scoring.label],
                     exploratory=exploratory, seed_rows=seed_rows, max_new_tokens=max_new, batch_size=batch_size,
                     seed_heldout_rows=None if is_seed else read_seed_heldout(evals["seed"]))
    return evals


def arm_placements(plan: Plan, plan_path: Path) -> list:
    """The distinct devices and dtypes the arms generate replay answers in (nshard/run/device.py)."""
    from nshard.run.device import run_placement
    from nshard.seam.ds_config import load_ds_config

    placements = [run_placement(load_ds_config(resolve_ds_config(arm.ds_config, plan_path))) for arm in plan.study.arms
                  if not arm.interpolate]
    return list(dict.fromkeys(placements))


def prepare_shared_caches(plan: Plan, plan_path: Path) -> None:
    """One-time work that no arm should pay inside its timed process: the model conversion, the seed
    model's replay answers, own data's tokens, DeepSpeed's CPU collective build. The first arm would otherwise carry it."""
    import torch

    from nshard.run.cohort import start_model_spec
    from nshard.run.models import load_tokenizer, resolve_model
    from nshard.run.replay import heldout_retention_documents, replay_documents

    t0 = time.perf_counter()
    ref = resolve_model(start_model_spec(plan))
    for placement in arm_placements(plan, plan_path):  # where each arm's rank 0 will look for them
        replay_documents(plan, ref, load_tokenizer(ref), placement)
        heldout_retention_documents(plan, ref, load_tokenizer(ref), placement)
    if plan.data.chat_train:  # own data: checked and tokenized once, before any arm's timed process
        from nshard.run.chat import chat_data

        chat_data(plan, load_tokenizer(ref))
    if not torch.cuda.is_available():
        from nshard.seam.engine import build_cpu_comm_extension

        build_cpu_comm_extension()
    say(f"shared caches ready (model, replay answers, DeepSpeed's CPU collective) in {time.perf_counter() - t0:.0f} s")


def push_stored(src: Path | dict[str, Path], uri: str, expect: dict[str, str] | None = None) -> dict:
    """Push a tree (a directory, or relative path -> file) to a store location, every object read back; with
    `expect` (relative path -> sha256) the stored index must list exactly those files."""
    from nshard.evidence.store import open_backend, push_files, read_index, source_files

    backend = open_backend(uri)
    pushed = push_files(source_files(src) if isinstance(src, Path) else src, backend)
    if expect is not None and {k: v["sha256"] for k, v in read_index(backend).items()} != expect:
        raise StudyError(f"{uri} does not hold the committed files {sorted(expect)}; the export changed since the "
                         "commitment")
    return {k: pushed[k] for k in ("uri", "index_sha256", "files", "bytes")}


def anchor_commitment(plan: Plan, out: Path, record: dict | None) -> dict | None:
    """With study.store set: before any score, push commitment.json to <store>/commitment/<record[:16]>/ and write
    anchor.json (where, the index, the record, and the store's own time of the object: S3's clock, not ours)."""
    from nshard.evidence.backend import StoreError
    from nshard.evidence.store import object_key, open_backend

    if not plan.study.store or record is None:
        return None
    path, record_sha = out / "commitment.json", record["record_sha256"]
    uri = f"{plan.study.store.rstrip('/')}/commitment/{record_sha[:16]}"
    try:
        stored = push_stored(path, uri)
        stored_at, clock = open_backend(uri).last_modified(object_key(file_sha256(path)))
    except (StoreError, OSError) as exc:
        raise StudyError(f"study.store: pushing {path.name} to {uri} failed, so nothing was scored: {exc}; fix the "
                         "store or its access and run the study again (finished arms are reused)") from None
    anchor = {**stored, "record_sha256": record_sha, "commitment_json_sha256": file_sha256(path),
              "stored_at": stored_at, "clock": clock}
    write_json_atomic(out / "anchor.json", anchor)
    say(f"commitment {record_sha[:16]} anchored in {anchor['uri']} before scoring (stored at {stored_at}, "
        f"{clock} clock)")
    return anchor


def push_outputs(plan: Plan, out: Path, record: dict | None) -> dict | None:
    """With study.store set, after the report (and the evidence archive, where one was made): every committed
    model to <store>/models/<arm>-<root[:16]>/, evidence.tar and its .sha256 to <store>/evidence/<record[:16]>-<archive sha256[:16]>/;
    results.json then names each location."""
    from nshard.evidence.backend import StoreError

    if not plan.study.store or record is None:
        return None
    store, record_sha = plan.study.store.rstrip("/"), record["record_sha256"]
    stored = {"commitment": json.loads((out / "anchor.json").read_text()), "models": {}, "evidence": None}
    try:
        for c in record["candidates"]:
            uri = f"{store}/models/{c['name']}-{c['parameter_root'][:16]}"
            stored["models"][c["name"]] = push_stored(Path(c["model_dir"]), uri, expect=c["files"])
            say(f"stored model {c['name']} in {uri}")
        archive = out / "evidence.tar"
        if archive.is_file():
            files = {archive.name: archive, f"{archive.name}.sha256": out / f"{archive.name}.sha256"}
            # One prefix per archive: a re-run writes a new archive (its study.json and logs differ), never
            # over the one an earlier run stored.
            archive_sha = file_sha256(archive)
            stored["evidence"] = push_stored(files, f"{store}/evidence/{record_sha[:16]}-{archive_sha[:16]}")
            say(f"stored the evidence archive in {stored['evidence']['uri']}")
    except (StoreError, OSError) as exc:
        raise StudyError(f"study.store: storing the study's outputs failed: {exc}; the scores stand, results.json "
                         "names no stored copy: run the study again to push them (nothing is retrained)") from None
    results = json.loads((out / "results.json").read_text())
    write_json_atomic(out / "results.json", {**results, "stored": stored})
    return stored


def accept_cohort(plan: Plan) -> dict:
    """A second cohort: before anything is trained or written, the accepted study is checked (nshard/study/cohort.py:
    screen, export, results); the record is the start of the provenance chain (cohort.json)."""
    from nshard.study.cohort import accept

    ranks = tuple(a.ranks for a in plan.study.arms) if plan.cohort.start == "state" else ()
    record = accept(plan, ranks)
    say(f"second cohort from {record['candidate']} of {record['study']} (commitment "
        f"{record['first_commitment_sha256'][:16]}, start = {record['start']}); accepted")
    return record


def default_out(plan: Plan) -> Path:
    """runs/<plan name>: where launch/study.sh puts a study and where a second cohort's `cohort.from` looks."""
    return Path("runs") / plan.name


def reference_arm(plan: Plan, done: dict[str, Path]) -> str:
    """The finished arm whose prepared sets every model is scored and validated on: the candidate, or where it
    failed the first finished arm (the arms of one study share their evaluation sets)."""
    return plan.study.candidate if plan.study.candidate in done else next(iter(done))


def validate_scores(plan: Plan, arm_plans: dict[str, Path], out: Path, done: dict[str, Path],
                    evals: dict[str, Path], record: dict | None, tokenizer) -> dict:
    """Post-scoring validation into validation.json, against the reference arm's run and its own plan (a growth
    study's arms have plans of their own); a failure is written there too (passed: false, and where), so the
    analysis refuses the study rather than finding no record of it, and then stops the study."""
    from nshard.study.validate import ValidationError, validate

    t0 = time.perf_counter()
    reference = reference_arm(plan, done)
    try:
        validation = validate(done[reference], tokenizer, evals, record=record, plan_path=arm_plans[reference],
                              regenerate=plan.study.validate_regenerate)
    except ValidationError as exc:
        write_json_atomic(out / "validation.json", {"passed": False, "error": str(exc)})
        raise
    validation["validate_s"] = time.perf_counter() - t0
    write_json_atomic(out / "validation.json", validation)
    what = ("every answer generated and every retention and held-out loss scored again" if validation["regenerated"]
            else "stored files checked against each other, nothing regenerated (the result is exploratory)")
    say(f"validation passed: {len(evals)} models x {validation['case_ids']} cases, {what}, in "
        f"{validation['validate_s']:.0f} s")
    return validation


def run_study(plan_path: Path, out: Path | None = None, exploratory: bool = False, overrides=()) -> dict:
    """overrides: --set SECTION.KEY=VALUE texts; the arms then train on the plan file that holds them."""
    plan_path = plan_with_overrides(Path(plan_path).resolve(), overrides)
    plan = load_plan(plan_path)
    out = Path(out or default_out(plan)).resolve()
    check_arms(plan, plan_path)  # every ds_config and the hostfile, before the first arm starts
    # One study owns `out` (nshard/lock.py); its arms' trainers own their run directories under it.
    with lock.acquire(out, note=say):
        return run_owned(plan, plan_path, out, exploratory)


def run_owned(plan: Plan, plan_path: Path, out: Path, exploratory: bool) -> dict:
    from nshard.run.cohort import start_model_spec
    from nshard.run.models import ModelRef, load_tokenizer, resolve_model

    t0 = time.perf_counter()
    # Every refusal comes before the study directory is touched: a refused study leaves it as it was.
    cohort = accept_cohort(plan) if plan.cohort.enabled else None
    placement = placement_mod.describe(plan, cuda_available())  # reads the hostfile: before any cost
    line, warning = placement_mod.preflight(placement)
    say(line)
    if warning:  # before any cost, not first in the report at the end
        log.warning("%s", warning)
    prepare_shared_caches(plan, plan_path)
    out.mkdir(parents=True, exist_ok=True)
    if cohort is not None:
        write_json_atomic(out / "cohort.json", cohort)
    previous = {}
    if (out / "study.json").is_file():
        previous = {a["name"]: a for a in json.loads((out / "study.json").read_text()).get("arms", [])}
    study = {"plan": str(plan_path), "plan_sha256": file_sha256(plan_path), "plan_name": plan.name,
             "candidate": plan.study.candidate, "speed_baseline": plan.study.speed_baseline,
             "screens": dataclasses.asdict(plan.screens), "exploratory": exploratory, "arms": [], "cohort": cohort,
             "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    shutil.copyfile(plan_path, out / "plan.toml")
    # A growth study: the candidate grown, the budget in numbers and each arm's plan, before any arm.
    arm_plans = {a.name: plan_path for a in plan.study.arms}
    if plan.growth.enabled:
        study["growth"], grown_plans = growth_mod.plan_budget(plan, plan_path, out, say, resolve_ds_config)
        arm_plans.update(grown_plans)
    study["placement"] = placement
    with contextlib.ExitStack() as stack:
        hosts = None
        if study["placement"]["kind"] == "emulated":
            hosts = stack.enter_context(placement_mod.emulated_hosts(plan.study.link, plan.study.cores_per_host, out,
                                                                     placement["pin"]["mode"]))
            study["placement"].update(hosts=hosts["hosts"], cores=hosts["cores"], pinned=hosts["pinned"])
            where = [f"{h} on core(s) {c} ({p})" for h, c, p in zip(hosts["hosts"], hosts["cores"], hosts["pinned"])]
            say(f"emulated hosts up: {', '.join(where)}, link {plan.study.link}")
            if not all(arm_is_done(out / "arms" / a.name, file_sha256(arm_plans[a.name]),
                                   file_sha256(resolve_ds_config(a.ds_config, plan_path)), a.ranks, a.replay)
                       for a in plan.study.arms if not a.interpolate):  # an arm will be timed
                study["warm_up"] = warm_up_hosts(plan, plan_path, out, hosts)
        for arm in plan.study.arms:
            if arm.interpolate:  # made from a trained arm, after the hosts are down
                continue
            study["arms"].append(settle_state(arm, plan, train_arm(arm, plan, arm_plans[arm.name], out,
                                                                    previous.get(arm.name), hosts)))
            write_json_atomic(out / "study.json", study)
    if hosts is not None:
        say("emulated hosts down")
    # A second cohort's "seed" is the accepted candidate: its gain, pairing and retention are measured against it.
    seed_dir = Path(resolve_model(start_model_spec(plan)).path)
    study["arms"] = in_plan_order(plan, study["arms"], out, seed_dir)
    write_json_atomic(out / "study.json", study)
    train_s = time.perf_counter() - t0
    done = {a["name"]: Path(a["run_dir"]) for a in study["arms"] if a["status"] == "complete"}
    if not done:
        raise StudyError(f"no arm finished; see the logs under {out / 'logs'}")

    record = None if exploratory else commit_candidates(out, seed_dir, done)
    anchor_commitment(plan, out, record)
    if exploratory:
        say("EXPLORATORY: scoring without a commitment; every output says so")
    say_declared_power(plan, done)
    evals = score_all(plan, out, seed_dir, done, record)
    tokenizer = load_tokenizer(ModelRef(str(seed_dir), str(seed_dir), None, "local"))
    validation = validate_scores(plan, arm_plans, out, done, evals, record, tokenizer)
    study["validation"] = {k: validation.get(k) for k in ("passed", "case_ids", "regenerated", "validate_s")}
    if plan.growth.enabled:  # the cost of each model beside its gain, measured here, now, one model at a time
        from nshard.study.serving import measure_all

        measure_all({name: run / "model" for name, run in done.items()}, done[reference_arm(plan, done)],
                    out / "serving.json", plan.study.eval_batch_size, note=say)
    study["train_s"], study["total_s"] = train_s, time.perf_counter() - t0
    write_json_atomic(out / "study.json", study)
    # The analysis reads files only; a separate process keeps torch and nshard out of it.
    proc = subprocess.run([sys.executable, "-m", "nshard.analysis.report", str(out)])
    if proc.returncode != 0:
        raise StudyError(f"analysis failed (exit {proc.returncode}); rerun python -m nshard.analysis.report {out}")
    say(f"results: {out / 'results.json'}; report: {out / 'report.md'}; plots: {out / 'plots'}")
    archive = create_study_archive(out)
    say(f"evidence: {archive['archive']} ({archive['members']} files, sha256 {archive['sha256'][:16]}; "
        f"python -m nshard.evidence.archive verify {archive['archive']})")
    push_outputs(plan, out, record)
    return json.loads((out / "results.json").read_text())


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes the study directory DIR described above (with --set, the plan with its overrides is its "
              "plan.toml, and every arm trains on it). " + SPELLING_NOTE)
    parser = ArgumentParser(prog=prog("nshard.study"), description=__doc__, epilog=epilog)
    parser.add_argument("--plan", required=True, type=Path, help="experiment plan TOML with a [study] section")
    add_plan_overrides(parser)
    parser.add_argument("--out", type=Path, help="study directory (default runs/<plan name>)")
    parser.add_argument("--exploratory", action="store_true",
                        help="score without a commitment; every output is marked exploratory")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from nshard.evidence.commit import CommitError
    from nshard.study.evaluate import EvalError
    from nshard.run.data import DataError
    from nshard.run.hostfile import HostfileError
    from nshard.seam.ds_config import DsConfigError
    from nshard.study.serving import ServingError
    from nshard.study.validate import ValidationError

    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        results = run_study(args.plan, args.out, args.exploratory, args.set)
    except (PlanError, DataError, DsConfigError, StudyError, CommitError, EvalError, ValidationError, HostfileError,
            ArchiveError, placement_mod.PlacementError, lock.LockError, growth_mod.GrowthError, ServingError,
            OSError) as exc:
        print(f"nshard.study: error: {exc}", file=sys.stderr)
        return 2
    failed = [a["name"] for a in results["arms"] if a["status"] != "complete"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
