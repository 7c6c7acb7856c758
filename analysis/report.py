"""A study's results: accuracy per family, paired bounds against each control, retention, the declared
quality and speed screens, the report tables and the plots. Reads the study directory's files only.

    python -m nshard.analysis.report STUDY_DIR

Reads STUDY_DIR/study.json (the arms, the declared screens, what the runner saw), the arms' run
directories (run.json, receipts, metrics.jsonl), STUDY_DIR/commitment.json (and anchor.json, where the study
anchored it in a store), STUDY_DIR/eval/*/ and STUDY_DIR/validation.json (a study whose validation did not pass,
or whose scores differ from the ones it validated, is refused, naming the evaluation and case), and hashes again the model files the commitment names: a score
counts only if the record names exactly those files under exactly that label (nshard.evidence.commit's checks,
which need no torch).
Writes STUDY_DIR/results.json, STUDY_DIR/report.md and STUDY_DIR/plots/*.png; prints the main table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from fractions import Fraction
from pathlib import Path

from nshard.analysis.growth import growth_table, read_serving
from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
from nshard.analysis.paired import PairingError, cases_for_one_loss, declared_power, mean_interval, paired_bounds
from nshard.analysis.validated import NotValidated, check_validated
from nshard.evidence.commit import CommitError, check_committed_as, files_sha256, load_commitment, model_files
from nshard.files import atomic_file, write_text_atomic

FAMILY_TITLES = {"lookup": "Lookup", "filtering": "Filtering", "sorting": "Sorting", "invoice": "Invoice totals",
                 "cheapest": "Cheapest item", "acronym": "Acronym", "chat": "Own held-out rows, exact match"}


class StudyError(ValueError):
    """A study directory the analysis cannot read; the message names the file."""


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise StudyError(f"{path} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise StudyError(f"{path}: not valid JSON ({exc})") from None


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise StudyError(f"{path} is missing")
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise StudyError(f"{path}:{lineno}: not valid JSON ({exc})") from None
    return rows


# ---------------------------------------------------------------- commit-before-score


def check_scores(study_dir: Path, study: dict, record: dict) -> list[str]:
    """Every score file against the study's record. A score under a label the record does not give exactly
    that model's files, or a committed model whose files or parameter root changed since, is a StudyError
    naming the file; scores made without the record (exploratory) are returned as reasons that make the
    whole result exploratory."""
    entries = {e["name"]: e for e in [record["seed"], *record["candidates"]]}
    reasons = []
    complete = [a for a in study["arms"] if a["status"] == "complete"]
    for label in ["seed", *(a["name"] for a in complete)]:
        path = study_dir / "eval" / label / "summary.json"
        summary = read_json(path)
        names = ["cases.jsonl", "retention.jsonl"] + (["heldout.jsonl"] if (path.parent / "heldout.jsonl").is_file() else [])
        rows = [r for name in names for r in read_jsonl(path.parent / name)]
        if summary.get("exploratory") or summary.get("commitment") is None or any(r.get("exploratory") for r in rows):
            reasons.append(f"{path.parent} was scored without the commitment (exploratory)")
            continue
        if summary["commitment"] != record["record_sha256"]:
            raise StudyError(f"{path}: scored under commitment {str(summary['commitment'])[:16]}, not this study's "
                             f"{record['record_sha256'][:16]}; score it again under this study's record")
        try:
            check_committed_as(record, label, summary.get("model_files"))
            if summary.get("committed_as") != label:
                raise CommitError(f"{label}: the summary says committed_as={summary.get('committed_as')!r}")
            check_committed_as(record, label, model_files(Path(entries[label]["model_dir"])))
        except CommitError as exc:
            raise StudyError(f"{path}: {exc}") from None
    for arm in complete:
        run = read_json(Path(arm["run_dir"]) / "run.json")
        if run["parameter_root"] != entries[arm["name"]]["parameter_root"]:
            raise StudyError(f"{arm['run_dir']}/run.json: parameter root {run['parameter_root'][:16]} is not the "
                             f"one commitment {record['record_sha256'][:16]} records for {arm['name']}")
    return reasons


def read_anchor(study_dir: Path, record: dict | None) -> dict | None:
    """anchor.json, written by the runner once the record was pushed to the plan's store; it must name this record."""
    path = study_dir / "anchor.json"
    if record is None or not path.is_file():
        return None
    anchor = read_json(path)
    if anchor.get("record_sha256") != record["record_sha256"]:
        raise StudyError(f"{path} anchors record {str(anchor.get('record_sha256'))[:16]}, not commitment.json's "
                         f"{record['record_sha256'][:16]}; it belongs to another commitment: move it aside")
    return anchor


# ---------------------------------------------------------------- learning


def accuracy_block(rows: list[dict], confidence: float) -> dict:
    """Correct, cases and accuracy in total and per family, each with its normal-approximation interval."""
    def block(flags):
        n, k = len(flags), sum(flags)
        lo, hi = (mean_interval([float(f) for f in flags], confidence)[1:] if n > 1 else (math.nan, math.nan))
        return {"correct": k, "cases": n, "accuracy": k / n if n else math.nan, "lower": lo, "upper": hi}

    families = sorted({r["family"] for r in rows}, key=lambda f: list(FAMILY_TITLES).index(f)
                      if f in FAMILY_TITLES else len(FAMILY_TITLES))
    return {**block([bool(r["correct"]) for r in rows]),
            "per_family": {f: block([bool(r["correct"]) for r in rows if r["family"] == f]) for f in families}}


def retention_changes(path: Path, rows: list[dict], seed_rows: list[dict]) -> list[float]:
    """Each document's change, recomputed from the model's and the seed's losses (the stored change must agree)."""
    seed = {r["doc_id"]: r["nll_sum"] for r in seed_rows}
    changes = []
    for row in rows:
        if row.get("doc_id") not in seed:
            raise StudyError(f"{path}: retention document {row.get('doc_id')!r} has no seed loss in eval/seed")
        change = (row["nll_sum"] - seed[row["doc_id"]]) / row["target_weight"]
        stored = row.get("change_nats_per_token")
        if stored is None or not math.isclose(stored, change, rel_tol=1e-9, abs_tol=1e-12):
            raise StudyError(f"{path}: retention {row['doc_id']}: the stored change {stored} is not the one its "
                             f"losses give ({change}); score the model again")
        changes.append(change)
    return changes


def retention_block(changes: list[float], confidence: float) -> dict | None:
    if len(changes) < 2:
        return None
    mean, lower, upper = mean_interval(changes, confidence)
    return {"docs": len(changes), "mean_change_nats": mean, "lower_nats": lower, "upper_nats": upper}


def heldout_retention_block(study_dir: Path, label: str, confidence: float) -> dict | None:
    """The held-out retention documents' changes (eval/<label>/retention_heldout.jsonl against the seed's), as the
    exposed retention block; None where the study has none (data.heldout_retention_docs = 0, or an older study)."""
    path = study_dir / "eval" / label / "retention_heldout.jsonl"
    seed_path = study_dir / "eval" / "seed" / "retention_heldout.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    if not rows:
        return None
    block = retention_block(retention_changes(path, rows, read_jsonl(seed_path) if seed_path.is_file() else []),
                            confidence)
    return block and {**block, "held_out": True}


def heldout_block(path: Path) -> dict | None:
    """An evaluation's own held-out rows (heldout.jsonl), recounted: loss per response token over all of them (sum of
    weight x NLL / total target weight, as in training) and each row's own, for pairing; None without held-out rows."""
    rows = read_jsonl(path) if path.is_file() else []
    if not rows:
        return None
    nll, weight = math.fsum(r["nll_sum"] for r in rows), math.fsum(r["target_weight"] for r in rows)
    return {"docs": len(rows), "loss_per_token": nll / weight,
            "per_doc": {r["doc_id"]: r["nll_sum"] / r["target_weight"] for r in rows}}


