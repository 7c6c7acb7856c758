"""The whole study on the tiny plan: arms, commitment, scoring, validation, analysis; then what must be refused."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from nshard.evidence.archive import verify
from nshard.evidence.commit import CommitError, load_commitment, model_files
from nshard.study.evaluate import read_jsonl
from nshard.run.models import load_tokenizer, resolve_model
from nshard.study.validate import ValidationError, validate
from runs import REPO, run_env, tiny_config
from stores import ACCESS_KEY, BUCKET, SECRET_KEY, aws_env

pytestmark = pytest.mark.slow


def study_plan(tmp: Path, store: str) -> Path:
    """The tiny plan, four arms: the usual three (PowerSGD compressing after one dense update) and one that fails;
    the record, models and evidence go to `store`; the 16 cases are scored in 4 batches."""
    (tmp / "dense.json").write_text(json.dumps(tiny_config("dense")))
    (tmp / "powersgd.json").write_text(json.dumps(tiny_config("dense", nshard={
        "reducer": "powersgd", "rank": 4, "dense_warmup_updates": 1})))
    (tmp / "broken.json").write_text(json.dumps(tiny_config("dense", nshard={"reducer": "powersgd", "rank": 0})))
    arms = "".join(f'\n[[study.arms]]\nname = "{n}"\nranks = {r}\nds_config = "{tmp / c}"\n'
                   for n, r, c in (("one-rank", 1, "dense.json"), ("dense", 2, "dense.json"),
                                   ("powersgd", 2, "powersgd.json"), ("broken", 2, "broken.json")))
    plan = tmp / "tiny-study.toml"
    plan.write_text((REPO / "launch/plans/tiny.toml").read_text()
                    + '\n[study]\ncandidate = "powersgd"\nspeed_baseline = "one-rank"\neval_max_new_tokens = 12\n'
                    + 'eval_batch_size = 4\n'  # 16 cases in 4 scoring batches
                    + f'store = "{store}"\n' + arms)
    return plan


def run_study(study: dict, out: Path, *extra, endpoint: str | None = None) -> subprocess.CompletedProcess:
    aws = {**study["aws"], **({"AWS_ENDPOINT_URL": endpoint} if endpoint else {})}
    proc = subprocess.run([sys.executable, "-m", "nshard.study", "--plan", str(study["plan"]), "--out", str(out),
                           *extra], cwd=REPO, env=run_env(aws), capture_output=True, text=True, timeout=900)
    assert SECRET_KEY not in proc.stdout + proc.stderr and ACCESS_KEY not in proc.stdout + proc.stderr
    return proc


def verify_stored(aws: dict, uri: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nshard.evidence.store", "verify", uri], env=run_env(aws),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def study(tmp_path_factory, moto):
    """One study, its store a fresh prefix on the moto S3 server (the endpoint and keys from the environment)."""
    tmp = tmp_path_factory.mktemp("study")
    store = f"s3://{BUCKET}/study-{uuid.uuid4().hex[:12]}"
    aws = {k: v for k, v in aws_env(moto.url, tmp).items() if k.startswith("AWS_")}
    study = {"plan": study_plan(tmp, store), "out": tmp / "out", "store": store, "aws": aws}
    proc = run_study(study, study["out"])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: the broken arm failed
    out = study["out"]
    first_eval_ns = min(p.stat().st_mtime_ns for p in (out / "eval").rglob("*") if p.is_file())
    return {**study, "proc": proc, "anchor_before_eval": (out / "anchor.json").stat().st_mtime_ns <= first_eval_ns}


def test_the_study_writes_its_outputs_and_reports_the_failed_arm(study):
    out, stdout = study["out"], study["proc"].stdout
    results = json.loads((out / "results.json").read_text())
    assert [a["name"] for a in results["arms"]] == ["one-rank", "dense", "powersgd", "broken"]
    for arm in results["arms"][:3]:
        assert arm["status"] == "complete" and len(arm["parameter_root"]) == 64
        assert 0.0 <= arm["accuracy"] <= 1.0 and set(arm["per_family"]) == {"lookup", "filtering", "sorting", "invoice"}
    broken = results["arms"][3]
    assert broken["status"] == "failed" and Path(broken["log"]).is_file()
    assert "nshard: error: " in Path(broken["log"]).read_text() and "nshard.rank is 0" in Path(broken["log"]).read_text()
    assert isinstance(results["screens"]["quality"]["passed"], bool) and results["screens"]["quality"]["conditions"]
    # Every rank on this machine's CPU: the speed screen says it cannot compare the arms, and why.
    speed = results["screens"]["speed"]
    assert speed["passed"] is None and not speed["comparable"] and "split the cores" in speed["why"]
    assert results["placement"]["kind"] == "local" and speed["speedups"]["powersgd"]["complete_process"] > 0
    # ... and the study said so before its first arm, not only in the report at the end.
    before_arms = stdout.split("[study] arm ")[0].splitlines()
    assert "[study] placement: every rank on this machine" in before_arms
    assert f"nshard: warning: the speed screen will read NOT COMPARABLE: {speed['why']}" in study["proc"].stderr
    assert not results["screens"]["quality"]["passed"]  # a control failed: no non-inferiority claim against it
    record = load_commitment(out / "commitment.json")
    assert results["commitment_sha256"] == record["record_sha256"]
    assert [c["name"] for c in record["candidates"]] == ["one-rank", "dense", "powersgd"]
    assert json.loads((out / "validation.json").read_text())["passed"]
    assert "| Fresh task cases | seed | one-rank | dense | powersgd | broken |" in stdout
    report = (out / "report.md").read_text()
    assert "Quality screen" in report and "Speed screen: **NOT COMPARABLE**" in report and "**failed**" in report
    assert "Placement: every rank on this machine." in report
    assert {p.name for p in (out / "plots").glob("*.png")} == {"accuracy_per_family.png", "loss_per_update.png",
                                                              "bytes_per_update.png", "update_phases.png"}
    # Every arm records the AdamW implementation it ran, the same for all three (the baseline is not slowed).
    assert {a["execution"]["optimizer"] for a in results["arms"][:3]} == {"torch AdamW, fused"}
    assert "| AdamW implementation | torch AdamW, fused | torch AdamW, fused | torch AdamW, fused | failed |" in report
    # ds_configs/dense.json reduces with DeepSpeed's own all-reduce, except on one rank, which reduces nothing
    # (nshard/seam/engine.py one_rank_skips); nshard's PowerSGD after the last backward.
    assert "| Gradient reduction starts | none: one rank | DeepSpeed's own reduction | after the last " \
        "backward | failed |" in report
    # Where each second went, from the arms' own phase receipts: every finished arm has a column.
    assert "| Median update by phase, s (slowest rank) | one-rank (dense) | dense (dense) | powersgd (compressed) |" \
        in report and "Largest phase that does not shrink with more ranks" in report
    # Only the candidate keeps its final complete state (a second cohort continues from it).
    arms = {a["name"]: a for a in json.loads((out / "study.json").read_text())["arms"]}
    assert arms["powersgd"]["state"]["kept"] and (out / "arms/powersgd/state").is_dir()
    for name in ("one-rank", "dense"):
        assert not arms[name]["state"]["kept"] and arms[name]["state"]["removed_bytes"] > 0
        assert not (out / "arms" / name / "state").exists()
    receipts = [json.loads(p.read_text()) for p in (out / "arms/powersgd/receipts").glob("rank-*.json")]
    assert all(any(r["update_compressed"]) for r in receipts)
    # The commitment was written before any score: every evaluation names it.
    for label in ("seed", "one-rank", "dense", "powersgd"):
        assert json.loads((out / "eval" / label / "summary.json").read_text())["commitment"] == record["record_sha256"]
    # The tiny study's scoring is too small to be worth a process per core (tests/test_generate.py runs scoring and
    # regeneration side by side); validation regenerates each model's answers at the thread count scoring had.
    from nshard.study.evaluate import side_by_side_layout

    assert side_by_side_layout(16, 4, 12, cuda=False)[0] == 1 and "scoring 4 models in" not in stdout
    regenerated = json.loads((out / "validation.json").read_text())["evaluations"]
    for label in ("seed", "one-rank", "dense", "powersgd"):
        summary = json.loads((out / "eval" / label / "summary.json").read_text())
        assert summary["processes"] == 1 and regenerated[label]["regenerated"]["threads"] == summary["threads"]


# ---------------------------------------------------------------- a second cohort from this study


def cohort_cli(study_dir: Path, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nshard.study.cohort", str(study_dir), *extra], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=300)


def cohort_plan(tmp: Path, study_dir: Path, start: str = "state", extra: str = "") -> Path:
    """The tiny plan teaching the second cohort's families from `study_dir`'s candidate."""
    text = (REPO / "launch/plans/tiny.toml").read_text().replace("eval_seed = 7007", "eval_seed = 7107")
    text = text.replace("[data]\n", '[data]\nfamilies = ["cheapest", "acronym"]\n')
    plan = tmp / f"cohort-{start}.toml"
    plan.write_text(text + f'\n[cohort]\nfrom = "{study_dir}"\nstart = "{start}"\nfirst_cohort_eval_cases_per_family = 2\n'
                    + extra)
    return plan


@pytest.fixture(scope="module")
def accepted(study, tmp_path_factory):
    """A copy of the study whose candidate passes: its declared screens made lenient and the broken arm left out
    before the analysis ran again (the trained arms, the record and the scores are the study's own)."""
    out = tmp_path_factory.mktemp("accepted") / "study"
    shutil.copytree(study["out"], out, ignore=shutil.ignore_patterns("evidence.tar*"))
    body = json.loads((out / "study.json").read_text())
    body["arms"] = [a for a in body["arms"] if a["name"] != "broken"]
    body["screens"].update(min_accuracy_gain_points=-100.0, max_retention_upper_nats=100.0,
                           min_paired_lower_points=-100.0)
    (out / "study.json").write_text(json.dumps(body))
    proc = subprocess.run([sys.executable, "-m", "nshard.analysis.report", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "results.json").read_text())["screens"]["quality"]["passed"] is True
    return out


def test_a_cohort_from_an_unaccepted_study_is_refused_with_one_error(study, tmp_path):
    """The study's candidate failed its quality screen: the check, the study runner and the trainer all refuse."""
    proc = cohort_cli(study["out"])
    assert proc.returncode == 2 and "did not pass its quality screen" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    plan = cohort_plan(tmp_path, study["out"])
    runner = subprocess.run([sys.executable, "-m", "nshard.study", "--plan", str(plan), "--out", str(tmp_path / "out")],
                            cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert runner.returncode == 2 and "did not pass its quality screen" in runner.stderr, runner.stderr[-2000:]
    assert not (tmp_path / "out" / "arms").exists()
    trainer = subprocess.run([sys.executable, str(REPO / "nshard/train.py"), "--plan", str(plan), "--ds_config",
                              str(study["plan"].parent / "powersgd.json"), "--out", str(tmp_path / "run")],
                             cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert trainer.returncode == 2 and "did not pass its quality screen" in trainer.stderr, trainer.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_an_accepted_study_is_accepted_with_its_provenance(accepted):
    proc = cohort_cli(accepted)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    committed = load_commitment(accepted / "commitment.json")
    candidate = next(c for c in committed["candidates"] if c["name"] == "powersgd")
    assert record["first_commitment_sha256"] == committed["record_sha256"]
    assert record["candidate"] == "powersgd" and record["candidate_parameter_root"] == candidate["parameter_root"]
    assert record["candidate_files"] == candidate["files"] == model_files(accepted / "arms/powersgd/model")
    assert record["state"] == "update-000003"
    assert record["state_world_size"] == 2 and record["elastic_ranks"] == []
    # an arm on one rank continues the two-rank state by the elastic rule, and the record says so
    one = cohort_cli(accepted, "--ranks", "1")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["state_world_size"] == 2 and json.loads(one.stdout)["elastic_ranks"] == [1]


def edited_copy(accepted: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "study"
    shutil.copytree(accepted, copy)
    edit(copy)
    return copy


def test_a_cohort_from_a_tampered_export_is_refused(accepted, tmp_path):
    def flip(copy):
        weights = copy / "arms/powersgd/model/model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-10] ^= 0x01
        weights.write_bytes(bytes(data))
    proc = cohort_cli(edited_copy(accepted, tmp_path, flip))
    assert proc.returncode == 2 and "is not what the study committed and judged" in proc.stderr, proc.stderr
    assert "model.safetensors" in proc.stderr


def test_a_cohort_from_an_uncommitted_candidate_is_refused(accepted, tmp_path):
    """A record (its own hash made whole again) that names the other arms but not the candidate."""
    from nshard.evidence.commit import record_sha256

    def drop(copy):
        body = json.loads((copy / "commitment.json").read_text())
        body["candidates"] = [c for c in body["candidates"] if c["name"] != "powersgd"]
        body["record_sha256"] = record_sha256(body)
        (copy / "commitment.json").write_text(json.dumps(body))
    proc = cohort_cli(edited_copy(accepted, tmp_path, drop))
    assert proc.returncode == 2 and "'powersgd' is not committed by" in proc.stderr, proc.stderr


def test_a_cohort_from_results_the_files_do_not_give_is_refused(accepted, tmp_path):
    """One score flipped in the candidate's cases: not the one validation checked. Then the files left alone and
    results.json's screen edited: the analysis recomputed no longer gives it."""
    def flip(copy):
        path = copy / "eval/powersgd/cases.jsonl"
        rows = read_jsonl(path)
        rows[0]["correct"] = not rows[0]["correct"]
        flip.case = rows[0]["case_id"]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = cohort_cli(edited_copy(accepted, tmp_path / "flipped", flip))
    assert proc.returncode == 2 and "the study's results do not validate" in proc.stderr, proc.stderr
    assert f"evaluation powersgd, case {flip.case}: correct=" in proc.stderr, proc.stderr

    def screen(copy):
        body = json.loads((copy / "results.json").read_text())
        body["screens"]["quality"]["conditions"][0]["value"] += 1.0
        (copy / "results.json").write_text(json.dumps(body))
    proc = cohort_cli(edited_copy(accepted, tmp_path / "screen", screen))
    assert proc.returncode == 2 and "quality screen is not the one the study's files give" in proc.stderr, proc.stderr


def test_a_cohort_from_the_state_continues_the_optimizer_and_error_memory_bit_for_bit(accepted, tmp_path):
    """start = "state": the trainer's record of what it loaded equals what the state's files hold (read here); its
    first update compresses (no second dense warm-up) and steps with the cohort's schedule, not the decayed one."""
    import torch

    from nshard.run.start import reducer_part, tree_sha256
    from runs import launch

    ds = study_ds_config(accepted)
    out = tmp_path / "run"
    launch(out, ds, world=2, plan=cohort_plan(tmp_path, accepted))
    run = json.loads((out / "run.json").read_text())
    start = run["cohort"]["start"]
    state = accepted / "arms/powersgd/state/update-000003"
    saved = torch.load(state / "deepspeed/mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    reducer = {k: v for k, v in reducer_part(torch.load(state / "rank-0.pt", weights_only=False)["seam"]).items()
               if k != "updates"}
    assert start["kind"] == "state" and start["optimizer_state_matches"] and start["reducer_state_matches"]
    assert start["optimizer_state_sha256"] == tree_sha256(saved["optimizer"]["state"])
    assert start["reducer_state_sha256"] == tree_sha256(reducer)
    assert start["parameter_root"] == run["cohort"]["parameter_root"]
    assert run["cohort"]["commitment_sha256"] == load_commitment(accepted / "commitment.json")["record_sha256"]
    receipts = [json.loads(p.read_text()) for p in (out / "receipts").glob("rank-*.json")]
    assert all(r["update_compressed"][0] for r in receipts)
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    fresh = json.loads((accepted / "arms/powersgd/metrics.jsonl").read_text().splitlines()[0])
    assert first["lr"] == fresh["lr"]
    sets = json.loads((out / "prepared/sets.json").read_text())
    assert sets["cohort"]["candidate"] == "powersgd" and len(sets["cohort"]["first_cohort_replay_ids"]) == 12
    trained = {json.loads(line)["doc_id"] for line in (out / "prepared/documents.jsonl").read_text().splitlines()}
    first_eval = set(json.loads((accepted / "arms/powersgd/prepared/sets.json").read_text())["eval_case_ids"])
    assert not trained & (first_eval | set(sets["eval_case_ids"]))
    assert set(sets["cohort"]["first_cohort_replay_ids"]) <= trained


def test_a_cohort_from_a_two_rank_state_continues_on_one_rank_by_the_elastic_rule(accepted, tmp_path):
    """A cohort plan may continue on another world size than its first cohort's: the candidate's two-rank state goes
    on one rank, its optimizer state loaded whole and its error memory the mean of the two ranks' (the error-feedback
    total recorded before and after), and the run.json start record names the change."""
    from runs import launch

    out = tmp_path / "run"
    launch(out, study_ds_config(accepted), world=1, plan=cohort_plan(tmp_path, accepted))
    start = json.loads((out / "run.json").read_text())["cohort"]["start"]
    assert start["kind"] == "state" and start["elastic"]["from_world_size"] == 2
    assert start["elastic"]["to_world_size"] == 1
    errors = start["elastic"]["error_memory"]
    # the fp64 mean rounded once to fp32: at most half an ulp of each element apart (tests/test_elastic.py checks it
    # element by element)
    assert errors["max_abs_difference"] <= 1e-6 and "mean of the saved ranks' errors" in errors["rule"]
    # the mean is kept, not the sum: a rule that summed the two ranks' errors would double the total
    assert abs(errors["after"]["sum"] - errors["before"]["sum"]) <= 1e-6 * max(1.0, abs(errors["before"]["sum"]))
    receipt = json.loads((out / "receipts/rank-0.json").read_text())
    assert receipt["world_size"] == 1 and receipt["update_compressed"][0]  # it compresses from its first update


def test_a_cohort_from_the_state_runs_a_second_dense_warm_up_only_when_asked(accepted, tmp_path):
    from runs import launch

    out = tmp_path / "run"
    launch(out, study_ds_config(accepted), world=2, plan=cohort_plan(tmp_path, accepted, extra="dense_warmup = true\n"))
    start = json.loads((out / "run.json").read_text())["cohort"]["start"]
    assert start["dense_warmup"] and start["optimizer_state_matches"] and start["reducer_state_matches"]
    receipts = [json.loads(p.read_text()) for p in (out / "receipts").glob("rank-*.json")]
    assert [r["update_compressed"][:2] for r in receipts] == [[False, True]] * 2  # the ds_config's one dense update


def test_a_cohort_from_the_weights_starts_a_fresh_optimizer(accepted, tmp_path):
    from runs import launch

    out = tmp_path / "run"
    launch(out, study_ds_config(accepted), world=2, plan=cohort_plan(tmp_path, accepted, start="weights"))
    run = json.loads((out / "run.json").read_text())
    assert run["cohort"]["start"] == {"kind": "weights", "parameter_root": run["cohort"]["parameter_root"]}
    receipts = [json.loads(p.read_text()) for p in (out / "receipts").glob("rank-*.json")]
    assert not any(r["update_compressed"][0] for r in receipts)  # a fresh reducer's dense warm-up update


def test_a_cohort_study_on_the_tiny_model_runs_end_to_end_and_checks_its_provenance(accepted, tmp_path):
    """The runner on a cohort plan: accepted, the candidate and a no-replay control trained from the state, an arm
    interpolated between the accepted checkpoint and the candidate, all committed with the accepted candidate as their
    seed, scored (held-out retention documents beside the exposed ones), validated and judged on the cohort's screens;
    an edited link of the chain stops the analysis."""
    ds = study_ds_config(accepted)
    arm = (f'\n[[study.arms]]\nname = "powersgd"\nranks = 2\nds_config = "{ds}"\n'
           f'\n[[study.arms]]\nname = "no-replay"\nranks = 2\nds_config = "{ds}"\nreplay = false\n'
           '\n[[study.arms]]\nname = "mix"\ninterpolate = "powersgd"\nalpha = 0.75\n')
    # replay by family: every screened family whole (the accepted study answered each at least 0%: all are
    # screened), each replayed response token weighing 3
    plan = cohort_plan(tmp_path, accepted, extra='first_cohort_response_weight = 3.0\n[cohort.replay_cases]\n'
                       'lookup = 6\nfiltering = 6\nsorting = 6\ninvoice = 6\n')
    plan.write_text(plan.read_text().replace("retention_docs = 4\n", "retention_docs = 4\nheldout_retention_docs = 3\n")
                    + '\n[study]\ncandidate = "powersgd"\nspeed_baseline = "powersgd"\n'
                    'eval_max_new_tokens = 12\n' + arm)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "nshard.study", "--plan", str(plan), "--out", str(out)], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.index("second cohort from powersgd") < proc.stdout.index("arm powersgd: training")
    results = json.loads((out / "results.json").read_text())
    first = load_commitment(accepted / "commitment.json")
    accepted_files = next(c for c in first["candidates"] if c["name"] == "powersgd")["files"]
    assert load_commitment(out / "commitment.json")["seed"]["files"] == accepted_files
    prov = results["provenance"]
    assert prov["first_commitment_sha256"] == first["record_sha256"] and prov["accepted_candidate"] == "powersgd"
    assert prov["cohort_commitment_sha256"] == results["commitment_sha256"]
    names = [c["name"] for c in results["screens"]["quality"]["conditions"]]
    assert names == ["new-task accuracy gain over the accepted checkpoint, points",
                     "first-cohort paired 99% lower bound vs the accepted checkpoint, points",
                     "retention-change 99% upper bound vs the accepted checkpoint, nats",
                     "held-out retention-change 99% upper bound vs the accepted checkpoint, nats"]
    # Replay by family: the counts and the weight recorded in the sets, each replayed case trained at weight 3.
    sets = json.loads((out / "arms/powersgd/prepared/sets.json").read_text())
    assert sets["cohort"]["first_cohort_replay_counts"] == {"lookup": 6, "filtering": 6, "sorting": 6, "invoice": 6}
    docs = {d["doc_id"]: d for d in map(json.loads, (out / "arms/powersgd/prepared/documents.jsonl").read_text()
                                        .splitlines())}
    replayed = sets["cohort"]["first_cohort_replay_ids"]
    assert len(replayed) == 24 and {max(docs[i]["weights"]) for i in replayed} == {3.0}
    assert {max(d["weights"]) for d in docs.values() if d["kind"] == "task" and d["doc_id"] not in replayed} == {1.0}
    # Held-out retention documents: prepared, never in the schedule, scored and validated like the exposed ones.
    held = sets["retention_heldout_ids"]
    order = list(docs)
    scheduled = {order[i] for batch in json.loads((out / "arms/powersgd/prepared/schedule.json").read_text())
                 for i in batch}
    assert len(held) == 3 and not set(held) & scheduled and {docs[i]["kind"] for i in held} == {"retention-heldout"}
    for label in ("powersgd", "no-replay", "mix"):
        rows = read_jsonl(out / "eval" / label / "retention_heldout.jsonl")
        assert [r["doc_id"] for r in rows] == held and all("change_nats_per_token" in r for r in rows)
        assert results["arms"][[a["name"] for a in results["arms"]].index(label)]["retention_heldout"]["docs"] == 3
    assert set(json.loads((out / "validation.json").read_text())["evaluations"]["mix"]
               ["retention_heldout_docs_checked"]) == set(held)
    report_text = (out / "report.md").read_text()
    assert "| Approximate 99% upper held-out retention bound |" in report_text
    assert "first-cohort training cases replayed by the candidate: lookup 6, filtering 6, sorting 6, invoice totals 6;" \
        " each response token weighs 3" in report_text
    # The interpolated arm: every parameter lerp(accepted, candidate, 0.75) in fp32, in the candidate's dtype; it
    # trained nothing, so its execution is the candidate's plus the interpolation, and the commitment binds it.
    import torch

    from transformers import AutoModelForCausalLM

    def params(path):
        return dict(AutoModelForCausalLM.from_pretrained(path, dtype="auto", local_files_only=True).named_parameters())
    start, trained, mixed = (params(p) for p in (accepted / "arms/powersgd/model", out / "arms/powersgd/model",
                                                   out / "arms/mix/model"))
    for name, p in mixed.items():
        want = torch.lerp(start[name].float(), trained[name].float(), 0.75).to(trained[name].dtype)
        assert p.dtype == trained[name].dtype and torch.equal(p.detach(), want.detach()), name
    mix = next(a for a in results["arms"] if a["name"] == "mix")
    cand = next(a for a in results["arms"] if a["name"] == "powersgd")
    assert mix["interpolated"]["from"] == "powersgd" and mix["execution"]["derived_from"] == "powersgd"
    assert mix["execution"]["complete_process_s"] == pytest.approx(cand["execution"]["complete_process_s"]
                                                                   + mix["interpolated"]["seconds"])
    assert "mix" in [c["name"] for c in load_commitment(out / "commitment.json")["candidates"]]
    assert "| Made from (interpolated: its training is that arm's) | trained | trained | powersgd, alpha 0.75" \
        in report_text
    assert isinstance(results["screens"]["quality"]["passed"], bool)
    assert json.loads((out / "validation.json").read_text())["passed"]
    families = {r["family"] for r in read_jsonl(out / "eval/powersgd/cases.jsonl")}
    assert families == {"cheapest", "acronym", "lookup", "filtering", "sorting", "invoice"}
    # The control trained on the new families alone, and is paired against the candidate on the same cases.
    control = json.loads((out / "arms/no-replay/prepared/sets.json").read_text())["cohort"]
    assert control["first_cohort_replay_ids"] == [] and json.loads((out / "arms/no-replay/run.json").read_text())[
        "replay"] is False
    kinds = [json.loads(line)["kind"] for line in (out / "arms/no-replay/prepared/documents.jsonl").read_text().splitlines()]
    scheduled = {i for batch in json.loads((out / "arms/no-replay/prepared/schedule.json").read_text()) for i in batch}
    assert {kinds[i] for i in scheduled} == {"task"} and set(kinds) == {"task", "retention-heldout"}
    # validation rebuilds a no-replay arm's inputs without the replay, as it trained (a study whose reference arm it is)
    from nshard.study.validate import rebuild_prepared

    tokenizer = load_tokenizer(resolve_model(str(accepted / "arms/powersgd/model")))
    assert rebuild_prepared(out / "arms/no-replay", None, tokenizer)["prepared_identity"] == json.loads(
        (out / "arms/no-replay/run.json").read_text())["prepared_identity"]
    assert [c["control"] for c in results["comparisons"]] == ["no-replay", "mix"]
    assert "second cohort: first seed files" in (out / "report.md").read_text()
    body = json.loads((out / "study.json").read_text())
    body["cohort"]["candidate_parameter_root"] = "0" * 64
    (out / "study.json").write_text(json.dumps(body))
    report = subprocess.run([sys.executable, "-m", "nshard.analysis.report", str(out)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert report.returncode == 2 and "provenance: accepted candidate" in report.stderr, report.stderr


def study_ds_config(study_dir: Path) -> Path:
    return Path(json.loads((study_dir / "study.json").read_text())["arms"][2]["ds_config"])


def test_the_study_anchors_its_record_before_scoring_and_stores_models_and_evidence(study):
    out, store, stdout = study["out"], study["store"], study["proc"].stdout
    record = load_commitment(out / "commitment.json")
    anchor = json.loads((out / "anchor.json").read_text())
    assert anchor["uri"] == f"{store}/commitment/{record['record_sha256'][:16]}"
    assert anchor["record_sha256"] == record["record_sha256"] and anchor["clock"] == "s3-server"
    # Anchored before any score: in the log's order and on disk.
    assert stdout.index(f"commitment {record['record_sha256'][:16]} anchored in {anchor['uri']}") < stdout.index(
        "[study] score seed")
    assert study["anchor_before_eval"]
    results = json.loads((out / "results.json").read_text())
    assert results["commitment_anchor"] == anchor and results["stored"]["commitment"] == anchor
    assert anchor["uri"] in (out / "report.md").read_text()
    models = results["stored"]["models"]
    assert sorted(models) == sorted(c["name"] for c in record["candidates"])
    for c in record["candidates"]:
        assert models[c["name"]]["uri"] == f"{store}/models/{c['name']}-{c['parameter_root'][:16]}"
        assert models[c["name"]]["files"] == len(c["files"])
    from nshard.files import file_sha256

    archive_sha = file_sha256(out / "evidence.tar")
    assert results["stored"]["evidence"]["uri"] == f"{store}/evidence/{record['record_sha256'][:16]}-{archive_sha[:16]}"
    stored = [anchor, *models.values(), *filter(None, [results["stored"]["evidence"]])]
    for locator in stored:
        verified = verify_stored(study["aws"], locator["uri"])
        assert verified.returncode == 0 and json.loads(verified.stdout)["verified"], verified.stderr


def test_a_local_directory_store_takes_the_same_record_and_models(study, tmp_path):
    """The runner's two store steps against a local directory, on this study's record and models (no retraining)."""
    from nshard.run.plan import load_plan
    from nshard.study.runner import anchor_commitment, push_outputs

    out = tmp_path / "out"
    out.mkdir()
    for name in ("commitment.json", "results.json"):
        shutil.copyfile(study["out"] / name, out / name)
    plan = load_plan(study["plan"])
    plan = dataclasses.replace(plan, study=dataclasses.replace(plan.study, store=str(tmp_path / "store")))
    record = load_commitment(out / "commitment.json")
    anchor = anchor_commitment(plan, out, record)
    assert anchor["uri"] == str(tmp_path / "store" / "commitment" / record["record_sha256"][:16])
    assert anchor["clock"] == "local"
    stored = push_outputs(plan, out, record)
    assert json.loads((out / "results.json").read_text())["stored"] == stored
    for locator in [stored["commitment"], *stored["models"].values()]:
        assert verify_stored({}, locator["uri"]).returncode == 0
    powersgd = stored["models"]["powersgd"]["uri"]
    pulled = subprocess.run([sys.executable, "-m", "nshard.evidence.store", "pull", powersgd, str(tmp_path / "pulled")],
                            capture_output=True, text=True, timeout=300)
    assert pulled.returncode == 0, pulled.stderr
    committed = next(c for c in record["candidates"] if c["name"] == "powersgd")
    assert model_files(tmp_path / "pulled") == committed["files"]


def test_a_store_that_cannot_be_reached_stops_the_study_before_scoring(study, tmp_path):
    """A copy of the study without its scores, run again (finished arms reused) with the S3 endpoint unreachable."""
    out = tmp_path / "out"
    shutil.copytree(study["out"], out, ignore=shutil.ignore_patterns(
        "eval", "plots", "results.json", "report.md", "validation.json", "anchor.json", "evidence.tar*"))
    proc = run_study(study, out, endpoint="http://127.0.0.1:9")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "arm powersgd: finished earlier with the same plan and ds_config; reused" in proc.stdout
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"nshard.study: error: study.store: pushing commitment.json to {study['store']}/commitment/")
    assert "so nothing was scored" in error and "127.0.0.1:9" in error
    assert "[study] score" not in proc.stdout
    assert not (out / "eval").exists() and not (out / "anchor.json").exists() and not (out / "results.json").exists()


def test_a_rerun_reuses_finished_arms_and_keeps_the_failed_attempts(study):
    proc = run_study(study, study["out"])
    assert proc.returncode == 1
    for arm in ("one-rank", "dense", "powersgd"):
        assert f"arm {arm}: finished earlier with the same plan and ds_config; reused" in proc.stdout
    state = json.loads((study["out"] / "study.json").read_text())
    broken = next(a for a in state["arms"] if a["name"] == "broken")
    assert [a["rc"] != 0 for a in broken["attempts"]] == [True, True]
    assert all(Path(a["log"]).is_file() for a in broken["attempts"])


def archive_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nshard.evidence.archive", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_the_study_archives_its_evidence_beside_the_results(study, tmp_path):
    """Runs after the rerun above, so both failed attempts of the broken arm are in it: it stops before making
    a run directory, so its evidence is its logs and study.json's attempts (failed/<attempt>/ directories are
    archived as tests/test_archive.py shows on a synthetic study)."""
    out = study["out"]
    archive = out / "evidence.tar"
    assert archive.is_file() and (out / "evidence.tar.sha256").is_file() and (out / "results.json").is_file()
    checked = archive_cli("verify", archive)
    assert checked.returncode == 0 and json.loads(checked.stdout)["anchored"], checked.stderr
    index, members, _ = verify(archive)
    held = {name.removeprefix("study/"): data for name, data in members.items() if name.startswith("study/")}
    # results.json as the report wrote it: the store's locators ("stored") are added after the archive is made.
    on_disk = json.loads((out / "results.json").read_text())
    assert json.loads(held["results.json"]) == {k: v for k, v in on_disk.items() if k != "stored"}
    for rel in ["commitment.json", "validation.json", "report.md", "study.json", "plan.toml",
                *[f"eval/{label}/{f}" for label in ("seed", "one-rank", "dense", "powersgd")
                  for f in ("cases.jsonl", "summary.json")],
                *[str(p.relative_to(out)) for arm in ("one-rank", "dense", "powersgd")
                  for p in (out / "arms" / arm / "receipts").glob("rank-*.json")],
                "logs/broken-attempt-1.log", "logs/broken-attempt-2.log"]:
        assert held.get(rel) == (out / rel).read_bytes(), rel
    attempts = next(a for a in json.loads(held["study.json"])["arms"] if a["name"] == "broken")["attempts"]
    assert [Path(a["log"]).name for a in attempts] == ["broken-attempt-1.log", "broken-attempt-2.log"]
    assert not [n for n in held if n.endswith((".safetensors", ".bin", ".pt")) or "/state/" in n]
    manifests = {f"arms/{arm}/model/manifest.json" for arm in ("one-rank", "dense", "powersgd")}
    assert {n for n in held if "/model/" in n} == manifests
    assert index["source"]["captured"] in ("commit", "working tree at archive time")
    copy = tmp_path / "evidence.tar"  # one flipped byte, in a copy beside a copy of the .sha256
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0x01
    copy.write_bytes(bytes(data))
    shutil.copyfile(out / "evidence.tar.sha256", tmp_path / "evidence.tar.sha256")
    flipped = archive_cli("verify", copy)
    assert flipped.returncode == 1 and "archive sha256 is" in flipped.stderr


def test_a_results_file_of_the_study_keeps_audit_files_its_report_traces_to(study, tmp_path):
    """launch/results_file.py on the study (its failed arm included): the audit folder holds the archive's
    results.json, every finished rank's receipts and the archive's index, and every headline figure of the report
    equals results.json's."""
    from launch import results_file
    from test_results_file import git, read_audit

    checkout = tmp_path / "clone"  # results_file names a clean checkout's commit
    checkout.mkdir()
    git(checkout, "init", "-q")
    git(checkout, "commit", "-q", "--allow-empty", "-m", "c")
    out = tmp_path / "results"
    assert results_file.main(["--run", str(study["out"]), "--checkout", str(checkout), "--command", "study",
                              "--run_s", "60", "--out", str(out)]) == 0
    [written] = out.glob("*.md")
    folder = read_audit(written.with_name(written.stem + results_file.AUDIT))
    assert {n for n in folder if "/receipts/" in n} == {
        str(p.relative_to(study["out"])) for p in (study["out"] / "arms").glob("*/receipts/rank-*.json")}
    assert results_file.audit_mismatches((study["out"] / "report.md").read_text(), folder) == []


def tiny_tokenizer():
    return load_tokenizer(resolve_model("tiny"))


def tampered_copy(study, tmp_path, label: str, edit) -> dict[str, Path]:
    evals = {name: study["out"] / "eval" / name for name in ("seed", "one-rank", "dense", "powersgd")}
    copy = tmp_path / label
    shutil.copytree(evals[label], copy)
    rows = read_jsonl(copy / "cases.jsonl")
    edit(rows)
    (copy / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {**evals, label: copy}


def test_validation_passes_on_the_study_and_catches_a_changed_token_id(study, tmp_path):
    run_dir = study["out"] / "arms" / "powersgd"
    evals = {name: study["out"] / "eval" / name for name in ("seed", "one-rank", "dense", "powersgd")}
    assert validate(run_dir, tiny_tokenizer(), evals, regenerate=False)["passed"]

    def change_token(rows):
        row = next(r for r in rows if r["generated_ids"])
        row["generated_ids"][0] = (row["generated_ids"][0] + 1) % 500
        change_token.case = row["case_id"]

    evals = tampered_copy(study, tmp_path, "powersgd", change_token)
    with pytest.raises(ValidationError, match=f"powersgd: {change_token.case}: stored token ids decode to"):
        validate(run_dir, tiny_tokenizer(), evals)


def test_validation_catches_a_changed_correct_flag(study, tmp_path):
    def flip(rows):
        rows[3]["correct"] = not rows[3]["correct"]
        flip.case = rows[3]["case_id"]

    evals = tampered_copy(study, tmp_path, "dense", flip)
    with pytest.raises(ValidationError, match=f"dense: {flip.case}: re-scoring gives correct="):
        validate(study["out"] / "arms" / "dense", tiny_tokenizer(), evals)


def copy_eval(study, tmp_path, label: str, rows_file: str, edit, **summary_changes) -> dict[str, Path]:
    """The study's evaluations with `label`'s copy edited (rows of rows_file, then summary fields)."""
    evals = {name: study["out"] / "eval" / name for name in ("seed", "one-rank", "dense", "powersgd")}
    copy = tmp_path / f"{label}-edited"
    shutil.copytree(evals[label], copy)
    rows = read_jsonl(copy / rows_file)
    edit(rows)
    (copy / rows_file).write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((copy / "summary.json").read_text())
    (copy / "summary.json").write_text(json.dumps({**summary, **summary_changes}))
    return {**evals, label: copy}


def test_validation_rebuilds_the_inputs_from_the_plan_and_finds_the_seed_through_the_record(study, tmp_path):
    out = study["out"]
    record = load_commitment(out / "commitment.json")
    evals = {("base" if n == "seed" else n): out / "eval" / n for n in ("seed", "one-rank", "dense", "powersgd")}
    report = validate(out / "arms" / "powersgd", tiny_tokenizer(), evals, record=record, plan_path=study["plan"],
                      regenerate=False)
    assert report["seed"] == "base" and report["seed_found_by"] == "record"
    assert report["prepared"]["prepared_identity"] == json.loads((out / "arms/powersgd/run.json").read_text())[
        "prepared_identity"]
    # Another model scored under the seed's name is not the seed the record commits.
    wrong = {**evals, "seed": out / "eval" / "dense"}
    wrong.pop("base")
    with pytest.raises(ValidationError, match="0 evaluations scored the model the record commits as the seed"):
        validate(out / "arms" / "powersgd", tiny_tokenizer(), wrong, record=record, plan_path=study["plan"],
                 regenerate=False)

    # A copy of the run whose prepared/ files were edited, then one whose plan (and its recorded hash) was.
    run = tmp_path / "run"
    shutil.copytree(out / "arms" / "powersgd", run, ignore=shutil.ignore_patterns("model", "states"))
    sets = json.loads((run / "prepared/sets.json").read_text())
    (run / "prepared/sets.json").write_text(json.dumps({**sets, "eval_case_ids": sets["eval_case_ids"][::-1]}))
    with pytest.raises(ValidationError, match="a file under .* was changed"):
        validate(run, tiny_tokenizer(), evals, record=record, plan_path=run / "plan.toml")
    shutil.copyfile(out / "arms/powersgd/prepared/sets.json", run / "prepared/sets.json")
    (run / "plan.toml").write_text((run / "plan.toml").read_text().replace("eval_seed = 7007", "eval_seed = 7008"))
    from nshard.files import file_sha256

    body = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**body, "plan_sha256": file_sha256(run / "plan.toml")}))
    with pytest.raises(ValidationError, match="rebuilding the inputs from the plan gives identity .* evaluation or "
                                              "retention sets differ"):
        validate(run, tiny_tokenizer(), evals, record=record, plan_path=run / "plan.toml")


def test_forged_retention_changes_fail_validation(study, tmp_path):
    """Changes of -5 nats, first with the summary claiming no seed losses were used, then with it true."""
    record = load_commitment(study["out"] / "commitment.json")

    def forge(rows):
        for row in rows:
            row["change_nats_per_token"] = -5.0
    run = study["out"] / "arms" / "powersgd"
    evals = copy_eval(study, tmp_path / "a", "powersgd", "retention.jsonl", forge, with_seed_retention=False)
    with pytest.raises(ValidationError, match="powersgd: summary.json: scored without the seed's retention losses"):
        validate(run, tiny_tokenizer(), evals, record=record, plan_path=study["plan"])
    evals = copy_eval(study, tmp_path / "b", "powersgd", "retention.jsonl", forge)
    with pytest.raises(ValidationError, match=r"powersgd: retention .*: change -5.0 != recomputed"):
        validate(run, tiny_tokenizer(), evals, record=record, plan_path=study["plan"])


def test_regeneration_catches_answers_the_model_does_not_give(study, tmp_path):
    """A stored answer cut to its first token, text and flag made consistent: only generating again shows it."""
    from nshard import tasks
    from nshard.study.evaluate import case_from_id

    out = study["out"]
    validation = json.loads((out / "validation.json").read_text())
    assert validation["regenerated"] and validation["machine"]["cpu_capability"]
    assert {label: (v["regenerated"]["cases"], v["regenerated"]["batches"], v["regenerated"]["retention_docs"])
            for label, v in validation["evaluations"].items()} == {label: (16, 4, 4) for label in
                                                                 ("seed", "one-rank", "dense", "powersgd")}
    tokenizer = tiny_tokenizer()

    def cut(rows):
        row = next(r for r in rows if len(r["generated_ids"]) >= 2)
        row["generated_ids"] = row["generated_ids"][:1]
        row["generated_text"] = tokenizer.decode(row["generated_ids"], skip_special_tokens=True)
        row["correct"] = tasks.score(case_from_id(row["case_id"]), row["generated_text"])
        cut.case = row["case_id"]
    evals = copy_eval(study, tmp_path, "powersgd", "cases.jsonl", cut)
    rows = read_jsonl(evals["powersgd"] / "cases.jsonl")
    per_family = {}
    for r in rows:
        fam = per_family.setdefault(r["family"], {"correct": 0, "cases": 0})
        fam["cases"] += 1
        fam["correct"] += r["correct"]
    summary = json.loads((evals["powersgd"] / "summary.json").read_text())
    (evals["powersgd"] / "summary.json").write_text(json.dumps({**summary, "per_family": per_family}))
    record = load_commitment(out / "commitment.json")
    run = out / "arms" / "powersgd"
    # The stored files agree with each other:
    assert not validate(run, tokenizer, evals, record=record, plan_path=study["plan"], regenerate=False)["regenerated"]
    with pytest.raises(ValidationError, match=f"powersgd: {cut.case}: regenerated answer differs at generated token 1: "
                                              "the file has end, generated again"):
        validate(run, tokenizer, evals, record=record, plan_path=study["plan"])


def scoring_batches(eval_dir: Path) -> list[list[int]]:
    """The positions of the cases each scoring batch held (evaluate.generate_answers: longest input first)."""
    rows = read_jsonl(eval_dir / "cases.jsonl")
    size = json.loads((eval_dir / "summary.json").read_text())["batch_size"]
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i]["input_ids"]), i))
    return [order[s:s + size] for s in range(0, len(order), size)]


