"""Post-scoring validation: a separate pass that trusts nothing the evaluation wrote.

    python -m nshard.study.validate --run RUN_DIR --tokenizer MODEL_DIR [--commitment C.json] [--plan PLAN]
        [--no_regenerate] EVAL_DIR [EVAL_DIR ...]

Prepared inputs: it rebuilds the training documents, schedule and evaluation sets from the plan (the
run's plan.toml unless --plan names the study's) and compares their identity with the run's, and it
recomputes that identity from the files under prepared/ that scoring read.
Cases: it rebuilds every case from its ID, re-renders and re-tokenizes the prompt, checks that the
expected answer is not inside the model input, decodes the stored token ids and compares them with the
stored text, and re-scores the text; every evaluation must hold the same case IDs. An own held-out row with an
expected answer (own chat data) is a case too, checked against its prepared prompt and expected answer.
Retention: every candidate's change is recomputed from its own and the seed's stored losses; the seed is
the evaluation whose model files the commitment record names as the seed (by label only without a record).
Regeneration (unless --no_regenerate): every model's greedy answers to every case are generated again, by the
call scoring made (same batches, padding, placement, dtype and thread count), and their token ids compared; every
retention document and every own held-out row is scored again. On a CPU of several cores each model's batches
are shared among a process per core, as the study scores them (evaluate.side_by_side_layout). A differing token
is named with its two scores. Greedy decoding is deterministic on one kind of CPU; on another, a near-tie can flip,
so the result names the machine the check ran on.
The first disagreement stops with a message that names the evaluation and the case. The output (validation.json
in a study) lists each case's flag and each document's loss as validated: the analysis uses no others.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import sys
import time
from pathlib import Path

from nshard import tasks
from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
from nshard.seam.launch_env import usable_cores
from nshard.study.evaluate import (EvalError, answer_target, case_from_id, exact_match, heldout_summary,
                                   load_run_sets, prompt_ids, read_jsonl, read_seed_heldout)
from nshard.tasks.base import could_still_match


RETENTION_RTOL = 1e-6
"""A retention loss scored again must agree with the stored one to this relative tolerance (on one kind of CPU the
same call gives the same bits; the tolerance only absorbs another machine's kernels). It lets a document's change
move by at most ~1e-6 x its loss / its target weight, orders of magnitude below any screen's margin."""


class ValidationError(RuntimeError):
    """Stored evaluation evidence that does not hold up; the message names where."""


def _fail(label: str, where: str, what: str):
    raise ValidationError(f"validation failed: {label}: {where}: {what}")


def assistant_turn_ids(tokenizer, case) -> list[int]:
    """The tokens of the assistant turn that would carry the answer (what must not be in the input)."""
    messages = [{"role": "user", "content": tasks.prompt(case)}, {"role": "assistant", "content": tasks.answer(case)}]
    whole = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    return list(whole)[len(prompt_ids(tokenizer, case)):]


def _contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return n > 0 and any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


def check_answer(label: str, row: dict, answer: dict, tokenizer) -> bool:
    """An own held-out row's stored line against its prepared document (input, expected answer); returns the
    re-scored exact match."""
    cid = row["case_id"]
    if row.get("family") != "chat" or row.get("expected") != answer["expected"]:
        _fail(label, cid, f"stored family or expected answer {row.get('expected')!r} differs from the prepared "
                          f"row's {answer['expected']!r}")
    if row.get("input_ids") != answer["prompt_ids"]:
        _fail(label, cid, "stored input ids differ from the prepared row's prompt")
    decoded = tokenizer.decode(row.get("generated_ids", []), skip_special_tokens=True)
    if decoded != row.get("generated_text"):
        _fail(label, cid, f"stored token ids decode to {decoded!r}, not the stored text {row.get('generated_text')!r}")
    correct = exact_match(decoded, answer["expected"])
    if correct != row.get("correct"):
        _fail(label, cid, f"re-scoring gives correct={correct}, the file says {row.get('correct')}")
    expected, period = answer_target("chat", answer["expected"])
    check_cut(label, cid, row, could_still_match(expected, decoded, period))
    return correct


class RebuiltCases(dict):
    """case ID -> the case rebuilt from its ID, its prompt, expected answer and model input, and whether the expected
    answer's assistant turn is inside that input: built once per validation, for every evaluation that holds it."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, cid: str) -> dict:
        case = case_from_id(cid)
        model_input = prompt_ids(self.tokenizer, case)
        self[cid] = {"case": case, "prompt": tasks.prompt(case), "expected": tasks.answer(case),
                     "input_ids": model_input,
                     "answer_inside": _contains(model_input, assistant_turn_ids(self.tokenizer, case))}
        return self[cid]


def check_cut(label: str, cid: str, row: dict, could_still_match_: bool) -> None:
    """An answer stored as cut (generation stopped once no continuation could be right) must be one whose text no
    continuation could make right."""
    if row.get("cut") and could_still_match_:
        _fail(label, cid, f"stored as cut, but its text {row.get('generated_text')!r} could still be continued into "
                          "the expected answer")


def check_cases(label: str, rows: list[dict], case_ids: list[str], tokenizer, answers: dict | None = None,
                rebuilt: RebuiltCases | None = None) -> dict:
    """Every stored case line against a fresh rebuild (an own held-out row: against its prepared document);
    returns the recounted totals. `rebuilt`: cases already rebuilt for another evaluation of this validation."""
    rebuilt = RebuiltCases(tokenizer) if rebuilt is None else rebuilt
    seen = [r.get("case_id") for r in rows]
    if seen != case_ids:
        missing = sorted(set(case_ids) - set(seen))
        extra = sorted(set(seen) - set(case_ids))
        where = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}" if extra else "order or repeats"
        _fail(label, "cases.jsonl", f"case IDs differ from the run's evaluation set ({where})")
    per_family: dict[str, dict] = {}
    for row in rows:
        cid = row["case_id"]
        if cid in (answers or {}):
            fam = per_family.setdefault("chat", {"correct": 0, "cases": 0})
            fam["cases"] += 1
            fam["correct"] += check_answer(label, row, answers[cid], tokenizer)
            continue
        fresh = rebuilt[cid]
        case = fresh["case"]
        if row.get("family") != case.family or row.get("prompt") != fresh["prompt"]:
            _fail(label, cid, "stored family or prompt differs from the case rebuilt from its ID")
        if row.get("expected") != fresh["expected"]:
            _fail(label, cid, f"stored expected answer {row.get('expected')!r} != {fresh['expected']!r}")
        if row.get("input_ids") != fresh["input_ids"]:
            _fail(label, cid, "stored input ids differ from the re-rendered, re-tokenized prompt")
        if fresh["answer_inside"]:
            _fail(label, cid, "the expected answer's assistant turn is inside the model input")
        decoded = tokenizer.decode(row.get("generated_ids", []), skip_special_tokens=True)
        if decoded != row.get("generated_text"):
            _fail(label, cid, f"stored token ids decode to {decoded!r}, not the stored text "
                              f"{row.get('generated_text')!r}")
        correct = tasks.score(case, decoded)
        if correct != row.get("correct"):
            _fail(label, cid, f"re-scoring gives correct={correct}, the file says {row.get('correct')}")
        check_cut(label, cid, row, tasks.could_still_score(case, decoded))
        fam = per_family.setdefault(case.family, {"correct": 0, "cases": 0})
        fam["cases"] += 1
        fam["correct"] += correct
    return per_family


def check_retention(label: str, rows: list[dict], retention: list[dict], seed_rows: dict | None,
                    what: str = "retention") -> None:
    """IDs, finiteness and target weights of every row; with the seed's rows, each change is recomputed.
    what="heldout": the same checks on an own held-out split's rows; "retention_heldout": on the held-out retention
    documents' rows (a change against the seed, as the retention rows)."""
    if [r.get("doc_id") for r in rows] != [d["doc_id"] for d in retention]:
        _fail(label, f"{what}.jsonl", f"{what} document IDs differ from the run's {what} set")
    for row, doc in zip(rows, retention):
        where = f"{what} {doc['doc_id']}"
        if not math.isfinite(row.get("nll_sum", math.nan)):
            _fail(label, where, f"loss {row.get('nll_sum')} is not finite")
        weight = math.fsum(doc["weights"][1:])
        tokens = sum(1 for w in doc["weights"][1:] if w > 0)
        if row.get("target_tokens") != tokens or not math.isclose(row.get("target_weight", -1), weight):
            _fail(label, where, "target tokens or weight differ from the prepared document's weights")
        if seed_rows is None:
            continue
        seed = seed_rows[doc["doc_id"]]["nll_sum"]
        if not math.isfinite(seed):
            _fail(label, where, f"the seed's loss {seed} is not finite")
        if row.get("seed_nll_sum") != seed:
            _fail(label, where, f"seed loss {row.get('seed_nll_sum')} differs from the seed's own {seed}")
        change = (row["nll_sum"] - seed) / weight
        if not math.isclose(row.get("change_nats_per_token", math.nan), change, rel_tol=1e-9, abs_tol=1e-12):
            _fail(label, where, f"change {row.get('change_nats_per_token')} != recomputed {change}")


def machine() -> dict:
    """Where a regeneration check ran: its result holds for this kind of CPU (or GPU) and these kernels."""
    import torch

    return {"machine": platform.machine(), "processor": platform.processor() or None,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "python": platform.python_version()}


def stored_identity(run_dir: Path) -> str:
    """The prepared identity recomputed from the files under prepared/ (what scoring reads)."""
    from nshard.run.data import Prepared, prepared_identity

    prepared = Path(run_dir) / "prepared"
    docs = [json.loads(line) for line in (prepared / "documents.jsonl").read_text().splitlines() if line.strip()]
    schedule = json.loads((prepared / "schedule.json").read_text())
    sets = json.loads((prepared / "sets.json").read_text())
    rows = [Prepared(d["doc_id"], d["input_ids"], d["weights"], d.get("prompt_ids"), d.get("expected")) for d in docs]
    return prepared_identity(rows, schedule, sets)


def rebuild_prepared(run_dir: Path, plan_path: Path | None, tokenizer) -> dict:
    """The run's prepared identity three ways: recorded, recomputed from prepared/'s files, rebuilt from the plan."""
    from nshard.files import file_sha256
    from nshard.run import data as data_mod
    from nshard.run.chat import chat_data
    from nshard.run.cohort import start_model_spec
    from nshard.run.device import run_placement
    from nshard.run.models import resolve_model
    from nshard.run.plan import load_plan
    from nshard.run.replay import heldout_retention_documents, replay_documents

    run_dir = Path(run_dir)
    run = json.loads((run_dir / "run.json").read_text())
    plan_path = Path(plan_path or run_dir / "plan.toml")
    if file_sha256(plan_path) != run.get("plan_sha256"):
        _fail("prepared", str(plan_path), f"plan sha256 {file_sha256(plan_path)[:16]} is not the one "
                                          f"{run_dir / 'run.json'} records ({str(run.get('plan_sha256'))[:16]})")
    recorded = json.loads((run_dir / "prepared" / "identity.json").read_text())["prepared_identity"]
    if recorded != run.get("prepared_identity"):
        _fail("prepared", "identity.json", f"{recorded[:16]} differs from run.json's {run.get('prepared_identity')}")
    from_files = stored_identity(run_dir)
    if from_files != recorded:
        _fail("prepared", "documents.jsonl/schedule.json/sets.json",
              f"recompute to identity {from_files[:16]}, not the recorded {recorded[:16]}: a file under "
              f"{run_dir / 'prepared'} was changed")
    plan = load_plan(plan_path)
    ref = resolve_model(start_model_spec(plan))
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    placement = run_placement(ds_config)
    with_replay = run.get("replay", True)  # a no-replay arm (nshard/train.py --no_replay) prepared none
    replay = replay_documents(plan, ref, tokenizer, placement) if with_replay else []
    *_, sets, rebuilt = data_mod.prepare(plan, tokenizer, replay, with_replay=with_replay,
                                         chat=chat_data(plan, tokenizer),
                                         retention_heldout=heldout_retention_documents(plan, ref, tokenizer, placement))
    if rebuilt != recorded:
        stored_sets = json.loads((run_dir / "prepared" / "sets.json").read_text())
        what = "its evaluation or retention sets differ" if sets != stored_sets else "its documents or schedule differ"
        _fail("prepared", str(plan_path), f"rebuilding the inputs from the plan gives identity {rebuilt[:16]}, the "
                                          f"run recorded {recorded[:16]} ({what})")
    return {"prepared_identity": recorded, "rebuilt_from": str(plan_path), "recomputed_from_files": True}


def regeneration_shares(label: str, summary: dict, rows: list[dict], retention_rows: list[dict],
                        heldout_rows: list[dict], retention_heldout_rows: list[dict], sets, run_dir: Path,
                        processes: int) -> list[tuple]:
    """regenerate_share's arguments for each of `processes` processes (every processes-th scoring batch; the first
    also scores the retention documents and own held-out rows again), once the model's files and placement are the
    ones scoring used."""
    from nshard.evidence.commit import model_files
    from nshard.study.evaluate import run_placement, scoring_batches

    model_dir = Path(summary["model_dir"])
    if model_files(model_dir) != summary.get("model_files"):
        _fail(label, str(model_dir), "the model's files are not the ones this evaluation scored")
    placement = run_placement(run_dir)
    if (summary.get("device"), summary.get("dtype")) != (placement.device, placement.dtype):
        _fail(label, "summary.json", f"scored on {summary.get('device')} in {summary.get('dtype')}, but the run's "
                                     f"placement is {placement.device} in {placement.dtype}: score it again there")
    inputs = [r["input_ids"] for r in rows]
    stored = [(r["generated_ids"], r.get("cut", False)) for r in rows]
    case_ids = [r["case_id"] for r in rows]
    targets = [answer_target(r["family"], r["expected"]) for r in rows]  # check_cases compared them with the rebuild
    batch_size = summary.get("batch_size") or 16
    batches = len(scoring_batches(inputs, batch_size))
    losses = [("retention", retention_rows, sets.retention),
              ("heldout", heldout_rows, list(sets.heldout) if heldout_rows else []),
              ("retention_heldout", retention_heldout_rows, list(sets.retention_heldout))]
    return [(label, str(model_dir), placement, summary.get("threads"), inputs, targets, stored, case_ids,
             summary["max_new_tokens"], batch_size, list(range(k, batches, processes)), losses if k == 0 else [])
            for k in range(processes)]


def regenerate_share(label: str, model_dir: str, placement, threads: int | None, inputs: list[list[int]],
                     targets: list[tuple[str, bool]], stored: list[tuple[list[int], bool]], case_ids: list[str],
                     max_new_tokens: int, batch_size: int, batches: list[int], losses: list[tuple]) -> dict:
    """The answers of the scoring batches numbered `batches` generated again by the call scoring made (the same
    batches, padding, placement, dtype and thread count) and compared token for token with the stored ones; each
    of `losses` ((what, stored rows, documents)) scored again and compared loss for loss. Loads the model itself, so
    it can run in a process of its own."""
    from nshard.run.device import load_for_inference
    from nshard.run.models import ModelRef, load_tokenizer
    from nshard.study.evaluate import generate_answers, retention_losses

    ref = ModelRef(model_dir, str(Path(model_dir).resolve()), None, "local")
    tokenizer = load_tokenizer(ref)
    model = load_for_inference(ref, placement)
    # bf16 kernels may split their sums by thread: the same thread count as scoring gives the same bits.
    with torch_threads(threads) as used:
        t0 = time.perf_counter()
        again = generate_answers(model, tokenizer, inputs, max_new_tokens, batch_size, desc=f"{label}: regenerate",
                                 batches=batches, targets=targets)
        generate_s = time.perf_counter() - t0
        for i, (ids, cut) in again.items():
            if ids != stored[i][0]:
                _fail(label, case_ids[i], _first_token_difference(model, inputs[i], stored[i][0], ids))
            if cut != stored[i][1]:
                _fail(label, case_ids[i], f"generated again, the answer is {'' if cut else 'not '}cut; the file "
                                          f"says cut={stored[i][1]}")
        t1 = time.perf_counter()
        for what, stored_rows, docs in losses:
            for row, fresh in zip(stored_rows, retention_losses(model, docs, desc=f"{label}: rescore {what}")):
                if not math.isclose(fresh["nll_sum"], row["nll_sum"], rel_tol=RETENTION_RTOL, abs_tol=1e-9):
                    _fail(label, f"{what} {fresh['doc_id']}", f"scored again, its loss is {fresh['nll_sum']!r}; "
                                                              f"the file says {row['nll_sum']!r}")
    return {"batches": len(batches), "generate_s": generate_s, "retention_s": time.perf_counter() - t1,
            "threads": used}


def regeneration_record(summary: dict, rows: list[dict], retention_rows: list[dict], heldout_rows: list[dict],
                        retention_heldout_rows: list[dict], shares: list[dict]) -> dict:
    return {"cases": len(rows), "batches": sum(s["batches"] for s in shares), "retention_docs": len(retention_rows),
            "heldout_docs": len(heldout_rows), "retention_heldout_docs": len(retention_heldout_rows),
            "generate_s": sum(s["generate_s"] for s in shares),
            "retention_s": sum(s["retention_s"] for s in shares), "processes": len(shares),
            "device": summary.get("device"), "dtype": summary.get("dtype"), "threads": shares[0]["threads"]}


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """Run with `threads` intra-op threads (None: as is), then restore the count."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _first_token_difference(model, prompt: list[int], stored: list[int], again: list[int]) -> str:
    """The first position where two greedy continuations part, with the model's scores of both tokens there."""
    import torch

    k = next((j for j, (a, b) in enumerate(zip(stored, again)) if a != b), min(len(stored), len(again)))
    a = stored[k] if k < len(stored) else None
    b = again[k] if k < len(again) else None
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + stored[:k]], device=model.device), use_cache=False).logits[0, -1]
    score = lambda t: "end" if t is None else f"{t} (score {logits[t].item():.6g})"
    return (f"regenerated answer differs at generated token {k}: the file has {score(a)}, generated again "
            f"{score(b)}; on another kind of CPU a near-tie can flip, see the machine in the validation record")


