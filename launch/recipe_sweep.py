"""Choose the CPU study's recipe on development data, the way the reference chose its own: a one-time step.

    .venv/bin/python -m launch.recipe_sweep [--plan launch/plans/cpu-study.toml] [--lrs 1e-4 2e-4 4e-4]
        [--updates 16] [--schedules decay] [--global_batch_docs N] [--cases_per_family N ...] [--dev_seed_offset 200]
        [--confirm_offset M] [--out runs/recipe-sweep] [--record launch/recipe/cpu-sweep]

Each point trains the one-rank dense arm of PLAN with one learning rate (ds_configs/dense.json with the
optimizer's lr and the scheduler's warmup_max_lr set to it; --schedules "decay" keeps the ds_config's
scheduler, "constant" holds the rate after the same warm-up: DeepSpeed's WarmupLR) on a *development* seed:
the plan's data.seed and data.eval_seed plus --dev_seed_offset, so neither the training documents nor the
evaluation cases are the final study's (case IDs carry their seed: the final evaluation never sees a development case). It runs as
a one-arm exploratory study (python -m nshard.study --exploratory), which scores the seed model and the arm
on the development cases and retention documents. The seed's scores are made once and reused.

The rule, fixed before the first point ran: among the points whose retention-change upper bound is below
the plan's screen, the highest accuracy gain over the seed; a tie goes to the point that trained fewer tokens
(the cheaper one), then to the lower rate, then to the schedule listed first. --confirm_offset then trains the
chosen point once more on a second development seed, recorded beside it (a recipe that passes on one data
seed only is not frozen). Points can vary the amount of distinct training data (--cases_per_family, one point
each; --global_batch_docs; --updates), and each records its sequence budget: the tokens it trained on and how
many distinct documents they came from. Every attempt,
failed ones included, goes into RECORD.json and RECORD.md (kept in the repository as evidence), with the
command, exit status and each point's figures.

--candidate_ds_config sweeps the candidate at one frozen recipe instead: each point trains the plan's candidate
arm (two ranks of PowerSGD, on this machine) with that ds_config, one --dense_warmups and one --powersgd_ranks
value, on the development seed of --control (the recipe's one-rank point there, whose seed scores it reuses), and
pairs its answers with the control's as the study pairs its arms. The rule, fixed before the first point: among
the points whose retention bound passes and whose paired lower bound against the control clears --margin (the
plan's screen unless a stricter one is declared) on every development seed, the least traffic (the fewest dense
warm-up updates, then the lowest rank). With --confirm_offset and --confirm_control, a point that passes on the
first seed trains again on the second and is paired with that seed's control; the points run in the rule's order
and the sweep stops at the first that passes on both.

    .venv/bin/python -m launch.recipe_sweep --lrs 2e-4 --updates 24 --global_batch_docs 16 --cases_per_family 48 \
        --dev_seed_offset 400 --candidate_ds_config ds_configs/cpu-powersgd.json --dense_warmups 5 7 \
        --margin -2 --control DEV400_POINT/study --confirm_offset 500 --confirm_control DEV500_POINT/study
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
from nshard.cli import SPELLING_NOTE, ArgumentParser
from nshard.files import write_text_atomic

REPO = Path(__file__).resolve().parent.parent


SCHEDULES = ("decay", "constant")


def point_name(lr: float, updates: int, schedule: str, global_batch: int | None = None,
               cases: int | None = None) -> str:
    return (f"lr{lr:g}-u{updates}" + ("" if schedule == "decay" else f"-{schedule}")
            + ("" if global_batch is None else f"-b{global_batch}") + ("" if cases is None else f"-c{cases}"))


def _set_key(text: str, key: str, value: int, flag: str) -> str:
    text, n = re.subn(rf"(?m)^{key} = \d+", f"{key} = {value}", text, count=1)
    if n != 1:
        raise SystemExit(f"recipe_sweep: error: {flag} needs a '{key} = N' line in the plan")
    return text


def point_plan(base_text: str, study, lr: float, updates: int, offset: int, ds_config: Path,
               schedule: str = "decay", global_batch: int | None = None, cases: int | None = None,
               arm: tuple[str, int] = ("one-rank", 1), suffix: str = "") -> str:
    """The plan text of one point: development seeds, the update count, and a [study] of one arm (by default one
    rank, dense, this lr; `arm` names another and its rank count) scored as the plan scores, on this machine.
    The plan's own [study] (which must come last) is replaced."""
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
        text = _set_key(text, "global_batch_docs", global_batch, "--global_batch_docs")
    if cases is not None:
        text = _set_key(text, "train_cases_per_family", cases, "--cases_per_family")
    name = point_name(lr, updates, schedule, global_batch, cases) + suffix
    text = re.sub(r'(?m)^name = "(.*)"', lambda m: f'name = "{m[1]}-dev-{name}"', text, count=1)
    return (text.rstrip() + f'\n\n[study]\ncandidate = "{arm[0]}"\nspeed_baseline = "{arm[0]}"\n'
            f"eval_max_new_tokens = {study.eval_max_new_tokens}\neval_batch_size = {study.eval_batch_size}\n"
            f'\n[[study.arms]]\nname = "{arm[0]}"\nranks = {arm[1]}\nds_config = "{ds_config}"\n')


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