def heldout_pair(candidate: dict, control: dict, name: str, confidence: float) -> dict:
    """Candidate minus control, per held-out row, in nats per response token, with its confidence interval."""
    if set(candidate["per_doc"]) != set(control["per_doc"]):
        raise StudyError(f"eval/{name}/heldout.jsonl holds other held-out rows than the candidate's; score both on "
                         "the same run's sets")
    diffs = [candidate["per_doc"][i] - control["per_doc"][i] for i in sorted(candidate["per_doc"])]
    mean, lower, upper = mean_interval(diffs, confidence) if len(diffs) > 1 else (math.fsum(diffs), None, None)
    return {"control": name, "docs": len(diffs), "mean_nats": mean, "lower_nats": lower, "upper_nats": upper}


# ---------------------------------------------------------------- execution


def execution_block(run_dir: Path, ranks: int, usd_per_gb: float, launch: dict | None = None) -> dict:
    """Receipts of one arm: slowest-rank times, ranks x complete-process seconds, bytes and their price; with the
    study's record of its launch (`launch`: launcher_started_at/ended_at), the launch before the first rank process
    and the teardown after the last receipt. The complete process group time is the last process group's (its
    slowest rank's process seconds) plus every failed attempt's launcher wall seconds with the same inputs
    (`launch`'s failed_attempts_s, from nshard/study/runner.py): a recovered arm counts what its failure cost."""
    launch = launch or {}
    receipts = [read_json(p) for p in sorted((run_dir / "receipts").glob("rank-*.json"))]
    if len(receipts) != ranks:
        raise StudyError(f"{run_dir}/receipts holds {len(receipts)} receipts for {ranks} ranks")
    gpu = any("peak_allocated_bytes" in r for r in receipts)
    final_process_s = max(r["process_s"] for r in receipts)
    failed_s = launch.get("failed_attempts_s") or 0.0
    process_s = final_process_s + failed_s
    # A world of one sends nothing, though DeepSpeed still logs (and counts) its all-reduce calls.
    sent = 0 if ranks == 1 else sum(r["grad_collective_bytes"] + r["other_collective_bytes"] for r in receipts)
    phases = {}
    for phase in ("dense", "compressed"):
        timed = [r for r in receipts if r["by_phase"][phase]["updates"]]
        slowest = max(timed, key=lambda r: r["by_phase"][phase]["median_update_s"]) if timed else None
        phases[phase] = {"updates": max((r["by_phase"][phase]["updates"] for r in receipts), default=0),
                         "median_update_s": slowest["by_phase"][phase]["median_update_s"] if slowest else None,
                         # where the slowest rank's median update went (receipts without phases: None)
                         "median_phase_s": slowest["by_phase"][phase].get("median_phase_s") if slowest else None}
    per_update = [0 if ranks == 1 else sum(r["update_grad_bytes"][u] for r in receipts)
                  for u in range(len(receipts[0]["update_grad_bytes"]))]
    # On real or emulated hosts the receipts also carry the kernel's count of what crossed the link.
    kernel = [(r.get("link") or {}).get("kernel_tx_bytes") for r in receipts]
    startups = [r["startup"] for r in receipts if r.get("startup")]
    starts = [r["process_start_at"] for r in receipts if "process_start_at" in r]
    ends = [r["process_start_at"] + r["process_s"] for r in receipts if "process_start_at" in r]
    began, ended = launch.get("launcher_started_at"), launch.get("launcher_ended_at")
    return {"device": "GPU" if gpu else "CPU", "ranks": ranks,
            "precision": receipts[0].get("precision"),
            "optimizer": optimizer_of(receipts),
            "reduction_start": reduction_start_of(receipts),
            "startup_s": max((u["s"] for u in startups), default=None),
            "one_time_work": sorted({w for u in startups for w in u["one_time_work"]}) if startups else None,
            "launch_s": min(starts) - began if starts and began is not None else None,
            "teardown_s": ended - max(ends) if ends and ended is not None else None,
            "kernel_tx_bytes": sum(kernel) if ranks > 1 and None not in kernel else None,
            "max_active_s": max(r["active_s"] for r in receipts),
            "max_active_plus_checkpoint_s": max(r["active_plus_checkpoint_s"] for r in receipts),
            "complete_process_s": process_s, "device_seconds": ranks * process_s,
            "final_process_s": final_process_s, "failed_attempts": launch.get("failed_attempts") or 0,
            "failed_attempts_s": failed_s, "recovery": recovery_summary(launch.get("recovery") or []),
            "sent_bytes": sent, "network_usd": sent / 1e9 * usd_per_gb, "phases": phases,
            "update_bytes": per_update,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in receipts),
            "peak_allocated_bytes": max((r["peak_allocated_bytes"] for r in receipts if "peak_allocated_bytes" in r),
                                        default=None),
            "throughput": throughput_block(receipts)}


def derived_execution(spec: dict, study: dict, screens: dict) -> dict:
    """An interpolated arm's execution and metrics: its trained arm's (that training made it), the interpolation's
    seconds added to the complete process, so a speed screen counts what the arm cost."""
    source = next(a for a in study["arms"] if a["name"] == spec["interpolated"]["from"])
    run_dir = Path(source["run_dir"])
    block = execution_block(run_dir, source["ranks"], screens["network_usd_per_gb"], source)
    extra = spec["interpolated"]["seconds"]
    block.update(complete_process_s=block["complete_process_s"] + extra,
                 device_seconds=block["device_seconds"] + extra, derived_from=source["name"], derived_s=extra)
    return {"execution": block, "metrics": read_jsonl(run_dir / "metrics.jsonl")}


def recovery_summary(recovery: list[dict]) -> list[dict]:
    """Each resume of the arm (nshard/study/runner.py's recovery records): the update it resumed from, the updates
    the failed attempt before it finished beyond that state and so redid, and the seconds lost, the failed
    attempt's wall seconds after that state was written (None where the study did not record the attempt)."""
    keys = ("resumed_from_update", "updates_reached", "updates_redone", "seconds_lost", "failed_wall_s", "failed_log")
    return [{k: r.get(k) for k in keys} for r in recovery]


def throughput_block(receipts: list[dict]) -> dict | None:
    """The slowest rank's whole-run throughput (every rank trains the same tokens; the slowest sets the pace), with
    the FLOP count and the peak its MFU divides by; None for receipts written before nshard recorded it."""
    runs = [r["throughput"] for r in receipts if (r.get("throughput") or {}).get("run")]
    if len(runs) != len(receipts):
        return None
    slowest = max(runs, key=lambda t: t["run"]["update_s"])
    return {**slowest["run"], "flops_count": slowest["flops_count"], "peak": slowest["peak"],
            "devices": slowest["devices"]}


# ---------------------------------------------------------------- screens


def condition(name: str, value, threshold, op: str) -> dict:
    """One screen condition. A Fraction value (counts) is compared exactly with the threshold as declared
    (its decimal text, so 10 points means 10, not the binary double nearest 100 * 0.1)."""
    if isinstance(value, Fraction):
        threshold_exact = Fraction(repr(float(threshold)))
        ok = {">=": value >= threshold_exact, ">": value > threshold_exact, "<": value < threshold_exact}[op]
        value = float(value)
    else:
        ok = value is not None and not (isinstance(value, float) and math.isnan(value)) and {
            ">=": lambda: value >= threshold, ">": lambda: value > threshold, "<": lambda: value < threshold}[op]()
    return {"name": name, "value": value, "threshold": threshold, "rule": f"{op} {threshold}", "passed": bool(ok)}


def gain_points(candidate: dict, seed: dict) -> Fraction:
    """Accuracy gain in points from the integer counts: 100*(k1/n1 - k0/n0), exactly."""
    return Fraction(100 * candidate["correct"], candidate["cases"]) - Fraction(100 * seed["correct"], seed["cases"])


