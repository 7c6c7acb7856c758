"""Accepting a finished study for a second cohort: its candidate passed its quality screen, its export is what
the commitment record and its manifest name, and its results validate (the analysis recomputed from the files
gives the same screen, and the post-scoring validation passes again).

    python -m nshard.study.cohort STUDY_DIR [--start state|weights] [--ranks N]

Prints the acceptance record (the provenance chain: the first study's seed, its commitment, the accepted
candidate) as JSON; a refusal is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
from nshard.evidence.commit import files_sha256
from nshard.files import file_sha256
from nshard.run.cohort import CohortError, read_json
from nshard.run.plan import CohortSection, Plan, PlanError


def accept(plan: Plan, ranks: tuple[int, ...] = (), validate_results: bool = True) -> dict:
    """The acceptance record of plan.cohort.from_study, or CohortError naming why it cannot be continued from.
    `ranks`: the rank counts of the arms that will start from it; an arm on another rank count than the state's
    (start = "state") continues it elastically (nshard/run/elastic.py), and the record names those counts."""
    from nshard.run.start import find_start

    points = {n: find_start(plan, n) for n in sorted(set(ranks)) or [None]}
    point = next(iter(points.values()))
    study = Path(point.provenance["study"])
    if validate_results:
        check_results(study)
    prov = point.provenance
    return {"kind": "nshard-cohort-start", "study": str(study), "start": point.kind,
            "dense_warmup": point.dense_warmup, "state": prov["state"],
            "state_world_size": prov["state_world_size"],
            "elastic_ranks": sorted(n for n, p in points.items() if p.provenance["elastic"]),
            "first_seed_files_sha256": files_sha256(prov["seed_files"]),
            "first_commitment_sha256": prov["commitment_sha256"],
            "first_commitment_json_sha256": file_sha256(study / "commitment.json"),
            "first_results_json_sha256": file_sha256(study / "results.json"),
            "candidate": prov["candidate"], "candidate_parameter_root": prov["parameter_root"],
            "candidate_files": prov["model_files"], "candidate_files_sha256": files_sha256(prov["model_files"]),
            "model_dir": str(point.model_dir)}


def check_results(study: Path) -> None:
    """results.json is what the study's files give (the quality screen recomputed), and the scores validate."""
    from nshard.analysis.report import StudyError, analyze

    results = read_json(study / "results.json", "finish the study first")
    try:
        fresh = analyze(study)
    except (StudyError, OSError, KeyError, TypeError, ValueError) as exc:
        raise CohortError(f"cohort.from: the study's results do not validate: analyzing {study} again fails: "
                          f"{' '.join(str(exc).split())}") from None
    if canonical(fresh["screens"]["quality"]) != canonical(results["screens"]["quality"]):
        raise CohortError(f"cohort.from: {study / 'results.json'}'s quality screen is not the one the study's files "
                          "give (analyzed again); it was edited, or the files changed since: rerun "
                          f"python -m nshard.analysis.report {study}")
    validate_scores(study, results)


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


def validate_scores(study: Path, results: dict) -> None:
    """nshard.study.validate's post-scoring checks once more, on the seed's and every finished arm's scores: the
    stored files against each other (the analysis above has checked that every value is the one the study's own
    validation regenerated; regenerating again here would cost a second full scoring)."""
    from nshard.evidence.commit import load_commitment
    from nshard.run.models import ModelRef, load_tokenizer
    from nshard.study.validate import ValidationError, validate

    if not read_json(study / "validation.json", "the study's validation did not finish").get("passed"):
        raise CohortError(f"cohort.from: {study / 'validation.json'} does not say passed")
    record = load_commitment(study / "commitment.json")
    seed_dir = record["seed"]["model_dir"]
    labels = ["seed", *(a["name"] for a in results["arms"] if a["status"] == "complete")]
    try:
        validate(study / "arms" / results["candidate"], load_tokenizer(ModelRef(seed_dir, seed_dir, None, "local")),
                 {label: study / "eval" / label for label in labels}, record=record, regenerate=False)
    except (ValidationError, OSError, ValueError) as exc:  # a DataError rebuilding the inputs included
        raise CohortError(f"cohort.from: the study's results do not validate: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog("nshard.study.cohort"), description=__doc__,
                            epilog="Writes nothing: prints the acceptance record. " + SPELLING_NOTE)
    parser.add_argument("study_dir", type=Path, help="a finished study directory (python -m nshard.study --out)")
    parser.add_argument("--start", default="state", choices=("state", "weights"))
    parser.add_argument("--ranks", type=int, default=2,
                        help="ranks that continue its state (start = state); another count than the state's "
                             "continues it elastically")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cohort = CohortSection(from_study=str(args.study_dir.resolve()), start=args.start)
        record = accept(Plan(name="check", cohort=cohort), (args.ranks,))
    except PlanError as exc:  # CohortError included
        print(f"nshard.study.cohort: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(json.dumps(record, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
