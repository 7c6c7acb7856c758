"""The study analysis on hand-computed cases: paired bounds, retention bounds, screens, report (no torch)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nshard.analysis.paired import PairingError, mean_interval, paired_bounds
from nshard.analysis.report import analyze, write_outputs

REPO = Path(__file__).resolve().parent.parent
Z99 = 2.5758293035489004


def vectors(both: int, cand_only: int, ctrl_only: int, neither: int) -> tuple[dict, dict]:
    cand, ctrl, i = {}, {}, 0
    for count, c, k in ((both, True, True), (cand_only, True, False), (ctrl_only, False, True), (neither, False, False)):
        for _ in range(count):
            cand[f"case-{i:05d}"], ctrl[f"case-{i:05d}"] = c, k
            i += 1
    return cand, ctrl


def test_identical_arms_give_zero_difference_and_an_interval_around_zero():
    cand, ctrl = vectors(30, 0, 0, 20)
    r = paired_bounds(cand, ctrl, 0.99)
    assert (r["n"], r["discordant"]) == (50, 0)
    assert r["difference_points"] == r["lower_points"] == r["upper_points"] == 0.0


def test_all_discordant_pairs_by_hand():
    # d = +1 five times, -1 five times: mean 0, s^2 = 10/9, half-width z * s / sqrt(10).
    cand, ctrl = vectors(0, 5, 5, 0)
    r = paired_bounds(cand, ctrl, 0.99)
    half = Z99 * math.sqrt(10 / 9) / math.sqrt(10) * 100
    assert r["discordant"] == 10 and r["difference_points"] == 0.0
    assert r["lower_points"] == pytest.approx(-half) and r["upper_points"] == pytest.approx(half)
    assert r["lower_points"] == pytest.approx(-85.8610, abs=1e-3)
    # Every pair favours the candidate: no spread, so the interval is the point itself.
    r = paired_bounds(*vectors(0, 4, 0, 0), 0.99)
    assert r["difference_points"] == r["lower_points"] == r["upper_points"] == 100.0


def test_published_three_arm_study_bounds():
    # 1,024 cases; candidate 727 correct vs 730 (33 discordant) and vs 723 (28 discordant).
    vs_one = paired_bounds(*vectors(712, 15, 18, 279), 0.99)
    vs_dense = paired_bounds(*vectors(711, 16, 12, 285), 0.99)
    assert (vs_one["candidate_correct"], vs_one["control_correct"], vs_one["discordant"]) == (727, 730, 33)
    assert (vs_dense["candidate_correct"], vs_dense["control_correct"], vs_dense["discordant"]) == (727, 723, 28)
    assert round(vs_one["lower_points"], 2) == -1.74
    assert round(vs_dense["lower_points"], 2) == -0.94


def test_mean_interval_uses_the_sample_standard_deviation():
    mean, lower, upper = mean_interval([0.01, -0.02, 0.03, 0.0], 0.99)
    s = math.sqrt(sum((v - 0.005) ** 2 for v in [0.01, -0.02, 0.03, 0.0]) / 3)
    assert mean == pytest.approx(0.005)
    assert upper == pytest.approx(0.005 + Z99 * s / 2)
    assert lower == pytest.approx(0.005 - Z99 * s / 2)


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_paired_cli_reads_files_and_refuses_different_case_ids(tmp_path):
    cand, ctrl = vectors(712, 15, 18, 279)
    write_jsonl(tmp_path / "cand.jsonl", [{"case_id": k, "correct": v, "family": "x"} for k, v in cand.items()])
    write_jsonl(tmp_path / "ctrl.jsonl", [{"case_id": k, "correct": v} for k, v in ctrl.items()])
    proc = subprocess.run([sys.executable, "-m", "nshard.analysis.paired", str(tmp_path / "cand.jsonl"),
                           str(tmp_path / "ctrl.jsonl"), "--confidence", "0.99"],
                          cwd=REPO, capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout)
    assert set(out) == {"n", "discordant", "difference_points", "lower_points", "upper_points"}
    assert (out["n"], out["discordant"], round(out["lower_points"], 2)) == (1024, 33, -1.74)
    write_jsonl(tmp_path / "other.jsonl", [{"case_id": k + "x", "correct": v} for k, v in ctrl.items()])
    proc = subprocess.run([sys.executable, "-m", "nshard.analysis.paired", str(tmp_path / "cand.jsonl"),
                           str(tmp_path / "other.jsonl")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "different case IDs" in proc.stderr
    with pytest.raises(PairingError, match="different case IDs"):
        paired_bounds({"a": True}, {"b": True})


def test_analysis_never_imports_torch_or_the_trainer():
    """nshard.analysis reads files: no torch, and of nshard beyond itself only the record checks (standard library)."""
    code = ("import sys, nshard.analysis.report, nshard.analysis.paired, nshard.analysis.zero_table, "
            "nshard.analysis.memory_model; "
            "allowed = ('nshard.analysis', 'nshard.evidence', 'nshard.evidence.commit', 'nshard.evidence.export', "
            "'nshard.files', 'nshard.cli'); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'transformers') "
            "or (m.startswith('nshard.') and not m.startswith(allowed))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# ---------------------------------------------------------------- a synthetic study directory

SCREENS = {"min_accuracy_gain_points": 10.0, "max_retention_upper_nats": 0.02, "min_paired_lower_points": -3.0,
           "min_speedup": 1.10, "confidence": 0.99, "network_usd_per_gb": 0.02}
FAMILIES = ("lookup", "filtering")


def make_arm(root: Path, name: str, ranks: int, process_s: float, correct: list[bool], changes: list[float]):
    run = root / "arms" / name
    (run / "receipts").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"status": "complete", "parameter_root": f"root-{name}",
                                              "prepared_identity": "ident", "plan_sha256": "p",
                                              "ds_config_sha256": f"ds-{name}"}))
    for r in range(ranks):
        (run / "receipts" / f"rank-{r}.json").write_text(json.dumps({
            "active_s": process_s - 5, "active_plus_checkpoint_s": process_s - 4, "process_s": process_s,
            "grad_collective_bytes": 1000 * (ranks - 1) * 2, "other_collective_bytes": 10,
            "update_grad_bytes": [1000 * (ranks - 1), 1000 * (ranks - 1)], "peak_rss_bytes": 2**30,
            "by_phase": {"dense": {"updates": 2, "median_update_s": 1.0},
                         "compressed": {"updates": 0, "median_update_s": None}}}))
    write_jsonl(run / "metrics.jsonl", [{"update": 1, "loss": 2.0}, {"update": 2, "loss": 1.5}])
    (run / "model").mkdir()
    (run / "model" / "model.safetensors").write_text(f"weights of {name}")
    write_eval(root, name, correct, changes)
    return {"name": name, "ranks": ranks, "ds_config": "x.json", "status": "complete", "run_dir": str(run),
            "log": f"logs/{name}.log"}


def commit_study(root: Path, arms: list[dict]) -> None:
    """The record nshard.evidence.commit would write for these arms and the seed, and every summary scored under it."""
    from nshard.evidence.commit import model_files, record_sha256

    seed_dir = root / "seed-model"
    seed_dir.mkdir(exist_ok=True)
    (seed_dir / "model.safetensors").write_text("seed weights")
    entry = lambda name, d: {"name": name, "model_dir": str(d), "files": model_files(d)}
    body = {"kind": "nshard-commitment", "version": 1, "source": {"commit": "abc", "dirty": False},
            "seed": entry("seed", seed_dir),
            "candidates": [{**entry(a["name"], Path(a["run_dir"]) / "model"), "parameter_root": f"root-{a['name']}"}
                           for a in arms if a["status"] == "complete"]}
    body["record_sha256"] = record_sha256(body)
    (root / "commitment.json").write_text(json.dumps(body))
    for e in [body["seed"], *body["candidates"]]:
        (root / "eval" / e["name"] / "summary.json").write_text(json.dumps(
            {"model_files": e["files"], "commitment": body["record_sha256"], "committed_as": e["name"],
             "exploratory": False}))
    write_validation(root, [e["name"] for e in [body["seed"], *body["candidates"]]])


def write_validation(root: Path, labels: list[str], regenerated: bool = True) -> None:
    """validation.json as nshard.study.validate writes it once it has passed: every evaluation's flags and losses."""
    def rows(label, name):
        return [json.loads(line) for line in (root / "eval" / label / name).read_text().splitlines()]
    evaluations = {label: {"case_results": {r["case_id"]: {"family": r["family"], "correct": r["correct"]}
                                            for r in rows(label, "cases.jsonl")},
                           "retention_docs_checked": {r["doc_id"]: {"nll_sum": r["nll_sum"],
                                                                    "target_weight": r["target_weight"]}
                                                      for r in rows(label, "retention.jsonl")}}
                   for label in labels}
    for label in labels:  # own data: the held-out rows' losses too
        if (root / "eval" / label / "heldout.jsonl").is_file():
            evaluations[label]["heldout_docs_checked"] = {
                r["doc_id"]: {"nll_sum": r["nll_sum"], "target_weight": r["target_weight"]}
                for r in rows(label, "heldout.jsonl")}
    (root / "validation.json").write_text(json.dumps({"passed": True, "case_ids": 100, "regenerated": regenerated,
                                                      "evaluations": evaluations}))