def quality_screen(candidate: dict, seed: dict, comparisons: list[dict], failed_controls: list[str],
                   screens: dict, heldout_pairs: list[dict] = ()) -> dict:
    """Accuracy gain, retention and paired bounds on the cases (task cases and own rows with an expected answer);
    with an own held-out split, also its loss gain over the seed and a paired bound on it against every control.
    Without any case (own data whose rows carry no expected answer) the held-out conditions stand in for the
    accuracy ones."""
    if candidate["status"] != "complete":
        return {"passed": False, "conditions": [{"name": "candidate trained", "passed": False,
                                                 "value": candidate["status"], "rule": "complete"}]}
    retention = candidate.get("retention") or {}
    conf = f"{screens['confidence']:.0%}"
    conds = [condition("accuracy gain over seed, points", gain_points(candidate, seed),
                       screens["min_accuracy_gain_points"], ">=")] if seed["cases"] else []
    conds.append(condition(f"retention-change {conf} upper bound, nats", retention.get("upper_nats"),
                           screens["max_retention_upper_nats"], "<"))
    for c in comparisons:
        conds.append(condition(f"paired {conf} lower bound vs {c['control']}, points",
                               c["lower_points"], screens["min_paired_lower_points"], ">"))
    if seed.get("heldout"):
        gain = seed["heldout"]["loss_per_token"] - (candidate.get("heldout") or {}).get("loss_per_token", math.nan)
        conds.append(condition("held-out loss gain over seed, nats per response token", gain,
                               screens["min_heldout_gain_nats"], ">"))
    for c in heldout_pairs:
        conds.append(condition(f"held-out paired {conf} upper bound vs {c['control']}, nats per response token",
                               c["upper_nats"], screens["max_heldout_paired_upper_nats"], "<"))
    for name in failed_controls:
        conds.append({"name": f"paired lower bound vs {name}", "value": None, "passed": False,
                      "rule": "control arm must finish"})
    if not comparisons and not heldout_pairs and not failed_controls:  # noninferiority against nothing is not a pass
        conds.append({"name": "paired lower bound vs a control", "value": None, "passed": False,
                      "rule": "the study must declare at least one control arm"})
    return {"passed": all(c["passed"] for c in conds), "conditions": conds}


def speed_screen(arms: list[dict], candidate: str, baseline: str, screens: dict, placement: dict | None) -> dict:
    """The candidate's complete-process speedup over the baseline. Where the placement cannot time the arms as
    the reference did (ranks sharing one machine's cores, no link), the ratios are still shown as measured, but
    the screen is not comparable: passed is None, with the reason, never a failing (or passing) ratio."""
    by_name = {a["name"]: a for a in arms}
    base = by_name[baseline]
    speedups = {}
    if base["status"] == "complete":
        for arm in arms:
            if arm["status"] == "complete" and arm["name"] != baseline:
                ex, b = arm["execution"], base["execution"]
                speedups[arm["name"]] = {"complete_process": b["complete_process_s"] / ex["complete_process_s"],
                                         "active": b["max_active_s"] / ex["max_active_s"],
                                         "device_seconds_ratio": ex["device_seconds"] / b["device_seconds"]}
    value = speedups.get(candidate, {}).get("complete_process")
    conds = [condition(f"complete-process speedup of {candidate} over {baseline}", value,
                       screens["min_speedup"], ">=")]
    why = None
    if placement is not None and not placement.get("comparable", True):
        why = placement.get("why")
    elif baseline in (candidate, (by_name[candidate].get("interpolated") or {}).get("from")):
        # a second cohort: replay against no replay, on one reduction; no ratio to screen
        why = (f"the candidate {candidate} is its own speed baseline (study.speed_baseline"
               + ("" if baseline == candidate else f": {baseline}, the arm it interpolates") + "): its arms differ by "
               "their data, not their reduction, and the first study screened the reduction's speed")
    if why is not None:
        for c in conds:
            c["passed"] = None
        return {"passed": None, "comparable": False, "why": why, "conditions": conds, "speedups": speedups}
    return {"passed": conds[0]["passed"], "comparable": True, "conditions": conds, "speedups": speedups}


# ---------------------------------------------------------------- a second cohort


def check_provenance(study_dir: Path, study: dict, record: dict | None) -> dict:
    """The chain seed -> first-study commitment -> accepted candidate -> this study's commitment, each link checked
    again from the files: the first record still hashes to what cohort.json names and commits the candidate's files;
    this study's seed is exactly those files; every arm's run started from that candidate under that record."""
    cohort = study["cohort"]
    try:
        first = load_commitment(Path(cohort["study"]) / "commitment.json")
    except CommitError as exc:
        raise StudyError(f"provenance: {exc}") from None
    accepted = next((c for c in first["candidates"] if c["name"] == cohort["candidate"]), None)
    links = [("first commitment", first["record_sha256"] == cohort["first_commitment_sha256"]),
             ("first seed", files_sha256(first["seed"]["files"]) == cohort["first_seed_files_sha256"]),
             ("accepted candidate", accepted is not None and accepted["files"] == cohort["candidate_files"]
              and accepted["parameter_root"] == cohort["candidate_parameter_root"])]
    if record is not None:
        links.append(("this study's seed", record["seed"]["files"] == cohort["candidate_files"]))
    for arm in study["arms"]:
        if arm["status"] == "complete":
            started = read_json(Path(arm["run_dir"]) / "run.json").get("cohort") or {}
            links.append((f"arm {arm['name']}", started.get("commitment_sha256") == first["record_sha256"]
                          and started.get("parameter_root") == cohort["candidate_parameter_root"]))
            if study.get("growth"):  # a growth arm trained what the study grew (the grown one) or the candidate
                grown = study["growth"]["arms"][arm["name"]]["grown"]
                links.append((f"arm {arm['name']}'s start", (started.get("grown") or {}).get("parameter_root")
                              == (study["growth"]["grown"]["parameter_root"] if grown else None)))
    broken = [name for name, ok in links if not ok]
    if broken:
        raise StudyError(f"provenance: {', '.join(broken)} does not follow from {cohort['study']}'s accepted "
                         f"candidate {cohort['candidate']} (cohort.json); the chain is broken")
    return {"first_seed_files_sha256": cohort["first_seed_files_sha256"],
            "first_commitment_sha256": first["record_sha256"], "accepted_candidate": cohort["candidate"],
            "accepted_parameter_root": cohort["candidate_parameter_root"],
            "accepted_files_sha256": files_sha256(cohort["candidate_files"]),
            "cohort_commitment_sha256": record["record_sha256"] if record else None}


def cohort_screen(candidate: dict, rows: list[dict], seed_rows: list[dict], first_families: list[str],
                  screens: dict) -> dict:
    """A second cohort's quality screen, against the accepted checkpoint (this study's seed): the new families'
    gain, the first cohort's families paired case by case, and the retention documents."""
    if candidate["status"] != "complete":
        return {"passed": False, "conditions": [{"name": "candidate trained", "passed": False,
                                                 "value": candidate["status"], "rule": "complete"}]}
    conf = screens["confidence"]

    def counts(flags):
        return {"correct": sum(flags), "cases": len(flags)}
    new = [r for r in rows if r["family"] not in first_families]
    new_seed = [r for r in seed_rows if r["family"] not in first_families]
    gain = (gain_points(counts([bool(r["correct"]) for r in new]), counts([bool(r["correct"]) for r in new_seed]))
            if new and new_seed else None)
    try:
        paired = paired_bounds({r["case_id"]: r["correct"] for r in rows if r["family"] in first_families},
                               {r["case_id"]: r["correct"] for r in seed_rows if r["family"] in first_families}, conf)
    except (PairingError, ValueError):  # fewer than two first-cohort cases: no bound, no pass
        paired = {"lower_points": None}
    conds = [condition("new-task accuracy gain over the accepted checkpoint, points", gain,
                       screens["min_accuracy_gain_points"], ">="),
             condition(f"first-cohort paired {conf:.0%} lower bound vs the accepted checkpoint, points",
                       paired["lower_points"], screens["min_paired_lower_points"], ">"),
             condition(f"retention-change {conf:.0%} upper bound vs the accepted checkpoint, nats",
                       (candidate.get("retention") or {}).get("upper_nats"), screens["max_retention_upper_nats"], "<")]
    if candidate.get("retention_heldout") is not None:  # documents no cohort trained on: forgetting, not rehearsal
        conds.append(condition(f"held-out retention-change {conf:.0%} upper bound vs the accepted checkpoint, nats",
                               candidate["retention_heldout"]["upper_nats"], screens["max_retention_upper_nats"], "<"))
    return {"passed": all(c["passed"] for c in conds), "conditions": conds, "first_cohort_paired": paired}