def find_seed(eval_dirs: dict[str, Path], summaries: dict[str, dict], record: dict | None,
              seed_label: str = "seed") -> str | None:
    """The evaluation of the seed model: the one whose files the record commits as the seed (by label without one)."""
    if record is None:
        return seed_label if seed_label in eval_dirs else None
    named = [label for label, s in summaries.items() if s.get("model_files") == record["seed"]["files"]]
    if len(named) != 1:
        _fail("seed", "commitment.json", f"{len(named)} evaluations scored the model the record commits as the seed "
                                         f"({named}); exactly one must")
    return named[0]


def validate(run_dir: Path, tokenizer, eval_dirs: dict[str, Path], *, record: dict | None = None,
             plan_path: Path | None = None, rebuild: bool = True, regenerate: bool = True) -> dict:
    """Validate every evaluation directory against the run's prepared sets; returns the recounts and, per
    evaluation, the flags and losses it validated (the analysis uses no others).
    record: the study's commitment (finds the seed); plan_path: the plan the prepared inputs are rebuilt from;
    regenerate: generate every answer and score every retention document again (False: the stored files are
    checked against each other only, and the analysis calls the result exploratory)."""
    run_dir = Path(run_dir)
    prepared = rebuild_prepared(run_dir, plan_path, tokenizer) if rebuild else None
    try:
        sets = load_run_sets(run_dir)
    except EvalError as exc:
        raise ValidationError(f"validation failed: {exc}") from None
    answers = {d["doc_id"]: d for d in sets.answers}
    case_ids = [c.case_id for c in sets.cases] + list(answers)
    summaries = {}
    for label, d in eval_dirs.items():
        if not (Path(d) / "summary.json").is_file():
            _fail(label, str(d), "no summary.json: the evaluation did not finish")
        summaries[label] = json.loads((Path(d) / "summary.json").read_text())
    if rebuild:
        check_settings(summaries, Path(plan_path or run_dir / "plan.toml"))
    seed_label = find_seed(eval_dirs, summaries, record)
    seed_rows = seed_heldout = None
    if seed_label is not None:
        seed_rows = {r["doc_id"]: r for r in read_jsonl(Path(eval_dirs[seed_label]) / "retention.jsonl")}
        seed_heldout = {r["doc_id"]: r for r in read_seed_heldout(Path(eval_dirs[seed_label]))}
    report, stored, rebuilt = {}, {}, RebuiltCases(tokenizer)
    for label, d in eval_dirs.items():
        report[label], stored[label] = check_evaluation(label, Path(d), summaries[label], sets, case_ids, tokenizer,
                                                        run_dir, label == seed_label, seed_rows, answers, rebuilt,
                                                        seed_heldout)
    if regenerate:
        # Every model's batches shared among the processes scoring used side by side, each at the thread count its
        # scores were made at (the bits depend on it, not on which process made a batch).
        from nshard.run.device import cuda_available
        from nshard.study.evaluate import side_by_side, side_by_side_layout

        threads = max(s.get("threads") or 1 for s in summaries.values())
        batch_size = min(s.get("batch_size") or 16 for s in summaries.values())
        max_new = max(s.get("max_new_tokens") or 0 for s in summaries.values())
        processes, _ = side_by_side_layout(len(case_ids), batch_size, max_new, cuda_available())
        processes = max(1, min(processes, usable_cores() // threads))
        jobs = {label: regeneration_shares(label, summaries[label], *stored[label], sets, run_dir, processes)
                for label in eval_dirs}
        shares = side_by_side(regenerate_share, [job for label in eval_dirs for job in jobs[label]], processes,
                              threads if processes > 1 else None)
        for k, label in enumerate(eval_dirs):
            report[label]["regenerated"] = regeneration_record(summaries[label], *stored[label],
                                                               shares[k * processes:(k + 1) * processes])
    out = {"passed": True, "prepared_identity": sets.prepared_identity, "case_ids": len(case_ids),
           "seed": seed_label, "seed_found_by": "record" if record is not None else "label",
           "prepared": prepared, "regenerated": regenerate, "evaluations": report}
    if regenerate:
        out["machine"] = machine()
    return out


def check_settings(summaries: dict[str, dict], plan_path: Path) -> None:
    """Each evaluation was scored with the plan's generation settings: regeneration repeats what summary.json says,
    so a shorter max_new_tokens written there (an answer cut to its right prefix) must not go unseen."""
    from nshard.run.plan import load_plan

    study = load_plan(plan_path).study
    for label, summary in summaries.items():
        for key, want in (("max_new_tokens", study.eval_max_new_tokens), ("batch_size", study.eval_batch_size)):
            if summary.get(key) != want:
                _fail(label, "summary.json", f"{key} {summary.get(key)!r} is not the plan's study.eval_{key} "
                                             f"{want} ({plan_path}); score it again with the plan's settings")


def check_evaluation(label: str, d: Path, summary: dict, sets, case_ids: list[str], tokenizer, run_dir: Path,
                     is_seed: bool, seed_rows: dict | None, answers: dict | None = None,
                     rebuilt: RebuiltCases | None = None, seed_heldout: dict | None = None) -> tuple[dict, tuple]:
    """One evaluation directory: its stored files checked against each other and the prepared sets (the task
    cases and the own rows with an expected answer (answers: doc_id -> prepared row), the retention documents and
    the own held-out rows). Returns what the analysis may use (each case's flag and each document's loss, as
    validated; "regenerated" None until regeneration fills it) and the stored rows regeneration_shares takes (cases,
    retention, held-out)."""
    if summary.get("prepared_identity") != sets.prepared_identity:
        _fail(label, "summary.json", "scored against another run's prepared sets")
    rows = read_jsonl(d / "cases.jsonl")
    per_family = check_cases(label, rows, case_ids, tokenizer, answers, rebuilt)
    if per_family != summary.get("per_family"):
        _fail(label, "summary.json", f"per-family counts {summary.get('per_family')} != recount {per_family}")
    if not is_seed and seed_rows is None:
        _fail(label, "retention.jsonl", "no seed evaluation to recompute its retention change against")
    if not is_seed and not summary.get("with_seed_retention"):
        _fail(label, "summary.json", "scored without the seed's retention losses; score it with --seed_eval")
    retention_rows = read_jsonl(d / "retention.jsonl")
    check_retention(label, retention_rows, sets.retention, None if is_seed else seed_rows)
    heldout_rows = []
    if sets.heldout:
        heldout_rows = read_jsonl(d / "heldout.jsonl")
        check_retention(label, heldout_rows, sets.heldout, None, "heldout")
        if heldout_summary(heldout_rows) != summary.get("heldout"):
            _fail(label, "summary.json", f"held-out totals {summary.get('heldout')} != recount "
                                         f"{heldout_summary(heldout_rows)}")
    retention_heldout_rows = read_seed_heldout(d)
    check_retention(label, retention_heldout_rows, list(sets.retention_heldout), None if is_seed else seed_heldout,
                    "retention_heldout")
    out = {"cases": len(case_ids), "correct": sum(f["correct"] for f in per_family.values()),
           "retention_docs": len(sets.retention), "heldout_docs": len(sets.heldout),
           "retention_heldout_docs": len(sets.retention_heldout), "regenerated": None,
           "case_results": {r["case_id"]: {"family": r["family"], "correct": r["correct"]} for r in rows},
           "retention_docs_checked": {r["doc_id"]: {"nll_sum": r["nll_sum"], "target_weight": r["target_weight"]}
                                      for r in retention_rows}}
    if sets.heldout:
        out["heldout_docs_checked"] = {r["doc_id"]: {"nll_sum": r["nll_sum"], "target_weight": r["target_weight"]}
                                       for r in heldout_rows}
    if sets.retention_heldout:
        out["retention_heldout_docs_checked"] = {r["doc_id"]: {"nll_sum": r["nll_sum"],
                                                               "target_weight": r["target_weight"]}
                                                 for r in retention_heldout_rows}
    return out, (rows, retention_rows, heldout_rows, retention_heldout_rows)


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes nothing of its own: prints the validation report as one JSON line (a study writes it to "
              "STUDY_DIR/validation.json). " + SPELLING_NOTE)
    parser = ArgumentParser(prog=prog("nshard.study.validate"), description=__doc__, epilog=epilog)
    parser.add_argument("--run", required=True, type=Path, help="run directory whose prepared/ sets were scored")
    parser.add_argument("--tokenizer", required=True, type=Path, help="model directory with the tokenizer")
    parser.add_argument("--commitment", type=Path, help="the study's commitment record (finds the seed by its files)")
    parser.add_argument("--plan", type=Path, help="plan to rebuild the prepared inputs from (default: RUN/plan.toml)")
    parser.add_argument("--no_regenerate", action="store_true",
                        help="check the stored files against each other only; the analysis then calls the result "
                             "exploratory")
    parser.add_argument("--regenerate_batches", help=argparse.SUPPRESS)
    parser.add_argument("evals", nargs="+", type=Path, help="evaluation directories (label = directory name)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from nshard.evidence.commit import CommitError, load_commitment
    from nshard.run.models import ModelRef, load_tokenizer

    if args.regenerate_batches is not None:
        print("nshard.validate: error: --regenerate_batches is gone: validation now generates every answer and "
              "scores every retention document again (a sample of batches could miss a forged case); drop the "
              "option, or give --no_regenerate to skip regeneration", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(ModelRef(str(args.tokenizer), str(args.tokenizer.resolve()), None, "local"))
    try:
        record = load_commitment(args.commitment) if args.commitment else None
        report = validate(args.run, tokenizer, {d.name: d for d in args.evals}, record=record, plan_path=args.plan,
                          regenerate=not args.no_regenerate)
    except CommitError as exc:
        print(f"nshard.validate: error: {exc}", file=sys.stderr)
        return 2
    except (ValidationError, OSError) as exc:
        print(f"nshard.validate: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