def write_eval(root: Path, name: str, correct: list[bool], changes: list[float] | None):
    d = root / "eval" / name
    write_jsonl(d / "cases.jsonl", [{"case_id": f"c{i:03d}", "family": FAMILIES[i % 2], "correct": c}
                                    for i, c in enumerate(correct)])
    # The seed's losses are 1.0 per document; a model's change is stored as its losses give it.
    rows = ([{"doc_id": f"r{i}", "nll_sum": 1.0 + 10 * c, "target_weight": 10.0} for i, c in enumerate(changes)]
            if changes is not None else [{"doc_id": f"r{i}", "nll_sum": 1.0, "target_weight": 10.0} for i in range(16)])
    for row in rows if changes is not None else []:
        row["change_nats_per_token"] = (row["nll_sum"] - 1.0) / row["target_weight"]
    write_jsonl(d / "retention.jsonl", rows)
    (d / "summary.json").write_text(json.dumps({"model_files": {"model.safetensors": name}}))


def make_study(root: Path, *, candidate_correct: int, retention_shift: float, candidate_process_s: float,
               dense_correct: int = 60) -> Path:
    n = 100
    changes = [retention_shift + 0.001 * ((i % 5) - 2) for i in range(16)]
    arms = [make_arm(root, "one-rank", 1, 100.0, [i < 60 for i in range(n)], [0.0] * 16),
            make_arm(root, "dense", 2, 95.0, [i < dense_correct for i in range(n)], [0.0] * 16),
            make_arm(root, "powersgd", 2, candidate_process_s, [i < candidate_correct for i in range(n)], changes)]
    write_eval(root, "seed", [i < 20 for i in range(n)], None)
    commit_study(root, arms)
    (root / "study.json").write_text(json.dumps({"plan_sha256": "p", "candidate": "powersgd",
                                                 "speed_baseline": "one-rank", "screens": SCREENS,
                                                 "exploratory": False, "arms": arms}))
    return root


