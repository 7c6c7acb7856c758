"""Post-scoring validation: a separate pass that trusts nothing the evaluation wrote.

    python -m nshard.study.validate --run RUN_DIR --tokenizer MODEL_DIR EVAL_DIR [EVAL_DIR ...]

For every case it rebuilds the case from its ID, re-renders and re-tokenizes the prompt, checks that
the expected answer is not inside the model input, decodes the stored token ids and compares them
with the stored text, and re-scores the text. Across evaluations it checks that every model was
scored on the same case IDs and retention documents, and that every loss is finite. The first
disagreement stops with a message that names the evaluation and the case.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from nshard import tasks
from nshard.study.evaluate import EvalError, case_from_id, load_run_sets, prompt_ids, read_jsonl


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


def check_cases(label: str, rows: list[dict], case_ids: list[str], tokenizer) -> dict:
    """Every stored case line against a fresh rebuild; returns the recounted totals."""
    seen = [r.get("case_id") for r in rows]
    if seen != case_ids:
        missing = sorted(set(case_ids) - set(seen))
        extra = sorted(set(seen) - set(case_ids))
        where = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}" if extra else "order or repeats"
        _fail(label, "cases.jsonl", f"case IDs differ from the run's evaluation set ({where})")
    per_family: dict[str, dict] = {}
    for row in rows:
        cid = row["case_id"]
        case = case_from_id(cid)
        if row.get("family") != case.family or row.get("prompt") != tasks.prompt(case):
            _fail(label, cid, "stored family or prompt differs from the case rebuilt from its ID")
        if row.get("expected") != tasks.answer(case):
            _fail(label, cid, f"stored expected answer {row.get('expected')!r} != {tasks.answer(case)!r}")
        model_input = prompt_ids(tokenizer, case)
        if row.get("input_ids") != model_input:
            _fail(label, cid, "stored input ids differ from the re-rendered, re-tokenized prompt")
        if _contains(model_input, assistant_turn_ids(tokenizer, case)):
            _fail(label, cid, "the expected answer's assistant turn is inside the model input")
        decoded = tokenizer.decode(row.get("generated_ids", []), skip_special_tokens=True)
        if decoded != row.get("generated_text"):
            _fail(label, cid, f"stored token ids decode to {decoded!r}, not the stored text "
                              f"{row.get('generated_text')!r}")
        correct = tasks.score(case, decoded)
        if correct != row.get("correct"):
            _fail(label, cid, f"re-scoring gives correct={correct}, the file says {row.get('correct')}")
        fam = per_family.setdefault(case.family, {"correct": 0, "cases": 0})
        fam["cases"] += 1
        fam["correct"] += correct
    return per_family


def check_retention(label: str, rows: list[dict], retention: list[dict], seed_rows: dict | None) -> None:
    if [r.get("doc_id") for r in rows] != [d["doc_id"] for d in retention]:
        _fail(label, "retention.jsonl", "retention document IDs differ from the run's retention set")
    for row, doc in zip(rows, retention):
        where = f"retention {doc['doc_id']}"
        if not math.isfinite(row.get("nll_sum", math.nan)):
            _fail(label, where, f"loss {row.get('nll_sum')} is not finite")
        weight = math.fsum(doc["weights"][1:])
        tokens = sum(1 for w in doc["weights"][1:] if w > 0)
        if row.get("target_tokens") != tokens or not math.isclose(row.get("target_weight", -1), weight):
            _fail(label, where, "target tokens or weight differ from the prepared document's weights")
        if seed_rows is None:
            continue
        seed = seed_rows[doc["doc_id"]]["nll_sum"]
        if row.get("seed_nll_sum") != seed:
            _fail(label, where, f"seed loss {row.get('seed_nll_sum')} differs from the seed's own {seed}")
        change = (row["nll_sum"] - seed) / weight
        if not math.isclose(row.get("change_nats_per_token", math.nan), change, rel_tol=1e-9, abs_tol=1e-12):
            _fail(label, where, f"change {row.get('change_nats_per_token')} != recomputed {change}")


def validate(run_dir: Path, tokenizer, eval_dirs: dict[str, Path], seed_label: str | None = "seed") -> dict:
    """Validate every evaluation directory against the run's prepared sets; returns the recounts."""
    try:
        sets = load_run_sets(run_dir)
    except EvalError as exc:
        raise ValidationError(f"validation failed: {exc}") from None
    case_ids = [c.case_id for c in sets.cases]
    seed_rows = None
    if seed_label in eval_dirs:
        seed_rows = {r["doc_id"]: r for r in read_jsonl(Path(eval_dirs[seed_label]) / "retention.jsonl")}
    report = {}
    for label, d in eval_dirs.items():
        d = Path(d)
        if not (d / "summary.json").is_file():
            _fail(label, str(d), "no summary.json: the evaluation did not finish")
        summary = json.loads((d / "summary.json").read_text())
        if summary.get("prepared_identity") != sets.prepared_identity:
            _fail(label, "summary.json", "scored against another run's prepared sets")
        per_family = check_cases(label, read_jsonl(d / "cases.jsonl"), case_ids, tokenizer)
        if per_family != summary.get("per_family"):
            _fail(label, "summary.json", f"per-family counts {summary.get('per_family')} != recount {per_family}")
        is_seed = label == seed_label
        check_retention(label, read_jsonl(d / "retention.jsonl"), sets.retention,
                        None if is_seed or not summary.get("with_seed_retention") else seed_rows)
        report[label] = {"cases": len(case_ids), "correct": sum(f["correct"] for f in per_family.values()),
                         "retention_docs": len(sets.retention)}
    return {"passed": True, "prepared_identity": sets.prepared_identity, "case_ids": len(case_ids),
            "evaluations": report}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, type=Path, help="run directory whose prepared/ sets were scored")
    parser.add_argument("--tokenizer", required=True, type=Path, help="model directory with the tokenizer")
    parser.add_argument("evals", nargs="+", type=Path, help="evaluation directories (label = directory name)")
    args = parser.parse_args(argv)
    from nshard.run.models import ModelRef, load_tokenizer

    tokenizer = load_tokenizer(ModelRef(str(args.tokenizer), str(args.tokenizer.resolve()), None, "local"))
    try:
        report = validate(args.run, tokenizer, {d.name: d for d in args.evals})
    except ValidationError as exc:
        print(f"nshard.validate: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