def growth_screen(candidate: dict, comparisons: list[dict], cohort_quality: dict, screens: dict,
                  growth: dict) -> dict:
    """A growth study's quality screen, declared in the plan before either arm runs: a quality advantage over every
    continued-dense arm (the paired lower bound on all fresh cases above screens.min_growth_paired_lower_points;
    0: more parameters alone do not pass), and the cohort screen's first-cohort and retention conditions against
    the accepted checkpoint (its new-task gain is reported, not screened)."""
    if candidate["status"] != "complete":
        return cohort_quality
    conf = f"{screens['confidence']:.0%}"
    paired = {c["control"]: c for c in comparisons}
    conds = []
    for name in (n for n, arm in growth["arms"].items() if not arm["grown"]):
        if name in paired:
            conds.append(condition(f"paired {conf} lower bound vs {name} (continued dense), points",
                                   paired[name]["lower_points"], screens["min_growth_paired_lower_points"], ">"))
        else:
            conds.append({"name": f"paired lower bound vs {name} (continued dense)", "value": None, "passed": False,
                          "rule": "the continued-dense arm must finish"})
    conds += [c for c in cohort_quality["conditions"] if not c["name"].startswith("new-task accuracy gain")]
    return {"passed": all(c["passed"] for c in conds), "conditions": conds,
            "first_cohort_paired": cohort_quality.get("first_cohort_paired"),
            "first_cohort_screening": cohort_quality.get("first_cohort_screening")}


# ---------------------------------------------------------------- assembling


def power_entry(screen: str, n: int, screens: dict, control: bool = False) -> dict:
    """One paired screen's declared power at n cases (analysis/paired.py, declared_power); a comparison against a
    control takes screens.expected_control_discordance where the plan declares it."""
    discordance = screens.get("expected_discordance") or 0.0
    if control and (screens.get("expected_control_discordance") or -1.0) >= 0.0:
        discordance = screens["expected_control_discordance"]
    return {"screen": screen, **declared_power(n, discordance, screens["min_paired_lower_points"],
                                               screens["confidence"])}


def declared_powers(sets: dict, screens: dict, controls: list[str]) -> list[dict]:
    """Before scoring: the power of each paired screen at the number of cases the candidate's prepared sets name,
    from the plan's screens.expected_discordance: the probability that a candidate equal to its control passes.
    The report carries the same figures, computed at the n each comparison paired (power_of_comparisons)."""
    n_all = len(sets.get("eval_case_ids", [])) + len((sets.get("chat") or {}).get("exact_match_ids", []))
    out = []
    cohort = sets.get("cohort")
    if cohort and len(cohort.get("first_cohort_eval_case_ids", [])) >= 2:
        out.append(power_entry(FIRST_COHORT_SCREEN, len(cohort["first_cohort_eval_case_ids"]), screens))
    if n_all >= 2:
        out += [power_entry(f"paired lower bound vs {control}", n_all, screens, control=True) for control in controls]
    return out


def power_of_comparisons(comparisons: list[dict], first_cohort: dict | None, screens: dict) -> list[dict]:
    out = []
    if first_cohort and first_cohort.get("n"):
        out.append(power_entry(FIRST_COHORT_SCREEN, first_cohort["n"], screens))
    return out + [power_entry(f"paired lower bound vs {c['control']}", c["n"], screens, control=True)
                  for c in comparisons]


FIRST_COHORT_SCREEN = "first-cohort paired lower bound vs the accepted checkpoint"


def power_lines(powers: list[dict]) -> list[str]:
    """One line per paired screen: its declared power, or why it has none."""
    lines = []
    for p in powers:
        if p["equal_pass_probability"] is None:
            lines.append(f"- {p['screen']} (n = {p['n']:,}): {p['note']}.")
            continue
        line = (f"- {p['screen']} (n = {p['n']:,}, expected discordance {100 * p['expected_discordance']:.2f}%): a "
                f"candidate equal to its control passes with probability {100 * p['equal_pass_probability']:.1f}%")
        lines.append(line + (f"; {p['note']}." if p.get("note") else "."))
    return lines


def first_cohort_screening(study: dict) -> dict:
    """The first cohort's families, as the candidate's prepared sets name them, and which of them the paired screen
    counted (cohort.screen_min_accuracy)."""
    arm = next(a for a in study["arms"] if a["name"] == study["candidate"])
    cohort = read_json(Path(arm["run_dir"]) / "prepared" / "sets.json").get("cohort", {})
    families = list(cohort.get("first_cohort_families", []))
    screened = cohort.get("first_cohort_screen_families", families)
    return {"families": families, "screened": screened, "not_screened": [f for f in families if f not in screened],
            "min_accuracy": cohort.get("screen_min_accuracy", 0.0),
            "replay_counts": cohort.get("first_cohort_replay_counts"),
            "replay_response_weight": cohort.get("first_cohort_response_weight")}


def validation_summary(study_dir: Path) -> dict:
    """What results.json says of validation.json (its per-case values stay there)."""
    v = read_json(study_dir / "validation.json")
    return {k: v.get(k) for k in ("passed", "case_ids", "regenerated", "machine", "validate_s")}