def candidate_ds_config(base: dict, lr: float, schedule: str, warmups: int, rank: int) -> dict:
    """The candidate's ds_config at the frozen recipe's rate, with this many dense warm-up updates and this rank."""
    config = point_ds_config(base, lr, schedule)
    nshard = config.get("nshard") or {}
    if nshard.get("reducer") != "powersgd":
        raise SystemExit("recipe_sweep: error: --candidate_ds_config needs a ds_config whose nshard.reducer is powersgd")
    nshard["dense_warmup_updates"], nshard["rank"] = warmups, rank
    return config


def run_point(lr: float, updates: int, args, plan, base_text: str, seed_eval: Path | None,
              schedule: str = "decay", cases: int | None = None, offset: int | None = None,
              candidate: tuple[int, int] | None = None, control: Path | None = None) -> dict:
    """Train and score one point. With `candidate` (dense warm-up updates, rank) the point trains the plan's
    candidate arm (its rank count, on this machine) with --candidate_ds_config, and pairs its answers with
    `control`'s: a study folder of the recipe's one-rank arm on the same development seed."""
    offset = args.dev_seed_offset if offset is None else offset
    suffix = "" if candidate is None else f"-w{candidate[0]}-r{candidate[1]}"
    name = point_name(lr, updates, schedule, args.global_batch_docs, cases) + suffix
    folder = Path(args.out) / f"dev{offset}" / name
    folder.mkdir(parents=True, exist_ok=True)
    ds_config = folder / "ds_config.json"
    if candidate is None:
        arm = ("one-rank", 1)
        config = point_ds_config(json.loads((REPO / args.ds_config).read_text()), lr, schedule)
    else:
        spec = next(a for a in plan.study.arms if a.name == plan.study.candidate)
        arm = (spec.name, spec.ranks)
        config = candidate_ds_config(json.loads((REPO / args.candidate_ds_config).read_text()), lr, schedule,
                                     *candidate)
    ds_config.write_text(json.dumps(config, indent=1))
    plan_path = folder / "plan.toml"
    plan_path.write_text(point_plan(base_text, plan.study, lr, updates, offset, ds_config.resolve(),
                                    schedule, args.global_batch_docs, cases, arm, suffix))
    study = folder / "study"
    if seed_eval is not None and not (study / "eval" / "seed").exists():  # the seed scored once, on the same cases
        shutil.copytree(seed_eval, study / "eval" / "seed")
    cmd = [sys.executable, "-m", "nshard.study", "--plan", str(plan_path), "--out", str(study), "--exploratory"]
    print(f"[sweep] {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with (folder / "log.txt").open("w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    point = {"point": name, "lr": lr, "updates": updates, "schedule": schedule, "dev_seed_offset": offset,
             "global_batch_docs": args.global_batch_docs, "train_cases_per_family": cases, "command": " ".join(cmd), "rc": rc,
             "wall_s": round(time.perf_counter() - t0, 1), "log": str(folder / "log.txt")}
    if candidate is not None:
        point.update({"arm": arm[0], "ranks": arm[1], "dense_warmup_updates": candidate[0],
                      "powersgd_rank": candidate[1], "control": str(control)})
    results = study / "results.json"
    if not results.is_file():
        return {**point, "status": "failed", "tail": (folder / "log.txt").read_text(errors="replace").splitlines()[-8:]}
    r = json.loads(results.read_text())
    result = next(a for a in r["arms"] if a["name"] == arm[0])
    if result["status"] != "complete":
        return {**point, "status": "failed", "tail": (folder / "log.txt").read_text(errors="replace").splitlines()[-8:]}
    gain = next(c for c in r["screens"]["quality"]["conditions"] if c["name"].startswith("accuracy gain"))
    retention = result["retention"] or {}
    point = {**point, "status": "complete", "seed_correct": r["seed"]["correct"], "correct": result["correct"],
             "cases": result["cases"], "gain_points": gain["value"], "retention_upper_nats": retention.get("upper_nats"),
             "retention_mean_nats": retention.get("mean_change_nats"),
             "per_family": {f: b["correct"] for f, b in result["per_family"].items()},
             "active_s": result["execution"]["max_active_s"], "train_tokens": train_tokens(study / "arms" / arm[0]),
             "precision": _precision(study / "arms" / arm[0]), "results_sha256": _sha256(results)}
    if candidate is not None:
        point["paired"] = paired_with_control(study / "eval" / arm[0] / "cases.jsonl", control,
                                              plan.screens.confidence)
    return point


def stale_scores(control: Path) -> str | None:
    """Why the control's scores can't be paired with a point scored here, or None: the seed and the control's arm
    must have been scored where and as its arm is scored now (bf16 on a CPU with bf16 units, else fp32), or the
    study's validation refuses the copied seed scores after the point has trained."""
    from nshard.study.evaluate import run_placement

    arm = json.loads((control / "results.json").read_text())["candidate"]
    placement = run_placement(control / "arms" / arm)
    for label in ("seed", arm):
        summary = control / "eval" / label / "summary.json"
        if not summary.is_file():
            return f"{summary} is missing: run the control's study again"
        scored = json.loads(summary.read_text())
        if (scored.get("device"), scored.get("dtype")) != (placement.device, placement.dtype):
            return (f"{label} was scored on {scored.get('device')} in {scored.get('dtype')}, but its arm is scored on "
                    f"{placement.device} in {placement.dtype} here: move {control / 'eval'} aside and run the "
                    "control's study again (its trained arm is reused)")
    return None


def paired_with_control(cases: Path, control: Path, confidence: float) -> dict:
    """The candidate's paired bound against the control study's arm (its candidate) on the same cases."""
    from nshard.analysis.paired import paired_bounds, read_correct

    name = json.loads((control / "results.json").read_text())["candidate"]
    return {"control_arm": name, **paired_bounds(read_correct(cases), read_correct(control / "eval" / name / "cases.jsonl"),
                                                 confidence)}


def train_tokens(run_dir: Path) -> dict:
    """The point's sequence budget, from the files it trained on: tokens (and response tokens) over all updates,
    and how many distinct documents it saw."""
    docs = [json.loads(line) for line in (run_dir / "prepared" / "documents.jsonl").read_text().splitlines() if line]
    schedule = json.loads((run_dir / "prepared" / "schedule.json").read_text())
    batches = schedule["updates"] if isinstance(schedule, dict) else schedule
    seen = [i for batch in batches for i in batch]
    return {"tokens": sum(len(docs[i]["input_ids"]) for i in seen),
            "response_tokens": sum(sum(1 for w in docs[i]["weights"] if w) for i in seen),
            "distinct_documents": len(set(seen)), "documents": len(docs)}


def _precision(run_dir: Path) -> str | None:
    receipt = json.loads((run_dir / "receipts" / "rank-0.json").read_text())
    return (receipt.get("precision") or {}).get("compute")


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def choose(points: list[dict], max_retention: float, schedules=SCHEDULES) -> dict | None:
    """The rule declared in this module's docstring."""
    ok = [p for p in points if p["status"] == "complete" and p["retention_upper_nats"] is not None
          and p["retention_upper_nats"] < max_retention]
    order = list(schedules)
    return max(ok, key=lambda p: (p["gain_points"], -(p.get("train_tokens") or {}).get("tokens", 0), -p["lr"],
                                  -order.index(p.get("schedule", "decay"))), default=None)


def lost_cases(paired: dict) -> int:
    """Cases the control answers right and the candidate wrong (the discordant pairs the candidate loses)."""
    return (paired["discordant"] - (paired["candidate_correct"] - paired["control_correct"])) // 2


def choose_candidate(points: list[dict], max_retention: float, min_paired: float,
                     offsets: tuple[int, ...] | None = None, max_lost: int | None = None) -> dict | None:
    """The candidate sweep's rule: among the points whose retention upper bound is below the screen and whose
    paired lower bound against the control is above the margin, the least traffic: the fewest dense warm-up
    updates, then the lowest rank. With OFFSETS, a point counts only if it ran and passed on every one of those
    development seeds (its runs are the entries of POINTS with the same name); the entry on the first is returned.
    With MAX_LOST, a run also loses at most that many of the control's correct answers."""
    def passes(p):
        return (p["status"] == "complete" and p["retention_upper_nats"] is not None
                and p["retention_upper_nats"] < max_retention and p["paired"]["lower_points"] > min_paired
                and (max_lost is None or lost_cases(p["paired"]) <= max_lost))

    runs: dict[str, list[dict]] = {}
    for p in points:
        runs.setdefault(p["point"], []).append(p)
    ok = []
    for name, group in runs.items():
        if not all(passes(p) for p in group):
            continue
        if offsets is not None and {p.get("dev_seed_offset") for p in group} != set(offsets):
            continue
        ok.append(group[0])
    return min(ok, key=lambda p: (p["dense_warmup_updates"], p["powersgd_rank"]), default=None)


def write_record(record: Path, body: dict) -> None:
    record.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(record.with_suffix(".json"), json.dumps(body, indent=1) + "\n")
    lines = [f"# CPU recipe sweep ({body['at']})", "", f"Base plan `{body['plan']}`, development seeds +"
             f"{body['dev_seed_offset']}, rule: {body['rule']}", "",
             "| point | status | seed correct | correct / cases | gain, points | retention upper, nats | active s "
             "| trained tokens (distinct docs) | precision |" + (" paired vs control (discordant, lost), 99% interval |"
                                                                  if body.get("candidate_ds_config") else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if body.get("candidate_ds_config") else "")]
    def label(p):  # a candidate sweep's points run on every development seed, one row each
        return f"{p['point']} (+{p['dev_seed_offset']})" if body.get("candidate_ds_config") else p["point"]

    for p in body["points"]:
        if p["status"] == "complete":
            tokens = p.get("train_tokens") or {}
            paired = p.get("paired")
            lines.append(f"| {label(p)} | complete | {p['seed_correct']} | {p['correct']} / {p['cases']} | "
                         f"{p['gain_points']:+.2f} | {p['retention_upper_nats']:+.5f} | {p['active_s']:.1f} | "
                         f"{tokens.get('tokens', '')} ({tokens.get('distinct_documents', '')}) | "
                         f"{p.get('precision') or ''} |"
                         + (f" {paired['difference_points']:+.2f} ({paired['discordant']}, {lost_cases(paired)} lost), "
                            f"[{paired['lower_points']:+.2f}, {paired['upper_points']:+.2f}] |" if paired else ""))
        else:
            lines.append(f"| {label(p)} | failed (exit {p['rc']}) | | | | | | | |"
                         + (" |" if body.get("candidate_ds_config") else ""))
    chosen = body["chosen"]
    lines += ["", f"Chosen: `{chosen['point']}`" if chosen else
              ("Chosen: none passed on every development seed" if body.get("candidate_ds_config")
               else "Chosen: none passed the retention bound"), ""]
    confirm = body.get("confirmation")
    if confirm and not body.get("candidate_ds_config"):
        paired = confirm.get("paired")
        lines += [f"Second development seed (+{confirm['dev_seed_offset']}): `{confirm['point']}` "
                  + (f"{confirm['correct']} / {confirm['cases']}, gain {confirm['gain_points']:+.2f} points, retention "
                     f"upper {confirm['retention_upper_nats']:+.5f} nats" if confirm["status"] == "complete"
                     else f"failed (exit {confirm['rc']})")
                  + (f", paired vs control {paired['difference_points']:+.2f} points ({paired['discordant']} "
                     f"discordant), 99% interval [{paired['lower_points']:+.2f}, {paired['upper_points']:+.2f}]"
                     if paired else ""), ""]
    write_text_atomic(record.with_suffix(".md"), "\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes each point's study under --out, and the record: RECORD.json and RECORD.md (--record). "
              + SPELLING_NOTE)
    parser = ArgumentParser(description=__doc__, epilog=epilog)
    parser.add_argument("--plan", default="launch/plans/cpu-study.toml")
    parser.add_argument("--ds_config", default="ds_configs/dense.json", help="the one-rank arm's ds_config to vary")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 2e-4, 4e-4])
    parser.add_argument("--updates", type=int, nargs="+", default=[16])
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=["decay"],
                        help="decay: the ds_config's scheduler; constant: the same warm-up, then WarmupLR's held rate")
    parser.add_argument("--global_batch_docs", type=int, help="documents per update for every point (default: the plan's)")
    parser.add_argument("--cases_per_family", type=int, nargs="+",
                        help="distinct training cases per family, one point each (default: the plan's)")
    parser.add_argument("--confirm_offset", type=int,
                        help="after choosing, train the chosen point again on this second development seed offset "
                             "and record it (the recipe must pass on both)")
    parser.add_argument("--candidate_ds_config",
                        help="sweep the candidate instead of the recipe: each point trains the plan's candidate arm "
                             "with this ds_config (nshard.reducer powersgd) at the one recipe given by --lrs, --updates, "
                             "--schedules and --cases_per_family, varying --dense_warmups and --powersgd_ranks, and "
                             "pairs it with --control")
    parser.add_argument("--dense_warmups", type=int, nargs="+", help="dense warm-up updates, one point each")
    parser.add_argument("--powersgd_ranks", type=int, nargs="+", help="PowerSGD ranks, one point each")
    parser.add_argument("--control", type=Path,
                        help="with --candidate_ds_config: the study folder of the recipe's one-rank point on "
                             "--dev_seed_offset (a sweep point's STUDY folder); its seed scores are reused")
    parser.add_argument("--confirm_control", type=Path, help="the control's study folder on --confirm_offset")
    parser.add_argument("--max_lost", type=int,
                        help="with --candidate_ds_config: a point also loses at most this many of the control's correct "
                             "answers on every development seed")
    parser.add_argument("--margin", type=float,
                        help="with --candidate_ds_config: the paired lower bound a point must clear on every "
                             "development seed, in points (default: the plan's screen; never below it)")
    parser.add_argument("--dev_seed_offset", type=int, default=200)
    parser.add_argument("--out", default="runs/recipe-sweep")
    parser.add_argument("--record", default="launch/recipe/cpu-sweep", help="RECORD.json and RECORD.md are written")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dev_seed_offset <= 0:
        parser.error("--dev_seed_offset must be positive: offset 0 is the final study's own data")
    from nshard.run.plan import load_plan

    plan = load_plan(REPO / args.plan)
    base_text = (REPO / args.plan).read_text()
    rule = (f"highest accuracy gain among points with retention upper bound < "
            f"{plan.screens.max_retention_upper_nats} nats; ties to the point that trained fewer tokens, then the lower "
            f"rate, then the schedule listed first ({', '.join(args.schedules)})")
    body = {"at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "plan": args.plan,
            "ds_config": args.ds_config, "schedules": args.schedules, "dev_seed_offset": args.dev_seed_offset,
            "rule": rule, "points": [],
            "chosen": None}
    if args.confirm_offset is not None and args.confirm_offset in (0, args.dev_seed_offset):
        parser.error("--confirm_offset must be a second development offset: neither 0 nor --dev_seed_offset")
    body["confirm_offset"] = args.confirm_offset
    body["confirmation"] = None
    if args.candidate_ds_config:
        return sweep_candidate(args, parser, plan, base_text, body)
    seed_evals: dict = {}  # the seed's scores, reused across points of one prepared identity (all but the rate)

    def one(lr, updates, schedule, cases, offset=None):
        key = (offset, updates, cases)
        point = run_point(lr, updates, args, plan, base_text, seed_evals.get(key), schedule, cases, offset)
        if point["status"] == "complete" and key not in seed_evals:
            seed_evals[key] = Path(point["log"]).parent / "study" / "eval" / "seed"
        print(f"[sweep] {point['point']} (dev +{point['dev_seed_offset']}): {point['status']}"
              + (f", gain {point['gain_points']:+.2f} points, retention upper {point['retention_upper_nats']:+.5f}"
                 if point["status"] == "complete" else ""), flush=True)
        return point

    for updates in args.updates:
        for cases in args.cases_per_family or [None]:
            for lr, schedule in [(lr, schedule) for schedule in args.schedules for lr in args.lrs]:
                body["points"].append(one(lr, updates, schedule, cases))
                body["chosen"] = choose(body["points"], plan.screens.max_retention_upper_nats, args.schedules)
                write_record(REPO / args.record, body)
    chosen = body["chosen"]
    if chosen and args.confirm_offset is not None:
        body["confirmation"] = one(chosen["lr"], chosen["updates"], chosen["schedule"],
                                   chosen.get("train_cases_per_family"), args.confirm_offset)
        write_record(REPO / args.record, body)
    print(json.dumps({"chosen": chosen and chosen["point"], "record": args.record,
                      "confirmation_gain": (body["confirmation"] or {}).get("gain_points")}))
    return 0 if chosen else 1