def forged_copy(study, tmp_path: Path, label: str, forge) -> Path:
    """A copy of the study's own files (its arms and models stay where they are) in which eval/<label> was forged
    as a skeptic did it on the main job: the rows edited by `forge`, and summary.json's counts made to agree with
    them, so that every check of the files against each other passes. validation.json is the honest run's."""
    copy = tmp_path / "study"
    shutil.copytree(study["out"], copy, ignore=shutil.ignore_patterns("arms", "failed", "logs", "plots", "evidence.tar*"))
    for name in ("cases.jsonl", "retention.jsonl"):
        path = copy / "eval" / label / name
        rows = read_jsonl(path)
        forge(name, rows)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = read_jsonl(copy / "eval" / label / "cases.jsonl")
    per_family = {}
    for r in rows:
        fam = per_family.setdefault(r["family"], {"correct": 0, "cases": 0})
        fam["cases"] += 1
        fam["correct"] += r["correct"]
    summary = json.loads((copy / "eval" / label / "summary.json").read_text())
    (copy / "eval" / label / "summary.json").write_text(json.dumps(
        {**summary, "per_family": per_family, "correct": sum(r["correct"] for r in rows)}))
    return copy


def answer_forgery(tokenizer, position: int, right: bool):
    """Rewrite one stored answer: to the expected answer's tokens (right), or to a wrong one, with its text and flag."""
    from nshard import tasks
    from nshard.study.evaluate import case_from_id

    def forge(name, rows):
        if name != "cases.jsonl":
            return
        row = rows[position]
        case = case_from_id(row["case_id"])
        text = tasks.answer(case) if right else tasks.answer(case) + " 0"
        row["generated_ids"] = tokenizer.encode(text, add_special_tokens=False)
        row["generated_text"] = tokenizer.decode(row["generated_ids"], skip_special_tokens=True)
        row["correct"] = tasks.score(case, row["generated_text"])
        assert row["correct"] is right
        forge.case = row["case_id"]
    return forge