def analyze(study_dir: Path) -> dict:
    study = read_json(study_dir / "study.json")
    screens, conf = study["screens"], study["screens"]["confidence"]
    exploratory = bool(study.get("exploratory"))
    commitment, exploratory_reasons = None, ["the study ran with --exploratory"] if exploratory else []
    if not exploratory:
        try:  # the record's own hash; then every score file is checked against it
            commitment = load_commitment(study_dir / "commitment.json")
        except CommitError as exc:
            raise StudyError(str(exc)) from None
        exploratory_reasons = check_scores(study_dir, study, commitment)
    # Only the values post-scoring validation checked enter a screen: a file edited after it is refused.
    try:
        exploratory_reasons += check_validated(study_dir, ["seed", *(a["name"] for a in study["arms"]
                                                                     if a["status"] == "complete")])
    except NotValidated as exc:
        raise StudyError(str(exc)) from None
    exploratory = exploratory or bool(exploratory_reasons)
    seed_rows = read_jsonl(study_dir / "eval" / "seed" / "cases.jsonl")
    seed_retention = read_jsonl(study_dir / "eval" / "seed" / "retention.jsonl")
    seed = {"name": "seed", **accuracy_block(seed_rows, conf),
            "model_files": read_json(study_dir / "eval" / "seed" / "summary.json")["model_files"],
            "heldout": heldout_block(study_dir / "eval" / "seed" / "heldout.jsonl")}
    arms, case_rows = [], {}
    for spec in study["arms"]:
        arm = {"name": spec["name"], "ranks": spec["ranks"], "ds_config": spec["ds_config"], "status": spec["status"],
               "log": spec.get("log"), "launcher_wall_s": spec.get("launcher_wall_s"),
               "attempts": len(spec.get("attempts") or []), "recovery": recovery_summary(spec.get("recovery") or [])}
        if spec["status"] == "complete":
            run_dir = Path(spec["run_dir"])
            run = read_json(run_dir / "run.json")
            eval_dir = study_dir / "eval" / spec["name"]
            case_rows[spec["name"]] = read_jsonl(eval_dir / "cases.jsonl")
            arm.update(accuracy_block(case_rows[spec["name"]], conf))
            arm.update(parameter_root=run["parameter_root"], prepared_identity=run["prepared_identity"],
                       plan_sha256=run["plan_sha256"], ds_config_sha256=run["ds_config_sha256"],
                       model_files=read_json(eval_dir / "summary.json")["model_files"],
                       retention=retention_block(retention_changes(eval_dir / "retention.jsonl", read_jsonl(
                           eval_dir / "retention.jsonl"), seed_retention), conf),
                       retention_heldout=heldout_retention_block(study_dir, spec["name"], conf),
                       heldout=heldout_block(eval_dir / "heldout.jsonl"))
            if spec.get("interpolated"):
                arm.update(interpolated={k: spec["interpolated"][k] for k in ("from", "alpha", "seconds")},
                           **derived_execution(spec, study, screens))
            else:
                arm.update(execution=execution_block(run_dir, spec["ranks"], screens["network_usd_per_gb"], spec),
                           metrics=read_jsonl(run_dir / "metrics.jsonl"))
        else:
            arm.update(parameter_root=None, accuracy=None, per_family=None)
        arms.append(arm)
    candidate = next(a for a in arms if a["name"] == study["candidate"])
    comparisons, failed_controls, heldout_pairs = [], [], []
    for arm in arms:
        if arm["name"] == candidate["name"]:
            continue
        if arm["status"] != "complete":
            failed_controls.append(arm["name"])
            continue
        if candidate["status"] != "complete":
            continue
        if candidate.get("heldout") and arm.get("heldout"):
            heldout_pairs.append(heldout_pair(candidate["heldout"], arm["heldout"], arm["name"], conf))
        if not seed["cases"]:  # own data without expected answers: no case to pair
            continue
        cand = {r["case_id"]: r["correct"] for r in case_rows[candidate["name"]]}
        ctrl = {r["case_id"]: r["correct"] for r in case_rows[arm["name"]]}
        bounds = paired_bounds(cand, ctrl, conf)
        if bounds["zero_width"]:
            bounds["one_loss_passes_from_n"] = cases_for_one_loss(screens["min_paired_lower_points"], conf)
        comparisons.append({"candidate": candidate["name"], "control": arm["name"],
                            "candidate_parameter_root": candidate["parameter_root"],
                            "control_parameter_root": arm["parameter_root"], **bounds})
    identities = {a["prepared_identity"] for a in arms if a["status"] == "complete"}
    commitment_sha = commitment["record_sha256"] if commitment else None
    identity = identities.pop() if len(identities) == 1 else sorted(identities)
    # Every decision names what it was computed from.
    evidence = {"commitment_sha256": commitment_sha, "prepared_identity": identity,
                "parameter_roots": {a["name"]: a["parameter_root"] for a in arms}, "exploratory": exploratory}
    cohort = study.get("cohort")
    provenance = check_provenance(study_dir, study, commitment) if cohort else None
    if cohort:
        screening = first_cohort_screening(study) if candidate["status"] == "complete" else None
        quality = cohort_screen(candidate, case_rows.get(candidate["name"], []), seed_rows,
                                screening["families"] if screening else [], screens)
        if screening:
            quality["first_cohort_screening"] = screening
        if study.get("growth"):
            quality = growth_screen(candidate, comparisons, quality, screens, study["growth"])
    else:
        quality = quality_screen(candidate, seed, comparisons, failed_controls, screens, heldout_pairs)
    # A growth study's grown-against-dense screen asks for an advantage, not parity (an equal candidate should not
    # pass it): only its first-cohort screen, a parity screen against the accepted checkpoint, has a declared power.
    powers = power_of_comparisons([] if study.get("growth") else comparisons,
                                  quality.get("first_cohort_paired") if cohort else None, screens)
    speed = speed_screen(arms, study["candidate"], study["speed_baseline"], screens, study.get("placement"))
    if study.get("growth"):  # the arms share a FLOPs budget, not a schedule: their times are reported, not screened
        speed = {**speed, "passed": None, "comparable": False,
                 "why": "a growth study's arms train under one FLOPs budget; their times and serving costs are "
                        "reported beside the gain, not screened",
                 "conditions": [{**c, "passed": None} for c in speed["conditions"]]}
    return {
        "exploratory": exploratory, "exploratory_reasons": exploratory_reasons,
        "commitment_sha256": commitment_sha, "commitment_anchor": read_anchor(study_dir, commitment),
        "source": commitment["source"] if commitment else None,
        "prepared_identity": identity,
        "plan_sha256": study["plan_sha256"], "candidate": study["candidate"],
        "speed_baseline": study["speed_baseline"], "screens_declared": screens,
        "validation": validation_summary(study_dir), "placement": study.get("placement"), "warm_up": study.get("warm_up"),
        "seed": seed, "arms": arms, "comparisons": comparisons, "heldout_comparisons": heldout_pairs,
        "declared_power": powers,
        "provenance": provenance,
        **({"growth": study["growth"], "serving": read_serving(study_dir)} if study.get("growth") else {}),
        "screens": {"quality": {**quality, "evidence": evidence}, "speed": {**speed, "evidence": evidence}},
    }


# ---------------------------------------------------------------- report


def _pct(x):
    return "—" if x is None else f"{100 * x:.2f}%"