def failed_conditions(results: dict, screen: str) -> list[str]:
    return [c["name"] for c in results["screens"][screen]["conditions"] if not c["passed"]]


def test_screens_pass_when_every_condition_holds(tmp_path):
    results = analyze(make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0))
    assert results["screens"]["quality"]["passed"] and results["screens"]["speed"]["passed"]
    speed = results["screens"]["speed"]["speedups"]["powersgd"]
    assert speed["complete_process"] == pytest.approx(100 / 80)
    assert speed["device_seconds_ratio"] == pytest.approx(2 * 80 / 100)
    assert results["arms"][0]["execution"]["sent_bytes"] == 0  # one rank sends nothing
    assert results["arms"][2]["execution"]["network_usd"] == pytest.approx(2 * 2010 / 1e9 * 0.02)


def test_a_candidate_that_fails_exactly_the_retention_condition(tmp_path):
    results = analyze(make_study(tmp_path, candidate_correct=60, retention_shift=0.025, candidate_process_s=80.0))
    assert failed_conditions(results, "quality") == ["retention-change 99% upper bound, nats"]
    assert not results["screens"]["quality"]["passed"] and results["screens"]["speed"]["passed"]


def test_a_candidate_that_fails_exactly_one_paired_condition(tmp_path):
    # 55 vs 60 correct against one rank: 5 discordant pairs, all against the candidate (-5 points);
    # the dense control also has 55, so that comparison is an exact tie.
    results = analyze(make_study(tmp_path, candidate_correct=55, retention_shift=0.0, candidate_process_s=80.0,
                                 dense_correct=55))
    assert failed_conditions(results, "quality") == ["paired 99% lower bound vs one-rank, points"]
    vs_one, vs_dense = results["comparisons"]
    assert vs_one["difference_points"] == pytest.approx(-5.0) and vs_one["discordant"] == 5
    assert vs_dense["discordant"] == 0 and vs_dense["lower_points"] == 0.0


def test_a_slow_candidate_fails_only_the_speed_screen(tmp_path):
    results = analyze(make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=95.0))
    assert results["screens"]["quality"]["passed"]
    assert failed_conditions(results, "speed") == ["complete-process speedup of powersgd over one-rank"]


def test_a_failed_control_is_reported_and_fails_the_quality_screen(tmp_path):
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    study = json.loads((root / "study.json").read_text())
    study["arms"][1]["status"] = "failed"
    (root / "study.json").write_text(json.dumps(study))
    results = write_outputs(root)
    assert [a["status"] for a in results["arms"]] == ["complete", "failed", "complete"]
    assert failed_conditions(results, "quality") == ["paired lower bound vs dense"]
    report = (root / "report.md").read_text()
    assert "**failed**" in report and "| Correct / 100 | 20 | 60 | failed | 60 |" in report
    for plot in ("accuracy_per_family.png", "loss_per_update.png", "bytes_per_update.png"):
        assert (root / "plots" / plot).stat().st_size > 1000