def assert_forgery_caught(study, copy: Path, label: str, where: str, because: str):
    """Validation of the forged files (every answer and loss generated again) and the report on them both refuse,
    each naming the evaluation and the case."""
    record = load_commitment(study["out"] / "commitment.json")
    evals = {name: copy / "eval" / name for name in ("seed", "one-rank", "dense", "powersgd")}
    with pytest.raises(ValidationError, match=re.escape(f"validation failed: {label}: {where}: {because}")):
        validate(study["out"] / "arms" / "powersgd", tiny_tokenizer(), evals, record=record, plan_path=study["plan"])
    report = subprocess.run([sys.executable, "-m", "nshard.analysis.report", str(copy)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert report.returncode == 2, report.stdout[-2000:]
    named = where if where.startswith("retention ") else f"case {where}"
    assert f"evaluation {label}, {named}:" in report.stderr and "but validation found" in report.stderr, report.stderr


@pytest.mark.parametrize("label", ["powersgd", "dense"])
def test_one_forged_answer_in_any_scoring_batch_fails_validation_and_the_report(study, tmp_path, label):
    """One answer rewritten to the expected one, as the skeptic did, in the candidate and in a control, in each of
    the 4 scoring batches in turn (a check of one batch would miss three of these four)."""
    tokenizer = tiny_tokenizer()
    rows = read_jsonl(study["out"] / "eval" / label / "cases.jsonl")
    batches = scoring_batches(study["out"] / "eval" / label)
    assert len(batches) == 4
    for b, members in enumerate(batches):
        position = next(i for i in members if not rows[i]["correct"])  # the random tiny models answer none right
        forge = answer_forgery(tokenizer, position, right=True)
        copy = forged_copy(study, tmp_path / f"batch-{b}", label, forge)
        assert_forgery_caught(study, copy, label, forge.case, "regenerated answer differs at generated token")


def test_one_forged_retention_loss_fails_validation_and_the_report(study, tmp_path):
    """One of the candidate's retention losses lowered by a tenth, its change recomputed to agree (each document in
    turn would do; the last is taken, which a check of one batch of 16 would have reached only with 16 documents)."""
    def forge(name, rows):
        if name != "retention.jsonl":
            return
        row = rows[-1]
        row["nll_sum"] *= 0.9
        row["change_nats_per_token"] = (row["nll_sum"] - row["seed_nll_sum"]) / row["target_weight"]
        forge.doc = row["doc_id"]
    copy = forged_copy(study, tmp_path, "powersgd", forge)
    assert_forgery_caught(study, copy, "powersgd", f"retention {forge.doc}", "scored again, its loss is")
    # The study's own validation step on the forged files: it stops, validation.json says why, the report refuses.
    from nshard.run.plan import load_plan
    from nshard.study.runner import validate_scores

    record = load_commitment(study["out"] / "commitment.json")
    done = {a: study["out"] / "arms" / a for a in ("one-rank", "dense", "powersgd")}
    evals = {name: copy / "eval" / name for name in ("seed", *done)}
    with pytest.raises(ValidationError):
        validate_scores(load_plan(study["plan"]), dict.fromkeys(done, study["plan"]), copy, done, evals, record,
                        tiny_tokenizer())
    assert json.loads((copy / "validation.json").read_text())["passed"] is False
    report = subprocess.run([sys.executable, "-m", "nshard.analysis.report", str(copy)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert report.returncode == 2 and f"validation did not pass (validation failed: powersgd: retention {forge.doc}: " \
        in report.stderr, report.stderr


def test_generation_settings_other_than_the_plans_fail_validation(study, tmp_path):
    """Regeneration repeats summary.json's settings, so those must be the plan's: a shorter max_new_tokens could cut a
    wrong answer to a right prefix, and regeneration at that length would agree."""
    record = load_commitment(study["out"] / "commitment.json")
    evals = copy_eval(study, tmp_path, "powersgd", "cases.jsonl", lambda rows: None, max_new_tokens=1)
    with pytest.raises(ValidationError, match="powersgd: summary.json: max_new_tokens 1 is not the plan's "
                                              "study.eval_max_new_tokens 12"):
        validate(study["out"] / "arms" / "powersgd", tiny_tokenizer(), evals, record=record, plan_path=study["plan"])


def test_a_bf16_run_is_scored_in_bf16_and_regenerated_at_scorings_thread_count(runs_root, tmp_path):
    """On the CPU a run that trained in bf16 is scored in bf16 (about half fp32's time: docs/benchmarks.md), and
    validation regenerates its answers bit for bit: the same placement and the same thread count as scoring
    (bf16 kernels split their sums by thread), whatever the validating process had."""
    import torch

    from nshard.study.evaluate import score_model
    from runs import cached_run

    run = cached_run(runs_root, "bf16-one-rank", tiny_config(bf16=True), world=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        summary = score_model("seed", run / "model", run, tmp_path / "seed", commitment=None, exploratory=True,
                              max_new_tokens=8, batch_size=4)
        torch.set_num_threads(1)
        report = validate(run, tiny_tokenizer(), {"seed": tmp_path / "seed"}, rebuild=False)
    finally:
        torch.set_num_threads(before)
    assert (summary["device"], summary["dtype"], summary["threads"]) == ("cpu", "bfloat16", 2)
    regenerated = report["evaluations"]["seed"]["regenerated"]
    assert (regenerated["dtype"], regenerated["threads"], regenerated["cases"]) == ("bfloat16", 2, 16)


def test_an_edited_commitment_is_refused(study, tmp_path):
    body = json.loads((study["out"] / "commitment.json").read_text())
    body["candidates"][0]["parameter_root"] = "0" * 64
    (tmp_path / "c.json").write_text(json.dumps(body))
    with pytest.raises(CommitError, match="was changed after it was written"):
        load_commitment(tmp_path / "c.json")


def test_scoring_an_uncommitted_model_is_refused_unless_exploratory(study, tmp_path):
    other = resolve_model("tiny:1").path  # never trained, never committed
    cmd = [sys.executable, "-m", "nshard.study.evaluate", "--run", str(study["out"] / "arms" / "dense"), "--model", other,
           "--label", "other", "--out", str(tmp_path / "other"), "--max-new-tokens", "4"]
    proc = subprocess.run([*cmd, "--commitment", str(study["out"] / "commitment.json")], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "is not named by commitment" in proc.stderr and "--exploratory" in proc.stderr
    assert not (tmp_path / "other").exists()
    proc = subprocess.run([*cmd, "--exploratory"], cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "other" / "summary.json").read_text())["exploratory"] is True
    assert all(r["exploratory"] for r in read_jsonl(tmp_path / "other" / "cases.jsonl"))


def test_an_exploratory_study_says_so_in_every_output(study, tmp_path):
    # On a copy: the shared study stays committed and judged for the tests after this one.
    out = tmp_path / "out"
    shutil.copytree(study["out"], out)
    proc = run_study(study, out, "--exploratory")
    assert proc.returncode == 1
    assert json.loads((out / "results.json").read_text())["exploratory"] is True
    assert "EXPLORATORY" in (out / "report.md").read_text()
    for label in ("seed", "one-rank", "dense", "powersgd"):
        assert json.loads((out / "eval" / label / "summary.json").read_text())["exploratory"] is True
        assert all(r["exploratory"] for r in read_jsonl(out / "eval" / label / "cases.jsonl"))
        assert all(r["exploratory"] for r in read_jsonl(out / "eval" / label / "retention.jsonl"))


def test_a_committed_model_scored_under_another_label_is_refused(study, tmp_path):
    """The dense arm's export scored as the candidate: the record commits those files as dense."""
    out = study["out"]
    proc = subprocess.run([sys.executable, "-m", "nshard.study.evaluate", "--run", str(out / "arms" / "dense"),
                           "--model", str(out / "arms" / "dense" / "model"), "--label", "powersgd",
                           "--out", str(tmp_path / "swapped"), "--commitment", str(out / "commitment.json"),
                           "--max-new-tokens", "4"], cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "not 'powersgd'" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "swapped").exists()


@pytest.mark.parametrize("damage", ["edited", "other models"])
def test_a_damaged_or_foreign_commitment_stops_the_study_and_stays(study, tmp_path, damage):
    from nshard.study.runner import commit_candidates

    record = load_commitment(study["out"] / "commitment.json")
    arms = {c["name"]: Path(c["run_dir"]) for c in record["candidates"]}
    body = json.loads((study["out"] / "commitment.json").read_text())
    if damage == "edited":
        body["candidates"][0]["parameter_root"] = "0" * 64  # its own hash no longer matches
    else:
        arms.pop("one-rank")  # this run would commit fewer models than the record names
    (tmp_path / "commitment.json").write_text(json.dumps(body))
    before = (tmp_path / "commitment.json").read_bytes()
    with pytest.raises(CommitError):
        commit_candidates(tmp_path, Path(record["seed"]["model_dir"]), arms)
    assert (tmp_path / "commitment.json").read_bytes() == before


# ---------------------------------------------------------------- a growth from this study


def grow_cli(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nshard.grow", "--from", str(source), "--out", str(out)], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=300)


def test_a_growth_starts_from_the_accepted_candidate_and_names_its_record(accepted, tmp_path):
    from nshard.evidence.export import verify_manifest

    proc = grow_cli(accepted, tmp_path / "grown")
    assert proc.returncode == 0, proc.stderr[-3000:]
    source = verify_manifest(tmp_path / "grown")["grown"]["source"]
    record = load_commitment(accepted / "commitment.json")
    entry = next(c for c in record["candidates"] if c["name"] == "powersgd")
    assert source["kind"] == "accepted study" and source["candidate"] == "powersgd"
    assert source["commitment_sha256"] == record["record_sha256"]
    assert source["parameter_root"] == entry["parameter_root"] and source["model_files"] == entry["files"]


def test_a_growth_from_an_unaccepted_study_or_a_tampered_export_is_refused(study, accepted, tmp_path):
    proc = grow_cli(study["out"], tmp_path / "unaccepted")
    assert proc.returncode == 2 and "did not pass its quality screen" in proc.stderr, proc.stderr
    def flip(copy):
        weights = copy / "arms/powersgd/model/model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-10] ^= 0x01
        weights.write_bytes(bytes(data))
    proc = grow_cli(edited_copy(accepted, tmp_path, flip), tmp_path / "tampered")
    assert proc.returncode == 2 and "is not what the study committed and judged" in proc.stderr, proc.stderr
    assert not (tmp_path / "unaccepted").exists() and not (tmp_path / "tampered").exists()


def growth_plan(tmp: Path, study_dir: Path, growth: str = "experts = 4\ntop_k = 2\naux_coef = 0.1\n") -> Path:
    """The cohort's tiny plan as a growth study: the accepted candidate continued dense against the same candidate
    grown (by default the first design: 4 experts, top 2), both from its weights, under the FLOPs continued dense
    spends in 3 updates."""
    ds = study_ds_config(study_dir)
    plan = cohort_plan(tmp, study_dir, start="weights")
    plan.write_text(plan.read_text() + '\n[growth]\nbudget = "train_flops"\n' + growth +
                    '\n[study]\ncandidate = "grown"\nspeed_baseline = "dense"\neval_max_new_tokens = 12\n'
                    f'\n[[study.arms]]\nname = "dense"\nranks = 2\nds_config = "{ds}"\n'
                    f'\n[[study.arms]]\nname = "grown"\nranks = 2\nds_config = "{ds}"\ngrown = true\n')
    return plan


def test_a_tiny_growth_study_grows_the_accepted_candidate_and_trains_both_arms_within_one_budget(accepted, tmp_path):
    """Grown once before either arm, the budget fixed in numbers and each arm's updates written into its plan; the
    grown arm trains fewer updates (each token costs it more) within the same FLOPs; both are committed, scored,
    validated, measured serving, and judged on the growth screen; the grown export loads in plain transformers."""
    from transformers import AutoModelForCausalLM

    from nshard.evidence.export import verify_manifest
    from runs import launch

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "nshard.study", "--plan", str(growth_plan(tmp_path, accepted)),
                           "--out", str(out)], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.index("grew powersgd into") < proc.stdout.index("arm dense: training")
    study = json.loads((out / "study.json").read_text())
    growth = study["growth"]
    dense, grown = growth["arms"]["dense"], growth["arms"]["grown"]
    assert dense["updates"] == 3 and growth["budget"]["train_flops"] == dense["train_flops"]
    assert grown["active_parameters_per_token"] > dense["active_parameters_per_token"]
    assert 1 <= grown["updates"] < dense["updates"] and grown["train_flops"] <= growth["budget"]["train_flops"]
    manifest = verify_manifest(out / "grown")
    for name, arm in growth["arms"].items():
        run = json.loads((out / "arms" / name / "run.json").read_text())
        assert run["updates"] == arm["updates"] and run["budget"]["spent"] == arm["train_flops"]
        assert run["cohort"]["parameter_root"] == study["cohort"]["candidate_parameter_root"]
        assert (run["cohort"].get("grown") or {}).get("parameter_root") == (
            manifest["parameter_root"] if arm["grown"] else None)
    receipt = json.loads((out / "arms/grown/receipts/rank-0.json").read_text())
    assert receipt["experts"]["routing_identical_on_ranks"] and len(receipt["update_experts"]) == grown["updates"]
    model = AutoModelForCausalLM.from_pretrained(out / "arms/grown/model")
    assert type(model).__name__ == "MixtralForCausalLM"
    results = json.loads((out / "results.json").read_text())
    names = [c["name"] for c in results["screens"]["quality"]["conditions"]]
    assert names == ["paired 99% lower bound vs dense (continued dense), points",
                     "first-cohort paired 99% lower bound vs the accepted checkpoint, points",
                     "retention-change 99% upper bound vs the accepted checkpoint, nats"]
    assert isinstance(results["screens"]["quality"]["passed"], bool) and results["screens"]["speed"]["passed"] is None
    serving = json.loads((out / "serving.json").read_text())
    assert set(serving) == {"dense", "grown"} and serving["grown"]["export_bytes"] > serving["dense"]["export_bytes"]
    assert all(s["tokens_per_s_batch_1"] > 0 and s["time_to_first_token_s"] > 0 and s["peak_memory_bytes"] > 0
               for s in serving.values())
    report = (out / "report.md").read_text()
    assert "## Growth" in report and "| Updates within the budget |" in report
    # Had the grown candidate failed, the study validates on the arm that finished, against that arm's own plan (the
    # embedded growth study once took the candidate's plan with the dense arm's run, and stopped there).
    from nshard.run.cohort import start_model_spec
    from nshard.run.plan import load_plan
    from nshard.study.runner import score_all, validate_scores

    copy, plan = tmp_path / "dense-only", load_plan(out / "plan.toml")
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("arms", "grown", "logs", "evidence.tar*"))
    done, record = {"dense": out / "arms" / "dense"}, load_commitment(out / "commitment.json")
    # Scores made on the candidate's sets are not reused for another reference arm (the prepared identities of a
    # growth study's arms differ: their schedules are cut to the budget).
    evals = score_all(plan, copy, Path(resolve_model(start_model_spec(plan)).path), done, record)
    assert json.loads((evals["dense"] / "summary.json").read_text())["run_dir"] == str(done["dense"])
    arm_plans = {name: out / "arm-plans" / f"{name}.toml" for name in ("dense", "grown")}
    assert validate_scores(plan, arm_plans, copy, done, evals, record, tiny_tokenizer())["passed"]
    # A schedule past the budget is refused by the trainer itself, before it writes anything.
    over = tmp_path / "over.toml"
    over.write_text(re.sub(r"(?m)^updates = \d+", f"updates = {dense['updates']}", (out / "arm-plans/grown.toml").read_text()))
    refused = launch(tmp_path / "over", study_ds_config(accepted), world=1, plan=over,
                     extra_args=["--grown", str(out / "grown")], check=False)
    assert refused.returncode != 0 and "over the plan's budget" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "over").exists()


QWEN_GROWTH = ('architecture = "qwen2_moe"\nexperts = 4\ntop_k = 1\nexpert_size = 32\nfreeze = "accepted"\n'
               'aux_coef = 0.1\nfamily_weights = {cheapest = 0.25, acronym = 0.25, lookup = 0.125, '
               'filtering = 0.125, sorting = 0.125, invoice = 0.125}\n')


def test_a_tiny_shared_expert_growth_prices_its_frozen_weights_alike_in_the_study_and_the_trainer(accepted, tmp_path):
    """The shared-expert design with every accepted weight frozen: the study prices the grown arm at 6 FLOPs per
    trained and 4 per frozen parameter a token passes through, so it costs less per token than dense and trains at
    least as many updates; the trainer, reading the freeze from the grown export, spends exactly what the study
    budgeted (it would refuse more); the accepted weights leave training as grown; the screen is family-stratified
    with the declared weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "nshard.study", "--plan",
                           str(growth_plan(tmp_path, accepted, QWEN_GROWTH)), "--out", str(out)],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    growth = json.loads((out / "study.json").read_text())["growth"]
    dense, grown = growth["arms"]["dense"], growth["arms"]["grown"]
    assert grown["frozen_active_parameters_per_token"] > 0 == dense["frozen_active_parameters_per_token"]
    assert grown["flops_per_token"] == 6 * grown["active_parameters_per_token"] - 2 * grown[
        "frozen_active_parameters_per_token"] < dense["flops_per_token"]
    assert grown["updates"] >= dense["updates"] == 3 and grown["train_flops"] <= dense["train_flops"]
    run = json.loads((out / "arms/grown/run.json").read_text())
    assert run["budget"]["spent"] == grown["train_flops"] and run["frozen"]["setting"] == "accepted"
    before, after = load_file(str(out / "grown/model.safetensors")), load_file(str(out / "arms/grown/model/model.safetensors"))
    kept = [k for k in before if "experts" not in k and not k.endswith("mlp.gate.weight")]
    assert kept and all(torch.equal(before[k], after[k]) for k in kept)
    assert not all(torch.equal(before[k], after[k]) for k in before)
    assert type(AutoModelForCausalLM.from_pretrained(out / "arms/grown/model")).__name__ == "Qwen2MoeForCausalLM"
    results = json.loads((out / "results.json").read_text())
    assert results["screens"]["quality"]["conditions"][0]["name"] == (
        "family-stratified paired 99% lower bound vs dense (continued dense), points")
    assert results["screens"]["quality"]["stratified"]["dense"]["n"] == 16
    assert "| Of them frozen (no weight gradient) |" in (out / "report.md").read_text()


def test_a_growth_plan_whose_cases_cannot_see_its_declared_advantage_is_refused_before_training(accepted, tmp_path):
    out = tmp_path / "out"
    growth = QWEN_GROWTH + "min_advantage_points = 3.0\nexpected_discordance = 0.1\n"
    proc = subprocess.run([sys.executable, "-m", "nshard.study", "--plan", str(growth_plan(tmp_path, accepted, growth)),
                           "--out", str(out)], cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "growth.min_advantage_points=3.0: 16 fresh cases (effective" in proc.stderr, proc.stderr[-2000:]
    assert "declared: advantage screen" in proc.stdout and not (out / "arms").exists() and not (out / "grown").exists()