def _num(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def learning_table(results: dict) -> str:
    models = [results["seed"], *results["arms"]]
    head = "| Fresh task cases | " + " | ".join(m["name"] for m in models) + " |"
    lines = [head, "|" + "---|" * (len(models) + 1)]
    n = results["seed"]["cases"]
    if n:  # own data whose rows carry no expected answer has no case
        lines.append(f"| Correct / {n:,} | " + " | ".join(
            "failed" if m.get("status", "complete") != "complete" else str(m["correct"]) for m in models) + " |")
        lines.append("| Accuracy | " + " | ".join(_pct(m.get("accuracy")) for m in models) + " |")
    for fam, block in results["seed"]["per_family"].items():
        title = FAMILY_TITLES.get(fam, fam)
        cells = [str(m["per_family"][fam]["correct"]) if m.get("per_family") else "—" for m in models]
        lines.append(f"| {title} / {block['cases']:,} | " + " | ".join(cells) + " |")
    if results["seed"].get("heldout"):
        lines.append(f"| Own held-out loss per response token ({results['seed']['heldout']['docs']} rows), nats | "
                     + " | ".join(_num((m.get("heldout") or {}).get("loss_per_token"), "{:.6f}") for m in models) + " |")
    conf = f"{results['screens_declared']['confidence']:.0%}"
    ret = [None] + [a.get("retention") for a in results["arms"]]
    lines.append("| Mean retention-loss change, nats | " + " | ".join(
        _num(r["mean_change_nats"] if r else None, "{:+.6f}") for r in ret) + " |")
    lines.append(f"| Approximate {conf} upper retention bound | " + " | ".join(
        _num(r["upper_nats"] if r else None, "{:+.6f}") for r in ret) + " |")
    held = [None] + [a.get("retention_heldout") for a in results["arms"]]
    if any(held):  # documents no arm trained on
        docs = next(h["docs"] for h in held if h)
        lines.append(f"| Mean held-out retention-loss change ({docs} documents never trained), nats | " + " | ".join(
            _num(h["mean_change_nats"] if h else None, "{:+.6f}") for h in held) + " |")
        lines.append(f"| Approximate {conf} upper held-out retention bound | " + " | ".join(
            _num(h["upper_nats"] if h else None, "{:+.6f}") for h in held) + " |")
    return "\n".join(lines)


PHASE_ORDER = ("forward_backward", "reducer_compute", "collective_wait", "optimizer_step", "parameter_sync", "rest")
"""The receipts' phases in update order (nshard/phases.py: PHASES, then REST); a name not listed goes last."""


def phase_names(splits) -> list[str]:
    found = {n for phases in splits for n in phases}
    return [n for n in PHASE_ORDER if n in found] + sorted(found - set(PHASE_ORDER))


def update_phases(arm: dict) -> tuple[str, dict] | None:
    """The median update an arm's speed rests on, split by phase: its compressed updates if it has any, else its
    dense ones (the slowest rank's medians)."""
    e = arm.get("execution") or {}
    for kind in ("compressed", "dense"):
        block = (e.get("phases") or {}).get(kind) or {}
        if block.get("updates") and block.get("median_phase_s"):
            return kind, block["median_phase_s"]
    return None


def phases_that_do_not_shrink(results: dict) -> dict | None:
    """The candidate's median update against the speed baseline's, phase by phase: a phase that takes at least 90%
    of the baseline's seconds with more ranks (or that the baseline does not have) does not shrink; the largest of
    them is what more ranks cannot buy back."""
    by_name = {a["name"]: a for a in results["arms"]}
    cand, base = by_name.get(results["candidate"]), by_name.get(results["speed_baseline"])
    if not cand or not base or cand is base or cand.get("ranks", 1) <= base.get("ranks", 1):
        return None
    c, b = update_phases(cand), update_phases(base)
    if not c or not b:
        return None
    stuck = {name: s for name, s in c[1].items() if name != "rest" and s > 0 and s >= 0.9 * b[1].get(name, 0.0)}
    if not stuck:
        return {"phase": None, "candidate_s": None, "baseline_s": None}
    name = max(stuck, key=stuck.get)
    return {"phase": name, "candidate_s": stuck[name], "baseline_s": b[1].get(name, 0.0)}


def phase_table(results: dict) -> list[str]:
    """Each arm's median update by phase (seconds, slowest rank), and the largest phase that does not shrink."""
    arms = [(a, update_phases(a)) for a in results["arms"] if a.get("status") == "complete"]
    arms = [(a, p) for a, p in arms if p]
    if not arms:
        return []
    names = phase_names(phases for _, (_, phases) in arms)
    lines = ["| Median update by phase, s (slowest rank) | " + " | ".join(
                 f"{a['name']} ({kind})" for a, (kind, _) in arms) + " |",
             "|" + "---|" * (len(arms) + 1)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(_num(phases.get(name), "{:.3f}") for _, (_, phases) in arms) + " |")
    lines.append("| total | " + " | ".join(f"{sum(phases.values()):.3f}" for _, (_, phases) in arms) + " |")
    stuck = phases_that_do_not_shrink(results)
    if stuck and stuck["phase"]:
        lines += ["", f"Largest phase that does not shrink with more ranks: **{stuck['phase']}**, "
                      f"{stuck['candidate_s']:.3f} s in {results['candidate']}'s median update against "
                      f"{stuck['baseline_s']:.3f} s in {results['speed_baseline']}'s."]
    elif stuck:
        lines += ["", "Every phase of the candidate's median update is under 90% of the speed baseline's."]
    return lines


def optimizer_of(receipts: list[dict]) -> str | None:
    """The AdamW implementation an arm's ranks ran (receipts' optimizer.implementation; None in older receipts).
    Ranks that disagree are an error: one arm steps one rule."""
    found = {(r.get("optimizer") or {}).get("implementation") for r in receipts}
    if len(found) > 1:
        raise StudyError(f"the ranks of one arm ran different AdamW implementations: {sorted(map(str, found))}")
    return found.pop() if found else None


def reduction_start_of(receipts: list[dict]) -> str | None:
    """When an arm's gradient reduction started (receipts' reduction_ran.overlap_backward; None in older
    receipts): after the last backward, or during it (nshard.overlap_backward), with its buckets and the share of
    them, over every rank's updates, that started before the backward ended; or DeepSpeed's own reduction (whose
    ZeRO overlap_comm is DeepSpeed's setting). Ranks that disagree are an error."""
    ran = [r.get("reduction_ran") or {} for r in receipts]
    if ran and all(x.get("configured") == "deepspeed" for x in ran):
        return "DeepSpeed's own reduction"
    if not all("overlap_backward" in x for x in ran):
        return None
    found = [x["overlap_backward"] for x in ran]
    if len({f is None for f in found}) > 1 or len({f["buckets"] for f in found if f}) > 1:
        raise StudyError("the ranks of one arm started the reduction differently (nshard.overlap_backward): "
                         f"{found}")
    if found[0] is None:
        return "after the last backward"
    planned = sum(f["updates"] * f["buckets"] for f in found)
    share = f"{100 * sum(f['started_in_backward'] for f in found) / planned:.0f}%" if planned else "none"
    return f"during the last backward: {found[0]['buckets']} buckets, {share} started before it ended"


def execution_table(results: dict) -> str:
    arms = [a for a in results["arms"]]
    ex = [a.get("execution") for a in arms]
    device = next((e["device"] for e in ex if e), "CPU")
    rows = [
        ("Ranks", lambda a, e: str(a["ranks"])),
        *([("Made from (interpolated: its training is that arm's)", lambda a, e: "trained" if not a.get(
            "interpolated") else f"{a['interpolated']['from']}, alpha {a['interpolated']['alpha']:g}, "
                                 f"+{a['interpolated']['seconds']:,.2f} s")]
          if any(a.get("interpolated") for a in arms) else []),
        ("Compute (masters, moments, error memory)", lambda a, e: "—" if not e.get("precision") else
         f"{e['precision']['compute']} ({e['precision']['masters']})"),
        ("AdamW implementation", lambda a, e: e.get("optimizer") or "—"),
        ("Gradient reduction starts", lambda a, e: e.get("reduction_start") or "—"),
        ("Maximum rank active time", lambda a, e: _num(e and e["max_active_s"], "{:,.2f} s")),
        ("Active time plus final checkpoint", lambda a, e: _num(e and e["max_active_plus_checkpoint_s"], "{:,.2f} s")),
        ("Complete process group", lambda a, e: _num(e and e["complete_process_s"], "{:,.2f} s")),
        ("Failed attempts, their wall time (counted above)", lambda a, e: _failed_cell(e)),
        ("Recovery: resumed from update, updates redone, seconds lost", lambda a, e: _recovery_cell(e)),
        ("Start-up: process start to first update (slowest rank)",
         lambda a, e: _num(e.get("startup_s"), "{:,.2f} s")),
        ("Launch before the first rank process", lambda a, e: _num(e.get("launch_s"), "{:,.2f} s")),
        ("Teardown after the last receipt", lambda a, e: _num(e.get("teardown_s"), "{:,.2f} s")),
        ("One-time work inside the arm", lambda a, e: "—" if e.get("one_time_work") is None
         else "; ".join(e["one_time_work"]) or "none"),
        (f"Allocated {device} seconds, complete process", lambda a, e: _num(e and e["device_seconds"], "{:,.2f}")),
        ("All ranks, bytes handed to collectives, GB", lambda a, e: _num(e and e["sent_bytes"] / 1e9, "{:,.6f}")),
        ("All hosts, kernel-counted transmitted GB",
         lambda a, e: _num(None if e["kernel_tx_bytes"] is None else e["kernel_tx_bytes"] / 1e9, "{:,.6f}")
         # the kernel's counters live with the hosts' processes: a resumed arm's cover its last attempt only
         + (" (last attempt only)" if e["kernel_tx_bytes"] is not None and e.get("recovery") else "")),
        (f"Network cost at ${results['screens_declared']['network_usd_per_gb']}/GB",
         lambda a, e: _num(e and e["network_usd"], "${:,.4f}")),
        ("Median dense update (slowest rank)",
         lambda a, e: _num(e and e["phases"]["dense"]["median_update_s"], "{:.3f} s")),
        ("Median compressed update (slowest rank)",
         lambda a, e: _num(e and e["phases"]["compressed"]["median_update_s"], "{:.3f} s")),
        ("Peak RSS per rank", lambda a, e: _num(e and e["peak_rss_bytes"] / 2**30, "{:.2f} GiB")),
        ("Tokens/s, all (response), over the slowest rank's update seconds", lambda a, e: _tokens_cell(e)),
        ("Achieved TFLOP/s, 6 x active parameters per token x document tokens", lambda a, e: _num(
            (e.get("throughput") or {}).get("achieved_tflops"), "{:.4g}")),
        ("MFU: achieved / peak (devices x one device's dense peak, its source)", lambda a, e: _mfu_cell(e)),
    ]
    lines = ["| Measurement | " + " | ".join(a["name"] for a in arms) + " |", "|" + "---|" * (len(arms) + 1)]
    for title, cell in rows:
        lines.append(f"| {title} | " + " | ".join(cell(a, e) if (e or title == "Ranks") else a["status"]
                                                for a, e in zip(arms, ex)) + " |")
    return "\n".join(lines)


def _failed_cell(e: dict) -> str:
    n = e.get("failed_attempts") or 0
    return "none" if not n else f"{n}, {e['failed_attempts_s']:,.2f} s"


def _recovery_cell(e: dict) -> str:
    """One entry per resume: 'update U, R redone, L s lost' ('?' where the study did not record the attempt)."""
    parts = [f"update {r['resumed_from_update']}, "
             + ("? redone, ? s lost" if r["seconds_lost"] is None else
                f"{r['updates_redone']} redone, {r['seconds_lost']:,.2f} s lost") for r in e.get("recovery") or []]
    return "; ".join(parts) or "—"


RECOVERY_TEXT = ("An arm that lost a rank (or whose study was stopped) resumed from its newest complete state that "
                 "verified, in the same run directory. Updates redone: the updates the failed attempt finished "
                 "(its metrics.jsonl lines) beyond that state. Seconds lost: the failed attempt's wall seconds after "
                 "that state was written (its manifest's written_at), i.e. the updates beyond it, the failure and "
                 "the teardown; all of its wall seconds when the state is older than the attempt. The complete "
                 "process group time is the last process group's plus every failed attempt's launcher wall "
                 "seconds with the same plan and ds_config, and the allocated seconds are ranks times that.")


def _tokens_cell(e: dict) -> str:
    t = e.get("throughput")
    return "—" if not t else f"{t['tokens_per_s']:,.0f} ({t['response_tokens_per_s']:,.0f})"


def _mfu_cell(e: dict) -> str:
    t = e.get("throughput")
    if not t:
        return "—"
    peak = t["peak"]
    if t["mfu"] is None and peak.get("tflops_per_device"):
        return (f"— (achieved {t['achieved_tflops']:.4g} TFLOP/s exceeds the peak {t['peak_tflops']:.4g}: the "
                f"{peak['source'].split(' (')[0]} read low; the next run measures it again)")
    if t["mfu"] is None:
        return f"— (no peak: {peak['source']})"
    source = peak["source"].split(" (")[0]
    return (f"{_pct(t['mfu'])} of {t['peak_tflops']:.4g} TFLOP/s ({t['devices']} x {peak['tflops_per_device']:.4g}, "
            f"{source})")


def screening_lines(screening: dict | None) -> list[str]:
    """A second cohort's note of which first-cohort families its paired screen counted, and what it replayed."""
    if not screening:
        return []
    lines = []
    if screening["not_screened"]:
        lines.append(f"- first-cohort families screened: {', '.join(screening['screened'])}; not screened: "
                     f"{', '.join(screening['not_screened'])} (the accepted candidate answered less than "
                     f"{screening['min_accuracy']:.0%} of them in its own study: cohort.screen_min_accuracy)")
    if screening.get("replay_counts") is not None:
        counts = ", ".join(f"{FAMILY_TITLES.get(f, f).lower()} {screening['replay_counts'][f]}"
                           for f in screening["families"] if f in screening["replay_counts"])
        lines.append(f"- first-cohort training cases replayed by the candidate: {counts}; each response token weighs "
                     f"{screening['replay_response_weight']:g}")
    return lines


def screen_lines(screen: dict) -> list[str]:
    out = []
    for c in screen["conditions"]:
        value = c["value"]
        shown = f"{value:+.4f}" if isinstance(value, float) else str(value)
        verdict = "NOT COMPARABLE" if c["passed"] is None else "PASS" if c["passed"] else "FAIL"
        out.append(f"- {verdict}: {c['name']} = {shown} (needs {c['rule']})")
    return out


def render_report(results: dict) -> str:
    flag = ("EXPLORATORY — scored without a commitment; no screen below is a decision ("
            + "; ".join(results.get("exploratory_reasons") or []) + ").\n\n") if results["exploratory"] else ""
    q, s = results["screens"]["quality"], results["screens"]["speed"]
    lines = [f"# Study report{' (exploratory)' if results['exploratory'] else ''}", "", *([flag.strip(), ""] if flag else []),
             f"Candidate: `{results['candidate']}`. Commitment record: `{results['commitment_sha256']}`. "
             f"Prepared identity: `{results['prepared_identity']}`.", ""]
    placement = results.get("placement")
    if placement:
        where = {"emulated": f"two emulated hosts on one machine, {placement.get('cores_per_host')} core(s) each, "
                             f"link {placement.get('link')}",
                 "hostfile": f"the hosts of {placement.get('hostfile')}"
                             + (f" ({', '.join(placement['hosts'])})" if placement.get("hosts") else ""),
                 "local": "every rank on this machine"}[placement["kind"]]
        lines += [f"Placement: {where}" + (f" (asked: {placement['requested']})" if placement.get("requested") else "")
                  + ".", ""]
    if results.get("source"):
        lines += [f"Source commit: `{results['source']['commit']}` (dirty: {results['source']['dirty']}).", ""]
    lines += ["## Learning", "", learning_table(results), "",
              f"Quality screen: **{'PASSED' if q['passed'] else 'FAILED'}**", "", *screen_lines(q),
              *screening_lines(q.get("first_cohort_screening")), ""]
    if results["comparisons"]:
        conf = f"{results['screens_declared']['confidence']:.0%}"
        lines += [f"| Paired comparison | n | discordant | difference, points | {conf} interval, points |",
                  "|---|---|---|---|---|"]
        for c in results["comparisons"]:
            lines.append(f"| {c['candidate']} − {c['control']} | {c['n']} | {c['discordant']} | "
                         f"{c['difference_points']:+.2f} | [{c['lower_points']:+.2f}, {c['upper_points']:+.2f}] |")
        lines.append("")
        for c in results["comparisons"]:
            if c.get("zero_width"):
                lines.append(f"- {c['candidate']} − {c['control']}: no discordant pair, so the interval has zero "
                             f"width; a single lost case would still clear the margin only with "
                             f"n ≥ {c['one_loss_passes_from_n']} cases (n = {c['n']}).")
        lines.append("")
    if results.get("declared_power"):
        lines += ["Declared power of the paired screens (before scoring, from the plan's expected discordance):", "",
                  *power_lines(results["declared_power"]), ""]
    if results.get("growth"):
        lines += ["## Growth", "", growth_table(results), ""]
    verdict = "NOT COMPARABLE" if s["passed"] is None else "PASSED" if s["passed"] else "FAILED"
    lines += ["## Execution", "", execution_table(results), ""]
    if any((a.get("execution") or {}).get("failed_attempts") or a.get("recovery") for a in results["arms"]):
        lines += [RECOVERY_TEXT, ""]
    if phase_table(results):
        lines += [*phase_table(results), ""]
    lines += [f"Speed screen: **{verdict}**", ""]
    if s["passed"] is None:
        lines += [f"The arms' times cannot be compared as the reference's were: {s.get('why')}. The ratios below "
                  "are as measured.", ""]
    lines += [*screen_lines(s), ""]
    precisions = {a["execution"]["precision"]["why"] for a in results["arms"]
                  if a.get("execution") and a["execution"].get("precision")}
    for why in sorted(precisions):
        lines.append(f"- precision: {why}")
    if warm := results.get("warm_up"):
        lines.append(f"- before the first arm, a {warm['ranks']}-rank warm-up launch of one update ran on the hosts "
                     f"({warm['wall_s']:.0f} s, not counted in any arm): "
                     + ("; ".join(warm["one_time_work"]) if warm["one_time_work"] else "no one-time work was left"))
    for name, sp in s["speedups"].items():
        lines.append(f"- {name}: complete-process speedup {sp['complete_process']:.3f}×, active {sp['active']:.3f}×, "
                     f"{sp['device_seconds_ratio']:.3f}× the baseline's device seconds")
    lines += ["", "## Evidence", ""]
    for arm in results["arms"]:
        if arm["status"] == "complete":
            lines.append(f"- {arm['name']}: parameter root `{arm['parameter_root']}`")
        else:
            lines.append(f"- {arm['name']}: **{arm['status']}** (log: `{arm['log']}`)")
    if prov := results.get("provenance"):
        lines.append(f"- second cohort: first seed files `{prov['first_seed_files_sha256']}` → first commitment "
                     f"`{prov['first_commitment_sha256']}` → accepted candidate {prov['accepted_candidate']} (parameter "
                     f"root `{prov['accepted_parameter_root']}`, files `{prov['accepted_files_sha256']}`) → this "
                     f"commitment `{prov['cohort_commitment_sha256']}`; the seed column is the accepted candidate")
    if v := results.get("validation"):
        how = ("every answer generated and every retention loss scored again" if v["regenerated"]
               else "stored files only, nothing regenerated")
        lines.append(f"- post-scoring validation: passed on {v['case_ids']} cases per model, {how}"
                     + (f" ({v['machine']['machine']}, torch CPU capability {v['machine']['cpu_capability']})"
                        if v.get("machine") else ""))
    if anchor := results.get("commitment_anchor"):
        lines.append(f"- commitment anchored before scoring in `{anchor['uri']}` (index `{anchor['index_sha256']}`), "
                     f"stored at {anchor['stored_at']} ({anchor['clock']} clock)")
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


# ---------------------------------------------------------------- plots


def write_plots(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    tag = " (exploratory)" if results["exploratory"] else ""
    models = [results["seed"], *[a for a in results["arms"] if a["status"] == "complete"]]
    families = list(results["seed"]["per_family"])
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(models)
    for k, m in enumerate(models):
        blocks = [m["per_family"][f] for f in families]
        xs = [i + (k - (len(models) - 1) / 2) * width for i in range(len(families))]
        acc = [100 * b["accuracy"] for b in blocks]
        err = [[100 * (b["accuracy"] - max(b["lower"], 0)) for b in blocks],
               [100 * (min(b["upper"], 1) - b["accuracy"]) for b in blocks]]
        ax.bar(xs, acc, width, yerr=err, capsize=3, label=m["name"])
    ax.set_xticks(range(len(families)), [FAMILY_TITLES.get(f, f) for f in families])
    ax.set_ylabel("exact-match accuracy, % (approx. interval)")
    ax.set_ylim(0, 105)
    ax.set_title(f"Accuracy per family{tag}")
    ax.legend()
    paths.append(_save(fig, out / "accuracy_per_family.png"))

    for key, title, ylabel, name, log in (
            ("loss", "Training loss per update", "global loss, nats per target token", "loss_per_update.png", False),
            ("bytes", "Gradient bytes per update", "bytes handed to gradient collectives, all ranks",
             "bytes_per_update.png", True)):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for arm in results["arms"]:
            if arm["status"] != "complete":
                continue
            ys = ([m["loss"] for m in arm["metrics"]] if key == "loss" else arm["execution"]["update_bytes"])
            if log and not any(ys):  # one rank sends nothing: no point on a log axis
                ax.plot([], [], " ", label=f"{arm['name']}: 0 bytes")
                continue
            ax.plot(range(1, len(ys) + 1), ys, marker="o", markersize=3, label=arm["name"])
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("update")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}{tag}")
        ax.legend()
        paths.append(_save(fig, out / name))
    sparse = [a for a in results["arms"] if a["status"] == "complete" and any("expert_load" in m for m in a["metrics"])]
    if sparse:
        paths.append(expert_load_plot(plt, sparse, out / "expert_load.png", tag))
    split = [(a, update_phases(a)) for a in results["arms"] if a["status"] == "complete"]
    split = [(a, p) for a, p in split if p]
    if split:  # one stacked bar per arm: its median update by phase
        names = phase_names(phases for _, (_, phases) in split)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        bottoms = [0.0] * len(split)
        for name in names:
            heights = [phases.get(name, 0.0) for _, (_, phases) in split]
            ax.bar(range(len(split)), heights, 0.6, bottom=bottoms, label=name)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        ax.set_xticks(range(len(split)), [f"{a['name']}\n({kind})" for a, (kind, _) in split])
        ax.set_ylabel("median update, s (slowest rank)")
        ax.set_title(f"Where each second of an update goes{tag}")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out / "update_phases.png"))
    return paths


