"""A second cohort's paired screen counts only what can move: the first-cohort families the accepted candidate
answers (cohort.screen_min_accuracy), and its comparisons against controls declare their own power
(screens.expected_control_discordance). Plain files and functions: the fast tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.report import power_entry, screening_lines
from nshard.run.cohort import AcceptedStudy, CohortError
from nshard.run.plan import PlanError, plan_from_dict

FAMILIES = ["lookup", "filtering", "sorting", "invoice"]
SCREENS = {"min_paired_lower_points": -3.0, "confidence": 0.99, "expected_discordance": 0.15}


def accepted(per_family: dict) -> AcceptedStudy:
    first = plan_from_dict({"name": "first", "data": {"families": FAMILIES}})
    return AcceptedStudy(study_dir=Path("/nowhere"), candidate="powersgd", record_sha256="x",
                         first_plan=first, first_eval_case_ids=(), candidate_per_family=per_family)


def test_only_the_families_the_accepted_candidate_answers_are_screened():
    study = accepted({"lookup": 0.47, "filtering": 0.016, "sorting": 0.016, "invoice": 0.0})
    assert study.screened_families(0.0) == FAMILIES  # 0: every family, as before
    assert study.screened_families(0.01) == ["lookup", "filtering", "sorting"]
    assert study.screened_families(0.05) == ["lookup"]
    with pytest.raises(CohortError, match=r"cohort.screen_min_accuracy=0.5: .* \(lookup 47.0%, filtering 1.6%"):
        study.screened_families(0.5)
    with pytest.raises(CohortError, match=r"holds no accuracy of the candidate for \['invoice'\]"):
        accepted({"lookup": 0.47, "filtering": 0.0, "sorting": 0.0}).screened_families(0.05)


def test_the_screen_family_share_and_the_control_discordance_are_checked_in_the_plan():
    with pytest.raises(PlanError, match=r"cohort.screen_min_accuracy=1.0 must lie in \[0, 1\)"):
        plan_from_dict({"cohort": {"screen_min_accuracy": 1.0}})
    with pytest.raises(PlanError, match="screens.expected_control_discordance=1.0 must lie below 1"):
        plan_from_dict({"screens": {"expected_control_discordance": 1.0}})
    assert plan_from_dict({"cohort": {"screen_min_accuracy": 0.05}}).cohort.screen_min_accuracy == 0.05


def test_a_comparison_against_a_control_takes_its_own_declared_discordance():
    screen = power_entry("first-cohort", 512, SCREENS)
    control = power_entry("vs no-replay", 512, {**SCREENS, "expected_control_discordance": 0.05}, control=True)
    same = power_entry("vs no-replay", 512, {**SCREENS, "expected_control_discordance": -1.0}, control=True)
    assert screen["expected_discordance"] == same["expected_discordance"] == 0.15
    assert control["expected_discordance"] == 0.05
    # fewer discordant pairs expected: the same n gives an equal candidate a better chance to pass
    assert control["equal_pass_probability"] > screen["equal_pass_probability"]


def test_the_report_names_the_families_left_out_of_the_screen():
    assert screening_lines({"screened": FAMILIES, "not_screened": [], "min_accuracy": 0.0}) == []
    line, = screening_lines({"screened": ["lookup"], "not_screened": ["filtering", "sorting", "invoice"],
                             "min_accuracy": 0.05})
    assert "screened: lookup; not screened: filtering, sorting, invoice" in line and "less than 5%" in line
