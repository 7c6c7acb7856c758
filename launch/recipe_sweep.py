"""Choose the CPU study's recipe on development data, the way the reference chose its own: a one-time step.

    .venv/bin/python -m launch.recipe_sweep [--plan launch/plans/cpu-study.toml] [--lrs 1e-4 2e-4 4e-4]
        [--updates 16] [--schedules decay] [--global_batch_docs N] [--dev_seed_offset 200] [--out runs/recipe-sweep]
        [--record launch/recipe/cpu-sweep]

Each point trains the one-rank dense arm of PLAN with one learning rate (ds_configs/dense.json with the
optimizer's lr and the scheduler's warmup_max_lr set to it; --schedules "decay" keeps the ds_config's
scheduler, "constant" holds the rate after the same warm-up: DeepSpeed's WarmupLR) on a *development* seed:
the plan's data.seed and data.eval_seed plus --dev_seed_offset, so neither the training documents nor the
evaluation cases are the final study's (case IDs carry their seed: the final evaluation never sees a development case). It runs as
a one-arm exploratory study (python -m nshard.study --exploratory), which scores the seed model and the arm
on the development cases and retention documents. The seed's scores are made once and reused.

The rule, fixed before the first point ran: among the points whose retention-change upper bound is below
the plan's screen, the highest accuracy gain over the seed; a tie goes to the lower rate, then to the
schedule listed first. Every attempt,
failed ones included, goes into RECORD.json and RECORD.md (kept in the repository as evidence), with the
command, exit status and each point's figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


SCHEDULES = ("decay", "constant")


def point_name(lr: float, updates: int, schedule: str, global_batch: int | None = None) -> str:
    return (f"lr{lr:g}-u{updates}" + ("" if schedule == "decay" else f"-{schedule}")
            + ("" if global_batch is None else f"-b{global_batch}"))


def point_plan(base_text: str, study, lr: float, updates: int, offset: int, ds_config: Path,
               schedule: str = "decay", global_batch: int | None = None) -> str:
    """The plan text of one point: development seeds, the update count, and a [study] of one arm (one rank,
    dense, this lr) scored as the plan scores. The plan's own [study] (which must come last) is replaced."""
    text = base_text.split("\n[study]", 1)[0]
    if "[study" in text:
        raise SystemExit("recipe_sweep: the plan's [study] section must come after the others")
    data = re.search(r"(?ms)^\[data\]\n.*?(?=^\[)", text + "\n[")
    block = data[0]
    for key in ("seed", "eval_seed"):
        block = re.sub(rf"(?m)^({key} = )(\d+)", lambda m: f"{m[1]}{int(m[2]) + offset}", block, count=1)
    text = text[:data.start()] + block + text[data.end():]
    text = re.sub(r"(?m)^updates = \d+", f"updates = {updates}", text, count=1)
    if global_batch is not None:
        text, n = re.subn(r"(?m)^global_batch_docs = \d+", f"global_batch_docs = {global_batch}", text, count=1)
        if n != 1:
            raise SystemExit("recipe_sweep: error: --global_batch_docs needs a 'global_batch_docs = N' line in the plan")
    name = point_name(lr, updates, schedule, global_batch)
    text = re.sub(r'(?m)^name = "(.*)"', lambda m: f'name = "{m[1]}-dev-{name}"', text, count=1)
    return (text.rstrip() + f'\n\n[study]\ncandidate = "one-rank"\nspeed_baseline = "one-rank"\n'
            f"eval_max_new_tokens = {study.eval_max_new_tokens}\neval_batch_size = {study.eval_batch_size}\n"
            f'\n[[study.arms]]\nname = "one-rank"\nranks = 1\nds_config = "{ds_config}"\n')


def point_ds_config(base: dict, lr: float, schedule: str = "decay") -> dict:
    config = json.loads(json.dumps(base))
    config["optimizer"]["params"]["lr"] = lr
    if "scheduler" in config:
        params = config["scheduler"]["params"]
        params["warmup_max_lr"] = lr
        params["warmup_min_lr"] = lr / 10
        if schedule == "constant":  # the same warm-up, then the rate held (no decay to the end)
            config["scheduler"]["type"] = "WarmupLR"
            params.pop("total_num_steps", None)
    elif schedule != "decay":
        raise SystemExit(f"recipe_sweep: error: --schedules {schedule} needs a scheduler in the ds_config")
    return config