def expert_load_plot(plt, arms: list[dict], path: Path, tag: str) -> Path:
    """Per sparse arm: each layer's share of routed slots per expert over the run (nshard/run/experts.py's receipts),
    and the smallest share any expert had in any update (0: a dead expert)."""
    fig, axes = plt.subplots(1, len(arms), figsize=(4 + 3 * len(arms), 4.5), squeeze=False)
    for ax, arm in zip(axes[0], arms):
        loads = [m["expert_load"] for m in arm["metrics"] if "expert_load" in m]  # [update][layer][expert]
        layers, experts = len(loads[0]), len(loads[0][0])
        share = [[sum(u[l][e] for u in loads) / max(1, sum(sum(u[l]) for u in loads)) for l in range(layers)]
                 for e in range(experts)]
        least = min(u[l][e] / max(1, sum(u[l])) for u in loads for l in range(layers) for e in range(experts))
        image = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0)
        ax.set_xlabel("layer")
        ax.set_ylabel("expert")
        ax.set_title(f"{arm['name']}: router load share\nleast in any update {100 * least:.1f}%")
        fig.colorbar(image, ax=ax)
    fig.suptitle(f"Expert load over the run{tag}")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)  # pyplot keeps every figure it made until closed
    return path


def write_outputs(study_dir: Path) -> dict:
    results = analyze(study_dir)
    plots = write_plots(results, study_dir / "plots")
    public = {**results, "arms": [{k: v for k, v in a.items() if k != "metrics"} for a in results["arms"]],
              "plots": [str(p.relative_to(study_dir)) for p in plots]}
    for path, text in ((study_dir / "results.json", json.dumps(public, indent=1, sort_keys=True) + "\n"),
                       (study_dir / "report.md", render_report(results))):
        write_text_atomic(path, text)
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog("nshard.analysis.report"), description=__doc__, epilog=SPELLING_NOTE)
    parser.add_argument("study_dir", type=Path)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        results = write_outputs(args.study_dir)
    except (StudyError, PairingError, OSError, KeyError, TypeError, ValueError) as exc:
        # One line naming the problem (json.JSONDecodeError and PairingError are ValueErrors).
        print(f"nshard.analysis.report: error: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(learning_table(results))
    print(f"\nquality screen: {'PASSED' if results['screens']['quality']['passed'] else 'FAILED'}; "
          f"speed screen: {({None: 'NOT COMPARABLE', True: 'PASSED', False: 'FAILED'})[results['screens']['speed']['passed']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