def gain_study(root: Path, seed_correct: int, candidate_correct: int, n: int = 800) -> Path:
    root = make_study(root, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    write_eval(root, "seed", [i < seed_correct for i in range(n)], None)
    for arm in ("one-rank", "dense", "powersgd"):
        write_eval(root, arm, [i < candidate_correct for i in range(n)], [0.001 * ((i % 5) - 2) for i in range(16)])
    commit_study(root, json.loads((root / "study.json").read_text())["arms"])
    return root


def test_an_exact_ten_point_gain_passes_and_one_case_less_fails(tmp_path):
    """113 vs 33 of 800 is +10 points exactly; in floats 100 * (113/800 - 33/800) is 9.999999999999998."""
    assert 100 * (113 / 800 - 33 / 800) < 10
    exact = analyze(gain_study(tmp_path / "exact", 33, 113))
    assert exact["screens"]["quality"]["passed"], exact["screens"]["quality"]["conditions"]
    short = analyze(gain_study(tmp_path / "short", 33, 112))
    assert failed_conditions(short, "quality") == ["accuracy gain over seed, points"]


def test_a_study_without_controls_fails_the_paired_condition(tmp_path):
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    study = json.loads((root / "study.json").read_text())
    study.update(arms=[a for a in study["arms"] if a["name"] == "powersgd"], speed_baseline="powersgd")
    (root / "study.json").write_text(json.dumps(study))
    results = analyze(root)
    assert "paired lower bound vs a control" in failed_conditions(results, "quality")
    assert not results["screens"]["quality"]["passed"]


def test_a_zero_width_interval_is_reported_with_the_cases_one_loss_needs(tmp_path):
    from nshard.analysis.paired import cases_for_one_loss

    # One lost case out of n: lower bound -100 (1 + z) / n points; at 99% and a -3 margin n >= 120.
    assert cases_for_one_loss(-3.0, 0.99) == 120
    lost_one = paired_bounds(*vectors(0, 0, 1, 118), 0.99)  # n = 119
    assert lost_one["lower_points"] <= -3.0
    lost_one = paired_bounds(*vectors(0, 0, 1, 119), 0.99)  # n = 120
    assert lost_one["lower_points"] > -3.0 and lost_one["lower_points"] == pytest.approx(-100 * (1 + Z99) / 120)
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    results = write_outputs(root)
    vs_one = results["comparisons"][0]
    assert vs_one["zero_width"] and vs_one["one_loss_passes_from_n"] == 120
    assert "no discordant pair, so the interval has zero width" in (root / "report.md").read_text()


@pytest.mark.parametrize("damage", ["unpaired", "bad json", "missing"])
def test_bad_study_input_exits_2_with_one_line(tmp_path, damage):
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    cases = root / "eval" / "dense" / "cases.jsonl"
    if damage == "unpaired":
        write_jsonl(cases, [{"case_id": f"other{i:03d}", "family": "lookup", "correct": True} for i in range(100)])
    elif damage == "bad json":
        cases.write_text("{not json\n")
    else:
        cases.unlink()
    proc = subprocess.run([sys.executable, "-m", "nshard.analysis.report", str(root)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("nshard.analysis.report: error:")


# ---------------------------------------------------------------- attacks on commit-before-score

def edit_record(root: Path, edit) -> None:
    """Edit the commitment and recompute its own hash, as a forger would (every summary follows it)."""
    from nshard.evidence.commit import record_sha256

    body = json.loads((root / "commitment.json").read_text())
    edit(body)
    body["record_sha256"] = record_sha256(body)
    (root / "commitment.json").write_text(json.dumps(body))
    for summary in (root / "eval").glob("*/summary.json"):
        s = json.loads(summary.read_text())
        summary.write_text(json.dumps({**s, "commitment": body["record_sha256"]}))


def refused(root: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "nshard.analysis.report", str(root)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    return proc.stderr


def test_a_label_swap_is_refused(tmp_path):
    """The dense arm's scores placed under the candidate's label: the record commits those files as dense."""
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    shutil.rmtree(root / "eval" / "powersgd")
    shutil.copytree(root / "eval" / "dense", root / "eval" / "powersgd")
    err = refused(root)
    assert "eval/powersgd/summary.json" in err and "commits these files as 'dense', not 'powersgd'" in err


def test_laundered_exploratory_scores_make_the_whole_result_exploratory(tmp_path):
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    summary = root / "eval" / "powersgd" / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "commitment": None, "exploratory": True}))
    results = write_outputs(root)
    assert results["exploratory"] and any("eval/powersgd" in r for r in results["exploratory_reasons"])
    assert "EXPLORATORY" in (root / "report.md").read_text()


def test_an_edited_record_with_a_recomputed_hash_is_refused(tmp_path):
    """Its own hash holds, but it no longer binds the models on disk: the candidate's files, then its root."""
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)

    def swap_files(body):
        a, b = body["candidates"][1], body["candidates"][2]
        a["files"], b["files"] = b["files"], a["files"]
    edit_record(root, swap_files)
    assert "does not commit this model" in refused(root)

    root = make_study(tmp_path / "root", candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    edit_record(root, lambda body: body["candidates"][2].update(parameter_root="f" * 64))
    assert "parameter root root-powersgd is not the one" in refused(root)


def test_a_changed_export_is_refused(tmp_path):
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    (root / "arms" / "powersgd" / "model" / "model.safetensors").write_text("other weights")
    assert "does not commit this model" in refused(root)


def test_forged_retention_changes_are_refused(tmp_path):
    """Changes of -5 nats written over the candidate's rows: the report recomputes them from the losses."""
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    path = root / "eval" / "powersgd" / "retention.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    write_jsonl(path, [{**r, "change_nats_per_token": -5.0} for r in rows])
    assert "retention r0: the stored change -5.0 is not the one its losses give" in refused(root)


def test_a_placement_that_cannot_time_the_arms_makes_the_speed_screen_not_comparable(tmp_path):
    """Ranks sharing one machine's cores: the ratios are shown as measured, the screen decides nothing."""
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=95.0)
    study = json.loads((root / "study.json").read_text())
    why = "every rank ran on this machine's CPU"
    (root / "study.json").write_text(json.dumps({**study, "placement": {"kind": "local", "comparable": False,
                                                                         "why": why}}))
    results = write_outputs(root)
    speed = results["screens"]["speed"]
    assert speed["passed"] is None and speed["why"] == why and speed["conditions"][0]["passed"] is None
    assert speed["speedups"]["powersgd"]["complete_process"] == 100.0 / 95.0
    report = (root / "report.md").read_text()
    assert "Speed screen: **NOT COMPARABLE**" in report and why in report and "- NOT COMPARABLE: complete-process" in report


