"""A growth screen that can see an advantage, declared before drawing (nshard/analysis/growth.py, plan [growth]): the
power of a superiority screen against the smallest advantage worth having, the cases that give it, a first-cohort
non-inferiority sub-screen against continued dense, family-stratified estimates with declared weights, and the plan
keys that declare them. Pure logic: the fast tier."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from nshard.analysis.growth import declaration_lines, effective_cases, screen_declaration, stratified_bounds
from nshard.analysis.paired import cases_for_power, equal_pass_probability, paired_bounds, pass_probability
from nshard.analysis.report import growth_screen
from nshard.run.plan import PlanError, plan_from_dict

GROWTH = {"cohort": {"from": "runs/x", "start": "weights"}, "growth": {"budget": "train_flops"},
          "study": {"candidate": "grown", "speed_baseline": "dense",
                    "arms": [{"name": "dense", "ranks": 2}, {"name": "grown", "ranks": 2, "grown": True}]}}


def plan(**growth):
    return plan_from_dict({**GROWTH, "growth": {**GROWTH["growth"], **growth}})


def test_the_superiority_power_is_the_pass_rate_at_the_declared_advantage():
    """At no advantage it is an equal candidate's pass rate; it rises with the advantage and with the cases; the
    case count the search returns reaches the target and one case fewer does not."""
    for n in (40, 200):
        assert pass_probability(n, 0.2, -3.0, 0.9) == pytest.approx(equal_pass_probability(n, 0.2, -3.0, 0.9), abs=0)
    low, high = (pass_probability(400, 0.2, 0.0, 0.9, advantage) for advantage in (2.0, 6.0))
    assert pass_probability(400, 0.2, 0.0, 0.9) < 0.1 < low < high
    needed = cases_for_power(0.2, 0.0, 0.9, 0.8, advantage_points=6.0)
    assert pass_probability(needed, 0.2, 0.0, 0.9, 6.0) >= 0.8 > pass_probability(needed - 1, 0.2, 0.0, 0.9, 6.0)
    with pytest.raises(ValueError, match="an advantage lies in"):
        pass_probability(100, 0.02, 0.0, 0.9, 3.0)  # more advantage than discordant cases


def test_a_stratified_estimate_weighs_each_family_as_declared():
    """Family means weighted as declared, each family's variance its own; with the families' case shares as weights
    the estimate is the pooled mean, and effective_cases the pooled count."""
    family_of = {f"a{i}": "a" for i in range(20)} | {f"b{i}": "b" for i in range(60)}
    control = {c: False for c in family_of}
    candidate = {c: (c.startswith("a") and int(c[1:]) < 6) or (c.startswith("b") and int(c[1:]) < 3) for c in family_of}
    candidate["b59"], control["b58"] = False, True  # one loss in b
    even = stratified_bounds(candidate, control, family_of, {"a": 0.5, "b": 0.5}, 0.99)
    assert even["difference_points"] == pytest.approx(100 * (0.5 * 6 / 20 + 0.5 * 2 / 60))
    shares = stratified_bounds(candidate, control, family_of, {"a": 0.25, "b": 0.75}, 0.99)
    assert shares["difference_points"] == pytest.approx(paired_bounds(candidate, control)["difference_points"])
    sa = math.sqrt((6 * 0.7 ** 2 + 14 * 0.3 ** 2) / 19)
    mean_b = 2 / 60
    sb = math.sqrt((3 * (1 - mean_b) ** 2 + (-1 - mean_b) ** 2 + 56 * mean_b ** 2) / 59)
    half = 2.5758293035489 * math.sqrt(0.25 * sa ** 2 / 20 + 0.25 * sb ** 2 / 60)
    assert even["lower_points"] == pytest.approx(even["difference_points"] - 100 * half, rel=1e-9)
    assert effective_cases({"a": 20, "b": 60}, {"a": 0.25, "b": 0.75}) == pytest.approx(80)
    assert effective_cases({"a": 20, "b": 60}, {"a": 0.5, "b": 0.5}) == pytest.approx(60)  # 1 / (0.25 / 20 + 0.25 / 60)
    with pytest.raises(ValueError, match=r"names \['a', 'c'\] but the fresh cases pool \['a', 'b'\]"):
        stratified_bounds(candidate, control, family_of, {"a": 0.5, "c": 0.5}, 0.99)


GROWN = {"min_advantage_points": 3.0, "expected_discordance": 0.09, "power": 0.9, "first_cohort_margin_points": -3.0,
         "first_cohort_expected_discordance": 0.09, "first_cohort_power": 0.8,
         "family_weights": {"cheapest": 0.25, "acronym": 0.25, "lookup": 0.5}}


def test_the_declaration_says_the_power_and_the_cases_it_needs_before_any_case_is_drawn():
    """The first growth study's 256 fresh cases could not see +3 points; the declaration says so and says how many
    would, for the advantage (an effective count, stratified) and for the first-cohort sub-screen."""
    small = screen_declaration(GROWN, {"cheapest": 64, "acronym": 64, "lookup": 128}, {"lookup": 128}, 0.99, 0.0)
    a, f = small["advantage"], small["first_cohort"]
    assert a["n"] == 256 and a["n_effective"] == pytest.approx(256) and a["power"] < 0.5 and not small["sufficient"]
    assert a["effective_cases_needed"] == cases_for_power(0.09, 0.0, 0.99, 0.9, advantage_points=3.0)
    assert f["n"] == 128 and f["power"] < 0.5 and f["cases_needed"] > 1000
    big = screen_declaration(GROWN, {"cheapest": 768, "acronym": 768, "lookup": 1536}, {"lookup": 1536}, 0.99, 0.0)
    assert big["advantage"]["n_effective"] == pytest.approx(3072) and big["sufficient"]
    # study.json holds it as written here: plain JSON (numpy's float from scipy made its comparisons numpy bools)
    assert json.loads(json.dumps(big)) == big and type(big["advantage"]["power"]) is float
    lines = declaration_lines(big)
    assert lines[0].startswith("- advantage screen: grown − continued dense over 3,072 fresh cases, family-stratified")
    assert "at a true advantage of +3 points" in lines[0] and "first-cohort sub-screen" in lines[1]
    assert screen_declaration({}, {"x": 10}, {}, 0.99, 0.0) == {"confidence": 0.99, "family_weights": None,
                                                                "advantage": None, "first_cohort": None,
                                                                "sufficient": True}


def test_a_declared_screen_with_too_few_cases_is_refused_before_either_arm_trains():
    from nshard.study.growth import GrowthError, declare_screen

    said = []
    sets = {"eval_case_ids": [f"{f}-s4061-{i:06d}" for f, n in (("cheapest", 64), ("acronym", 64), ("lookup", 128))
                              for i in range(n)],
            "cohort": {"first_cohort_eval_case_ids": [f"lookup-s4061-{i:06d}" for i in range(128)]}}
    with pytest.raises(GrowthError, match=r"growth.min_advantage_points=3.0: 256 fresh cases \(effective 256\) give "
                                          r"the advantage screen \d+% power, under growth.power = 0.9; raise"):
        declare_screen(plan(**GROWN), sets, said.append)
    assert said[0].startswith("declared: advantage screen")
    assert declare_screen(plan(), sets, said.append) is None  # nothing declared: the first design's screen


def test_the_screen_keys_are_checked_by_name():
    for growth, message in [
        ({"architecture": "gpt"}, 'growth.architecture=gpt: use "qwen2_moe"'),
        ({"freeze": "shared"}, "growth.freeze=shared: .* a mixtral growth has no shared expert"),
        ({"architecture": "qwen2_moe", "freeze": "all"}, 'growth.freeze=all: use "none", "shared"'),
        ({"expert_size": 64}, "growth.expert_size=64: .* leave it 0"),
        ({"min_advantage_points": 3.0}, "growth.expected_discordance=0.0: with min_advantage_points = 3.0"),
        ({"min_advantage_points": -1.0}, "growth.min_advantage_points=-1.0: give the smallest advantage"),
        ({"first_cohort_margin_points": 3.0}, "growth.first_cohort_margin_points=3.0: a non-inferiority margin"),
        ({"first_cohort_margin_points": -3.0}, "growth.first_cohort_expected_discordance=0: with"),
        ({"power": 1.2}, r"growth.power=1.2: give a power in \[0.5, 1\)"),
        ({"family_weights": {"a": 0.5, "b": 0.4}}, "growth.family_weights sum to 0.9"),
        ({"family_weights": {"a": 1.0, "b": 0.0}}, "growth.family_weights.b=0.0: give each family a positive"),
    ]:
        with pytest.raises(PlanError, match=message):
            plan(**growth)
    declared = plan(architecture="qwen2_moe", freeze="accepted", expert_size=384, **GROWN).growth
    assert declared.settings()["freeze"] == "accepted" and dataclasses.asdict(declared)["family_weights"]["lookup"] == 0.5


def rows(correct: dict[str, list[bool]]) -> list[dict]:
    return [{"case_id": f"{family}-{i}", "family": family, "correct": c}
            for family, flags in correct.items() for i, c in enumerate(flags)]


def test_the_declared_growth_screen_stratifies_and_pairs_the_first_cohort_against_continued_dense():
    """With a declaration the advantage condition is the stratified bound, and the first cohort is paired against
    continued dense (its margin declared) in place of the accepted checkpoint; retention stays."""
    grown = rows({"cheapest": [True] * 30 + [False] * 34, "lookup": [True] * 60 + [False] * 68})
    dense = rows({"cheapest": [True] * 10 + [False] * 54, "lookup": [True] * 63 + [False] * 65})
    comparisons = [{"control": "dense", **paired_bounds({r["case_id"]: r["correct"] for r in grown},
                                                        {r["case_id"]: r["correct"] for r in dense})}]
    cohort = {"conditions": [{"name": "new-task accuracy gain over the accepted checkpoint, points", "passed": False},
                             {"name": "first-cohort paired 99% lower bound vs the accepted checkpoint, points",
                              "passed": False},
                             {"name": "retention-change 99% upper bound vs the accepted checkpoint, nats",
                              "passed": True}],
              "first_cohort_screening": {"families": ["lookup"]}}
    screens = {"confidence": 0.99, "min_growth_paired_lower_points": 0.0}
    declared = {"family_weights": {"cheapest": 0.5, "lookup": 0.5}, "first_cohort": {"margin_points": -3.0}}
    growth = {"arms": {"dense": {"grown": False}, "grown": {"grown": True}}, "screen": declared}
    screen = growth_screen({"status": "complete", "name": "grown"}, comparisons, cohort, screens, growth,
                           {"grown": grown, "dense": dense})
    names = [c["name"] for c in screen["conditions"]]
    assert names == ["family-stratified paired 99% lower bound vs dense (continued dense), points",
                     "first-cohort paired 99% lower bound vs dense (continued dense), points",
                     "retention-change 99% upper bound vs the accepted checkpoint, nats"]
    stratified = screen["stratified"]["dense"]
    assert stratified["difference_points"] == pytest.approx(100 * (0.5 * 20 / 64 - 0.5 * 3 / 128))
    assert screen["conditions"][0]["passed"] and not screen["conditions"][1]["passed"] and not screen["passed"]
    first = screen["first_cohort_vs_dense"]["dense"]
    assert first["n"] == 128 and first["difference_points"] == pytest.approx(-300 / 128)
    legacy = growth_screen({"status": "complete", "name": "grown"}, comparisons, cohort, screens,
                           {"arms": growth["arms"]})
    assert [c["name"] for c in legacy["conditions"]][:2] == [
        "paired 99% lower bound vs dense (continued dense), points",
        "first-cohort paired 99% lower bound vs the accepted checkpoint, points"]
