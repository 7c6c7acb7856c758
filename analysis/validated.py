"""The scores the analysis may use: exactly those post-scoring validation checked (validation.json), each case's
family and flag (own rows with an expected answer included) and each retention document's and own held-out row's
loss and weight. Reads files only."""

from __future__ import annotations

import json
from pathlib import Path


class NotValidated(ValueError):
    """Scores that validation did not pass, or that changed since it did; the message names the evaluation and case."""


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise NotValidated(f"{path} is missing")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_validated(study_dir: Path, labels: list[str]) -> list[str]:
    """Every evaluation in `labels` against validation.json. Raises NotValidated where validation is missing, did
    not pass, does not cover an evaluation, or holds another value than the file now does; returns the reasons that
    make the result exploratory (validation that did not regenerate the answers)."""
    path = Path(study_dir) / "validation.json"
    rerun = (f"run python -m nshard.study.validate (docs/study.md) on {study_dir}'s evaluations, or the study again")
    if not path.is_file():
        raise NotValidated(f"{path} is missing: the scores were never validated; {rerun}")
    validation = json.loads(path.read_text())
    if validation.get("passed") is not True:
        raise NotValidated(f"{path}: validation did not pass ({validation.get('error', 'no error recorded')}); the "
                           "study's scores are not accepted")
    for label in labels:
        checked = (validation.get("evaluations") or {}).get(label)
        if checked is None or "case_results" not in checked:
            raise NotValidated(f"{path} does not cover evaluation {label}; {rerun}")
        check_cases(study_dir, label, checked["case_results"])
        check_retention(study_dir, label, checked["retention_docs_checked"])
        check_retention(study_dir, label, checked.get("heldout_docs_checked"), "heldout")
        check_retention(study_dir, label, checked.get("retention_heldout_docs_checked"), "retention_heldout")
    if not validation.get("regenerated"):
        return [f"{path}: validation did not generate the answers again (study.validate_regenerate = false)"]
    return []


def check_cases(study_dir: Path, label: str, validated: dict[str, dict]) -> None:
    path = Path(study_dir) / "eval" / label / "cases.jsonl"
    rows = _rows(path)
    ids = [r.get("case_id") for r in rows]
    if sorted(map(str, ids)) != sorted(validated):
        other = sorted(set(map(str, ids)) ^ set(validated)) or ["repeated"]
        raise NotValidated(f"{path}: evaluation {label}, case {other[0]}: the cases differ from the ones validation "
                           "checked (added, removed or repeated since); validate the study again")
    for row in rows:
        want = validated[row["case_id"]]
        for key in ("family", "correct"):
            if row.get(key) != want[key]:
                raise NotValidated(f"{path}: evaluation {label}, case {row['case_id']}: {key}={row.get(key)!r}, but "
                                   f"validation found {want[key]!r}: the file changed after validation")


def check_retention(study_dir: Path, label: str, validated: dict[str, dict] | None, what: str = "retention") -> None:
    """what="heldout": an evaluation's own held-out rows (heldout.jsonl), "retention_heldout": its held-out retention
    documents (retention_heldout.jsonl); validated None: validation saw none, so the evaluation must hold none either."""
    path = Path(study_dir) / "eval" / label / f"{what}.jsonl"
    if what != "retention" and validated is None:
        if path.is_file() and _rows(path):
            rows = {"heldout": "held-out rows", "retention_heldout": "held-out retention rows"}[what]
            raise NotValidated(f"{path}: evaluation {label}: holds {rows} that validation did not check; "
                               "validate the study again")
        return
    rows = _rows(path)
    if sorted(str(r.get("doc_id")) for r in rows) != sorted(validated):
        raise NotValidated(f"{path}: evaluation {label}: the {what} documents differ from the ones validation "
                           "checked; validate the study again")
    for row in rows:
        want = validated[row["doc_id"]]
        for key in ("nll_sum", "target_weight"):
            if row.get(key) != want[key]:
                raise NotValidated(f"{path}: evaluation {label}, {what} {row['doc_id']}: {key}={row.get(key)!r}, "
                                   f"but validation found {want[key]!r}: the file changed after validation")
