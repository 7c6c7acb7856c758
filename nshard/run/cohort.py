"""A second cohort's view of the accepted study: its candidate's run directory, the first cohort's plan and
evaluation cases, and the share of its training cases replayed, read from the study directory's files. What
vouches for those files is checked elsewhere: nshard/study/cohort.py (the study) and nshard/run/start.py (a rank)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from nshard.run.plan import Plan, PlanError, load_plan


class CohortError(PlanError):
    """A [cohort] plan whose accepted study cannot be continued from; the message names the file and the fix."""


@dataclass(frozen=True)
class AcceptedStudy:
    """Where the accepted study's candidate lies, and what its first cohort trained and evaluated on."""

    study_dir: Path
    candidate: str
    record_sha256: str
    """commitment.json's own hash, as the file states it (nshard.evidence.commit.load_commitment checks it)."""
    first_plan: Plan
    first_eval_case_ids: tuple[str, ...]
    candidate_per_family: dict = field(default_factory=dict)
    """The candidate's accuracy per first-cohort family in its own study (results.json), {family: share}."""

    def screened_families(self, min_accuracy: float) -> list[str]:
        """The first-cohort families a second cohort's paired screen counts: every one the candidate answered at least
        `min_accuracy` of in its own study (cohort.screen_min_accuracy), in the first plan's order. Refused when
        none qualifies: the screen would have no cases."""
        families = list(self.first_plan.data.families)
        if min_accuracy <= 0.0:
            return families
        missing = [f for f in families if f not in self.candidate_per_family]
        if missing:
            raise CohortError(f"cohort.screen_min_accuracy={min_accuracy}: {self.study_dir}/results.json holds no "
                              f"accuracy of the candidate for {missing}; set it to 0 to screen every family")
        kept = [f for f in families if self.candidate_per_family[f] >= min_accuracy]
        if not kept:
            shares = ", ".join(f"{f} {self.candidate_per_family[f]:.1%}" for f in families)
            raise CohortError(f"cohort.screen_min_accuracy={min_accuracy}: the candidate answered less than that of "
                              f"every first-cohort family ({shares}); lower it")
        return kept

    @property
    def run_dir(self) -> Path:
        return self.study_dir / "arms" / self.candidate

    @property
    def model_dir(self) -> Path:
        return self.run_dir / "model"


def read_json(path: Path, fix: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise CohortError(f"cohort.from: {path} cannot be read ({exc}); {fix}") from None


def read_accepted(study_dir: str | Path) -> AcceptedStudy:
    """The study directory's candidate, record hash, first plan and evaluation cases (files only, nothing checked
    beyond their presence)."""
    study_dir = Path(study_dir)
    if not (study_dir / "study.json").is_file():
        raise CohortError(f"cohort.from={str(study_dir)!r} is not a study directory (no study.json); name the "
                          "directory python -m nshard.study wrote")
    results = read_json(study_dir / "results.json", "finish the study (python -m nshard.study) before a cohort")
    record = read_json(study_dir / "commitment.json", "an accepted study has a commitment record")
    candidate = results.get("candidate")
    run_dir = study_dir / "arms" / str(candidate)
    if not (run_dir / "plan.toml").is_file():
        raise CohortError(f"cohort.from: the candidate {candidate!r} has no run directory {run_dir}; the study is "
                          "incomplete")
    sets = read_json(run_dir / "prepared" / "sets.json", "the candidate's prepared inputs are incomplete")
    arm = next((a for a in results.get("arms", []) if a.get("name") == candidate), {})
    per_family = {f: b["correct"] / b["cases"] for f, b in (arm.get("per_family") or {}).items() if b.get("cases")}
    return AcceptedStudy(study_dir, str(candidate), str(record.get("record_sha256")), load_plan(run_dir / "plan.toml"),
                         tuple(sets.get("eval_case_ids", ())), per_family)


def start_model_spec(plan: Plan) -> str:
    """The model a run starts from: the accepted candidate's export for a second cohort, else model.spec."""
    return str(read_accepted(plan.cohort.from_study).model_dir) if plan.cohort.enabled else plan.model.spec