def run_point(lr: float, updates: int, args, plan, base_text: str, seed_eval: Path | None,
              schedule: str = "decay") -> dict:
    name = point_name(lr, updates, schedule, args.global_batch_docs)
    folder = Path(args.out) / name
    folder.mkdir(parents=True, exist_ok=True)
    ds_config = folder / "ds_config.json"
    ds_config.write_text(json.dumps(point_ds_config(json.loads((REPO / args.ds_config).read_text()), lr, schedule),
                                    indent=1))
    plan_path = folder / "plan.toml"
    plan_path.write_text(point_plan(base_text, plan.study, lr, updates, args.dev_seed_offset, ds_config.resolve(),
                                    schedule, args.global_batch_docs))
    study = folder / "study"
    if seed_eval is not None and not (study / "eval" / "seed").exists():  # the seed scored once, on the same cases
        shutil.copytree(seed_eval, study / "eval" / "seed")
    cmd = [sys.executable, "-m", "nshard.study", "--plan", str(plan_path), "--out", str(study), "--exploratory"]
    print(f"[sweep] {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with (folder / "log.txt").open("w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    point = {"point": name, "lr": lr, "updates": updates, "schedule": schedule,
             "global_batch_docs": args.global_batch_docs, "command": " ".join(cmd), "rc": rc,
             "wall_s": round(time.perf_counter() - t0, 1), "log": str(folder / "log.txt")}
    results = study / "results.json"
    if not results.is_file():
        return {**point, "status": "failed", "tail": (folder / "log.txt").read_text(errors="replace").splitlines()[-8:]}
    r = json.loads(results.read_text())
    arm = next(a for a in r["arms"] if a["name"] == "one-rank")
    if arm["status"] != "complete":
        return {**point, "status": "failed", "tail": (folder / "log.txt").read_text(errors="replace").splitlines()[-8:]}
    gain = next(c for c in r["screens"]["quality"]["conditions"] if c["name"].startswith("accuracy gain"))
    retention = arm["retention"] or {}
    return {**point, "status": "complete", "seed_correct": r["seed"]["correct"], "correct": arm["correct"],
            "cases": arm["cases"], "gain_points": gain["value"], "retention_upper_nats": retention.get("upper_nats"),
            "retention_mean_nats": retention.get("mean_change_nats"),
            "per_family": {f: b["correct"] for f, b in arm["per_family"].items()},
            "active_s": arm["execution"]["max_active_s"], "results_sha256": _sha256(results)}


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def choose(points: list[dict], max_retention: float, schedules=SCHEDULES) -> dict | None:
    """The rule declared in this module's docstring."""
    ok = [p for p in points if p["status"] == "complete" and p["retention_upper_nats"] is not None
          and p["retention_upper_nats"] < max_retention]
    order = list(schedules)
    return max(ok, key=lambda p: (p["gain_points"], -p["lr"], -order.index(p.get("schedule", "decay"))), default=None)


def write_record(record: Path, body: dict) -> None:
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(record.with_suffix(".json"))
    lines = [f"# CPU recipe sweep ({body['at']})", "", f"Base plan `{body['plan']}`, development seeds +"
             f"{body['dev_seed_offset']}, rule: {body['rule']}", "",
             "| point | status | seed correct | correct / cases | gain, points | retention upper, nats | active s |",
             "|---|---|---|---|---|---|---|"]
    for p in body["points"]:
        if p["status"] == "complete":
            lines.append(f"| {p['point']} | complete | {p['seed_correct']} | {p['correct']} / {p['cases']} | "
                         f"{p['gain_points']:+.2f} | {p['retention_upper_nats']:+.5f} | {p['active_s']:.1f} |")
        else:
            lines.append(f"| {p['point']} | failed (exit {p['rc']}) | | | | | |")
    chosen = body["chosen"]
    lines += ["", f"Chosen: `{chosen['point']}`" if chosen else "Chosen: none passed the retention bound", ""]
    tmp = record.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(record.with_suffix(".md"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", default="launch/plans/cpu-study.toml")
    parser.add_argument("--ds_config", default="ds_configs/dense.json", help="the one-rank arm's ds_config to vary")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 2e-4, 4e-4])
    parser.add_argument("--updates", type=int, nargs="+", default=[16])
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=["decay"],
                        help="decay: the ds_config's scheduler; constant: the same warm-up, then WarmupLR's held rate")
    parser.add_argument("--global_batch_docs", type=int, help="documents per update for every point (default: the plan's)")
    parser.add_argument("--dev_seed_offset", type=int, default=200)
    parser.add_argument("--out", default="runs/recipe-sweep")
    parser.add_argument("--record", default="launch/recipe/cpu-sweep", help="RECORD.json and RECORD.md are written")
    args = parser.parse_args(argv)
    if args.dev_seed_offset <= 0:
        parser.error("--dev_seed_offset must be positive: offset 0 is the final study's own data")
    from nshard.run.plan import load_plan

    plan = load_plan(REPO / args.plan)
    base_text = (REPO / args.plan).read_text()
    rule = (f"highest accuracy gain among points with retention upper bound < "
            f"{plan.screens.max_retention_upper_nats} nats; ties to the lower rate, then the schedule listed first "
            f"({', '.join(args.schedules)})")
    body = {"at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "plan": args.plan,
            "ds_config": args.ds_config, "schedules": args.schedules, "dev_seed_offset": args.dev_seed_offset,
            "rule": rule, "points": [],
            "chosen": None}
    for updates in args.updates:
        seed_eval = None  # the seed's scores are reused for points of one update count (one prepared identity)
        for lr, schedule in [(lr, schedule) for schedule in args.schedules for lr in args.lrs]:
            point = run_point(lr, updates, args, plan, base_text, seed_eval, schedule)
            body["points"].append(point)
            if point["status"] == "complete" and seed_eval is None:
                seed_eval = Path(args.out) / point["point"] / "study" / "eval" / "seed"
            body["chosen"] = choose(body["points"], plan.screens.max_retention_upper_nats, args.schedules)
            write_record(REPO / args.record, body)
            print(f"[sweep] {point['point']}: {point['status']}"
                  + (f", gain {point['gain_points']:+.2f} points, retention upper {point['retention_upper_nats']:+.5f}"
                     if point["status"] == "complete" else ""), flush=True)
    print(json.dumps({"chosen": body["chosen"] and body["chosen"]["point"], "record": args.record}))
    return 0 if body["chosen"] else 1


if __name__ == "__main__":
    sys.exit(main())