def test_a_candidate_that_is_its_own_speed_baseline_has_no_speed_screen(tmp_path):
    """A second cohort names its candidate as the speed baseline: no ratio of an arm to itself fails (or passes)."""
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=95.0)
    study = json.loads((root / "study.json").read_text())
    (root / "study.json").write_text(json.dumps({**study, "speed_baseline": "powersgd"}))
    speed = write_outputs(root)["screens"]["speed"]
    assert speed["passed"] is None and speed["comparable"] is False and "its own speed baseline" in speed["why"]
    assert speed["conditions"][0]["passed"] is None and "powersgd" not in speed["speedups"]
    assert "Speed screen: **NOT COMPARABLE**" in (root / "report.md").read_text()


def hostfile_placement(tmp_path: Path, lines: str, cuda: bool = False) -> dict:
    """nshard.study.placement.describe for the default arms (one rank, two ranks dense, two ranks PowerSGD) with a
    study.hostfile of these lines, or with none and local GPUs (lines="")."""
    from nshard.run.plan import load_plan
    from nshard.study.placement import describe

    plan = tmp_path / "plan.toml"
    if lines:
        (tmp_path / "hostfile").write_text(lines)
    plan.write_text(f'[study]\nhostfile = "{tmp_path / "hostfile"}"\n' if lines else "")
    return describe(load_plan(plan), cuda=cuda)