def sweep_candidate(args, parser, plan, base_text: str, body: dict) -> int:
    """--candidate_ds_config: the candidate's dense warm-up and rank at one frozen recipe (choose_candidate)."""
    recipe = [args.lrs, args.updates, args.schedules, args.cases_per_family or [None]]
    if any(len(values) != 1 for values in recipe):
        parser.error("--candidate_ds_config sweeps the candidate at one recipe: give one --lrs, --updates, "
                     "--schedules and --cases_per_family")
    lr, updates, schedule, cases = (values[0] for values in recipe)
    margin = plan.screens.min_paired_lower_points if args.margin is None else args.margin
    if margin < plan.screens.min_paired_lower_points:
        parser.error(f"--margin {margin}: below the plan's screen ({plan.screens.min_paired_lower_points} points), so "
                     "it could choose a point the screen fails; give a margin at or above it")
    for flag, folder in (("--control", args.control), ("--confirm_control", args.confirm_control)):
        if folder is not None and not (folder / "results.json").is_file():
            parser.error(f"{flag} {folder}: no results.json; give the STUDY folder of a finished recipe point")
        stale = folder is not None and stale_scores(folder)
        if stale:
            parser.error(f"{flag} {folder}: {stale}")
    if args.control is None or (args.confirm_offset is not None and args.confirm_control is None):
        parser.error("--candidate_ds_config needs --control (and --confirm_control with --confirm_offset)")
    base = json.loads((REPO / args.candidate_ds_config).read_text())["nshard"]
    warmups = args.dense_warmups or [base.get("dense_warmup_updates", 0)]
    ranks = args.powersgd_ranks or [base["rank"]]
    offsets = (args.dev_seed_offset,) if args.confirm_offset is None else (args.dev_seed_offset, args.confirm_offset)
    seeds = " and ".join(f"+{o}" for o in offsets)
    body.update({"candidate_ds_config": args.candidate_ds_config, "control": str(args.control),
                 "confirm_control": args.confirm_control and str(args.confirm_control), "margin_points": margin,
                 "max_lost": args.max_lost,
                 "rule": (f"the fewest dense warm-up updates, then the lowest rank, among points with retention upper "
                          f"bound < {plan.screens.max_retention_upper_nats} nats and a paired {plan.screens.confidence:.0%}"
                          f" lower bound against the control > {margin} points"
                          + ("" if args.max_lost is None else f" and at most {args.max_lost} of the control's correct "
                             "answers lost") + f" on every development seed ({seeds}); "
                          f"the points run in that order and the sweep stops at the first that passes")})

    def one(candidate, offset, control):
        point = run_point(lr, updates, args, plan, base_text, control / "eval" / "seed", schedule, cases, offset,
                          candidate, control)
        print(f"[sweep] {point['point']} (dev +{point['dev_seed_offset']}): {point['status']}"
              + (f", gain {point['gain_points']:+.2f} points, paired lower {point['paired']['lower_points']:+.2f}"
                 if point["status"] == "complete" else ""), flush=True)
        return point

    def pick():
        return choose_candidate(body["points"], plan.screens.max_retention_upper_nats, margin, offsets, args.max_lost)

    def passed(point):
        return choose_candidate([point], plan.screens.max_retention_upper_nats, margin, max_lost=args.max_lost) is not None

    # The rule's own order: the first point that passes on every seed is the one it chooses from the whole list.
    for warmup, rank in sorted((w, r) for w in warmups for r in ranks):
        point = one((warmup, rank), args.dev_seed_offset, args.control)
        body["points"].append(point)
        if passed(point) and args.confirm_offset is not None:
            write_record(REPO / args.record, body)
            body["points"].append(one((warmup, rank), args.confirm_offset, args.confirm_control))
        body["chosen"] = pick()
        if body["chosen"] and args.confirm_offset is not None:
            body["confirmation"] = body["points"][-1]
        write_record(REPO / args.record, body)
        if body["chosen"]:
            break
    chosen = body["chosen"]
    print(json.dumps({"chosen": chosen and chosen["point"], "record": args.record,
                      "confirmation_paired_lower": ((body["confirmation"] or {}).get("paired") or {}).get("lower_points")}))
    return 0 if chosen else 1


if __name__ == "__main__":
    sys.exit(main())