@pytest.mark.parametrize("lines", ["localhost slots=2\n", "# one GPU host\ngpu-a slots=2\n"])
def test_a_hostfile_of_one_host_makes_the_speed_screen_not_comparable(tmp_path, lines):
    """Every rank of the two-rank arms on one host: no link between them, unlike the reference's two hosts."""
    placement = hostfile_placement(tmp_path, lines)
    host = lines.split()[-2]
    assert placement["comparable"] is False and f"one host ({host}" in placement["why"]
    assert "dense, powersgd" in placement["why"] and "launch/hostfile.two-hosts" in placement["why"]
    root = make_study(tmp_path / "study", candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    study = json.loads((root / "study.json").read_text())
    (root / "study.json").write_text(json.dumps({**study, "placement": placement}))
    speed = write_outputs(root)["screens"]["speed"]
    assert speed["passed"] is None and speed["why"] == placement["why"]
    assert "Speed screen: **NOT COMPARABLE**" in (root / "report.md").read_text()


def test_a_hostfile_of_two_hosts_lets_the_speed_screen_decide(tmp_path):
    placement = hostfile_placement(tmp_path, "gpu-a slots=1\ngpu-b slots=1\n")
    assert placement["comparable"] is True and placement["hosts"] == ["gpu-a", "gpu-b"]
    root = make_study(tmp_path / "study", candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    study = json.loads((root / "study.json").read_text())
    (root / "study.json").write_text(json.dumps({**study, "placement": placement}))
    assert write_outputs(root)["screens"]["speed"]["passed"] is True  # 100 s against 80 s clears 1.10x
    assert "Placement: the hosts of" in (root / "report.md").read_text()


def test_local_gpus_share_one_host_so_their_speed_screen_is_not_comparable(tmp_path):
    placement = hostfile_placement(tmp_path, "", cuda=True)
    assert placement["kind"] == "local" and placement["comparable"] is False and "GPUs" in placement["why"]


def test_the_shipped_two_host_example_is_comparable_and_the_shipped_hostfile_is_not(tmp_path):
    from nshard.run.plan import load_plan
    from nshard.study.placement import describe

    study = load_plan(REPO / "launch" / "plans" / "study.toml")  # names the checkout's hostfile: localhost slots=2
    assert describe(study, cuda=True)["comparable"] is False
    shutil.copyfile(REPO / "launch" / "hostfile.two-hosts", tmp_path / "hostfile")
    assert hostfile_placement(tmp_path, (tmp_path / "hostfile").read_text())["comparable"] is True


def test_the_commitment_anchor_goes_into_the_results_and_one_for_another_record_is_refused(tmp_path):
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    assert write_outputs(root)["commitment_anchor"] is None  # no store configured: nothing anchored
    record = json.loads((root / "commitment.json").read_text())["record_sha256"]
    anchor = {"uri": f"s3://bucket/commitment/{record[:16]}", "index_sha256": "i" * 64, "record_sha256": record,
              "commitment_json_sha256": "c" * 64, "stored_at": "2026-12-01T10:00:00+00:00", "clock": "s3-server"}
    (root / "anchor.json").write_text(json.dumps(anchor))
    write_outputs(root)
    assert json.loads((root / "results.json").read_text())["commitment_anchor"] == anchor
    assert (f"commitment anchored before scoring in `{anchor['uri']}` (index `{'i' * 64}`), stored at "
            "2026-12-01T10:00:00+00:00 (s3-server clock)") in (root / "report.md").read_text()
    (root / "anchor.json").write_text(json.dumps({**anchor, "record_sha256": "0" * 64}))
    err = refused(root)
    assert "anchor.json anchors record 0000000000000000, not commitment.json's" in err


def own_data_study(root: Path, candidate_shift: float) -> Path:
    """A study on own data whose held-out rows carry no expected answer: no case, only held-out losses (the seed's
    0.5 nats per response token, every trained arm's 0.3, the candidate's shifted per row by candidate_shift)."""
    root = make_study(root, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    study = json.loads((root / "study.json").read_text())
    study["screens"] = {**SCREENS, "min_heldout_gain_nats": 0.0, "max_heldout_paired_upper_nats": 0.02}
    (root / "study.json").write_text(json.dumps(study))
    for name in ("seed", "one-rank", "dense", "powersgd"):
        d = root / "eval" / name
        write_jsonl(d / "cases.jsonl", [])
        loss = 0.5 if name == "seed" else 0.3 + (candidate_shift if name == "powersgd" else 0.0)
        write_jsonl(d / "heldout.jsonl", [{"doc_id": f"h{i}", "nll_sum": 20 * (loss + 0.01 * (i % 3)),
                                           "target_weight": 20.0} for i in range(12)])
    write_validation(root, ["seed", "one-rank", "dense", "powersgd"])
    return root


def test_a_study_on_own_data_is_screened_on_held_out_loss(tmp_path):
    results = write_outputs(own_data_study(tmp_path / "good", 0.0))
    quality = results["screens"]["quality"]
    assert quality["passed"], quality["conditions"]
    names = [c["name"] for c in quality["conditions"]]
    assert "accuracy gain over seed, points" not in names and not results["comparisons"]
    assert "held-out loss gain over seed, nats per response token" in names
    assert results["seed"]["heldout"]["loss_per_token"] == pytest.approx(0.51)
    report = (tmp_path / "good" / "report.md").read_text()
    assert "| Own held-out loss per response token (12 rows), nats | 0.510000 | 0.310000 |" in report
    assert "| Correct /" not in report
    # 0.05 nats per token worse than both controls on every row: still better than the seed, but not noninferior.
    worse = analyze(own_data_study(tmp_path / "worse", 0.05))
    assert failed_conditions(worse, "quality") == [
        "held-out paired 99% upper bound vs one-rank, nats per response token",
        "held-out paired 99% upper bound vs dense, nats per response token"]


# ---------------------------------------------------------------- scores that validation did not pass


def test_a_score_changed_after_validation_is_refused_naming_the_evaluation_and_case(tmp_path):
    """A control made worse helps the candidate as much as a candidate made better: both are refused, and so is a
    retention loss lowered after validation."""
    for label, index in (("powersgd", 70), ("dense", 10)):  # wrong -> right in the candidate, right -> wrong in a control
        root = make_study(tmp_path / label, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
        path = root / "eval" / label / "cases.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[index]["correct"] = not rows[index]["correct"]
        write_jsonl(path, rows)
        assert (f"evaluation {label}, case c{index:03d}: correct={rows[index]['correct']}, but validation found "
                f"{not rows[index]['correct']}") in refused(root)
    root = make_study(tmp_path / "retention", candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    path = root / "eval" / "powersgd" / "retention.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[3] = {**rows[3], "nll_sum": rows[3]["nll_sum"] - 1.0, "change_nats_per_token": rows[3]["change_nats_per_token"]
               - 0.1}
    write_jsonl(path, rows)
    assert "evaluation powersgd, retention r3: nll_sum=" in refused(root)


def test_a_held_out_loss_changed_after_validation_is_refused(tmp_path):
    """Own data: the held-out losses enter the quality screen, so they too must be the ones validation checked."""
    root = own_data_study(tmp_path / "changed", 0.0)
    path = root / "eval" / "powersgd" / "heldout.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[2] = {**rows[2], "nll_sum": rows[2]["nll_sum"] - 1.0}
    write_jsonl(path, rows)
    assert "evaluation powersgd, heldout h2: nll_sum=" in refused(root)
    root = own_data_study(tmp_path / "unchecked", 0.0)
    validation = json.loads((root / "validation.json").read_text())
    del validation["evaluations"]["dense"]["heldout_docs_checked"]
    (root / "validation.json").write_text(json.dumps(validation))
    assert "evaluation dense: holds held-out rows that validation did not check" in refused(root)


@pytest.mark.parametrize("validation", ["missing", "failed", "without the candidate"])
def test_a_study_whose_validation_did_not_pass_is_refused(tmp_path, validation):
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    if validation == "missing":
        (root / "validation.json").unlink()
        want = "validation.json is missing: the scores were never validated"
    elif validation == "failed":
        (root / "validation.json").write_text(json.dumps({"passed": False, "error": "validation failed: powersgd: "
                                                                                    "lookup-s1-000001: differs"}))
        want = "validation did not pass (validation failed: powersgd: lookup-s1-000001: differs)"
    else:
        write_validation(root, ["seed", "one-rank", "dense"])
        want = "does not cover evaluation powersgd"
    assert want in refused(root)


def test_validation_without_regeneration_makes_the_result_exploratory(tmp_path):
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    write_validation(root, ["seed", "one-rank", "dense", "powersgd"], regenerated=False)
    results = write_outputs(root)
    assert results["exploratory"] and "validation did not generate the answers again" in results["exploratory_reasons"][0]
    assert "EXPLORATORY" in (root / "report.md").read_text()


def test_a_sparse_arm_gets_an_expert_load_plot(tmp_path):
    root = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    metrics = Path(json.loads((root / "study.json").read_text())["arms"][2]["run_dir"]) / "metrics.jsonl"
    write_jsonl(metrics, [{"update": u, "loss": 2.0 - u / 4, "expert_load": [[5, 3, 0, 8], [4, 4, 4, 4]]}
                          for u in (1, 2)])
    results = write_outputs(root)
    assert "plots/expert_load.png" in json.loads((root / "results.json").read_text())["plots"]
    assert (root / "plots" / "expert_load.png").stat().st_size > 1000 and results["arms"][2]["metrics"]


# ---------------------------------------------------------------- declared power


def test_the_power_of_an_equal_candidate_is_every_outcome_summed_by_hand():
    """Enumerate every outcome of n cases (each +1, −1 or 0: a win, a loss or agreement) with its probability and
    pass it through mean_interval: the closed sum of equal_pass_probability gives the same probability."""
    import itertools

    from nshard.analysis.paired import equal_pass_probability, two_sided_z

    for n, p, margin in ((5, 0.3, -40.0), (6, 0.5, -25.0), (7, 0.2, -10.0)):
        z, total = two_sided_z(0.9), 0.0
        for outcome in itertools.product((1, -1, 0), repeat=n):
            prob = math.prod(p / 2 if d else 1 - p for d in outcome)
            mean = sum(outcome) / n
            sd = math.sqrt(sum((d - mean) ** 2 for d in outcome) / (n - 1))
            total += prob * (100 * (mean - z * sd / math.sqrt(n)) > margin)
        assert equal_pass_probability(n, p, margin, 0.9) == pytest.approx(total, abs=1e-12), (n, p, margin)


def test_the_power_agrees_with_simulated_screens_and_names_the_cases_that_reach_90_percent():
    import numpy as np

    from nshard.analysis.paired import cases_for_power, declared_power, equal_pass_probability

    rng = np.random.default_rng(0)
    n, p, draws = 128, 5 / 128, 4000
    passes = 0
    for _ in range(draws):
        u = rng.random(n)
        cand = {f"c{i}": bool(u[i] < p / 2) for i in range(n)}  # a win
        ctrl = {f"c{i}": bool(p / 2 <= u[i] < p) for i in range(n)}  # a loss
        passes += paired_bounds(cand, ctrl, 0.99)["lower_points"] > -3.0
    exact = equal_pass_probability(n, p, -3.0, 0.99)
    assert abs(passes / draws - exact) < 4 * math.sqrt(exact * (1 - exact) / draws)
    needed = cases_for_power(p, -3.0, 0.99, 0.90, at_least=n)
    assert equal_pass_probability(needed, p, -3.0, 0.99) >= 0.90 > equal_pass_probability(needed - 1, p, -3.0, 0.99)
    low = declared_power(n, p, -3.0, 0.99)
    assert low["equal_pass_probability"] < 0.80 and low["cases_for_90"] == needed
    assert low["note"].startswith("underpowered: a candidate equal to its control passes only") and str(needed) in low["note"]
    assert declared_power(n, 0.0, -3.0, 0.99)["equal_pass_probability"] is None


def test_the_report_carries_the_declared_power_beside_each_paired_screen(tmp_path):
    study = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    record = json.loads((study / "study.json").read_text())
    record["screens"] = {**SCREENS, "expected_discordance": 0.05}
    (study / "study.json").write_text(json.dumps(record))
    results = analyze(study)
    powers = {p["screen"]: p for p in results["declared_power"]}
    assert set(powers) == {"paired lower bound vs one-rank", "paired lower bound vs dense"}
    assert all(p["n"] == 100 and 0 < p["equal_pass_probability"] < 0.8 for p in powers.values())
    from nshard.analysis.report import render_report

    report = render_report(results)
    assert "Declared power of the paired screens" in report and "expected discordance 5.00%" in report
    assert "underpowered" in report
    undeclared = analyze(make_study(tmp_path / "b", candidate_correct=60, retention_shift=0.0,
                                    candidate_process_s=80.0))
    assert all(p["equal_pass_probability"] is None for p in undeclared["declared_power"])


def test_the_report_splits_each_arms_median_update_by_phase_and_names_what_does_not_shrink(tmp_path):
    """The execution section gets each arm's median update by phase (compressed updates where there are any) and
    the largest phase of the candidate's that stays at 90% or more of the speed baseline's: what more ranks cannot
    buy back. Receipts without phases leave the section out."""
    from nshard.analysis.report import phase_table, render_report

    study = make_study(tmp_path, candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    split = {"one-rank": ("dense", {"forward_backward": 8.0, "reducer_compute": 0.0, "collective_wait": 0.0,
                                    "optimizer_step": 0.5, "parameter_sync": 0.0, "rest": 0.1}),
             "dense": ("dense", {"forward_backward": 4.0, "reducer_compute": 0.2, "collective_wait": 3.0,
                                 "optimizer_step": 0.5, "parameter_sync": 0.0, "rest": 0.1}),
             "powersgd": ("compressed", {"forward_backward": 4.0, "reducer_compute": 0.9, "collective_wait": 0.4,
                                         "optimizer_step": 0.5, "parameter_sync": 0.0, "rest": 0.1})}
    for arm, (kind, phases) in split.items():
        for path in (study / "arms" / arm / "receipts").glob("rank-*.json"):
            receipt = json.loads(path.read_text())
            receipt["by_phase"][kind] = {"updates": 2, "median_update_s": sum(phases.values()),
                                         "median_phase_s": phases}
            path.write_text(json.dumps(receipt))
    results = analyze(study)
    lines = phase_table(results)
    assert lines[0] == "| Median update by phase, s (slowest rank) | one-rank (dense) | dense (dense) | powersgd (compressed) |"
    assert "| collective_wait | 0.000 | 3.000 | 0.400 |" in lines and "| total | 8.600 | 7.800 | 5.900 |" in lines
    # reducer_compute (0.9 s), which one rank does not have, is the largest phase that did not shrink; the
    # optimizer step (0.5 s: every rank steps the whole model at stage 0) did not shrink either
    assert lines[-1] == ("Largest phase that does not shrink with more ranks: **reducer_compute**, 0.900 s in "
                         "powersgd's median update against 0.000 s in one-rank's.")
    assert "Median update by phase" in render_report(results)
    from nshard.analysis.report import write_plots

    assert (tmp_path / "plots" / "update_phases.png") in write_plots(results, tmp_path / "plots")
    assert phase_table(analyze(make_study(tmp_path / "b", candidate_correct=60, retention_shift=0.0,
                                          candidate_process_s=80.0))) == []
