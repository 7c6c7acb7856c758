"""Task families: determinism, identity, strict scoring, train/eval separation, hand-checked
cases."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nshard import tasks
from nshard.tasks import FAMILIES, Case, make_cases, split_cases
from nshard.tasks import acronym, cheapest, filtering, invoice, lookup, sorting

ALL = sorted(FAMILIES)


@pytest.mark.parametrize("family", ALL)
def test_generation_is_deterministic_and_json_serializable(family):
    a = make_cases(family, 7, 0, 50)
    b = make_cases(family, 7, 0, 50)
    assert a == b
    assert make_cases(family, 7, 10, 5) == a[10:15]
    for case in a:
        assert Case.from_dict(json.loads(json.dumps(case.to_dict()))) == case
    assert [c.payload for c in make_cases(family, 8, 0, 50)] != [c.payload for c in a]


def test_generation_does_not_depend_on_the_process_hash_seed():
    code = ("from nshard.tasks import make_cases, prompt, FAMILIES;"
            "print([prompt(c) for f in sorted(FAMILIES) for c in make_cases(f, 3, 0, 5)])")
    root = Path(__file__).resolve().parents[1]
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=root, env={**os.environ, "PYTHONHASHSEED": s}).stdout
            for s in ("1", "2")}
    assert len(outs) == 1


@pytest.mark.parametrize("family", ALL)
def test_case_ids_are_distinct_and_stable(family):
    cases = make_cases(family, 5, 0, 300)
    assert len({c.case_id for c in cases}) == 300
    assert cases[12].case_id == f"{family}-s5-000012"
    assert (cases[12].family, cases[12].seed, cases[12].index) == (family, 5, 12)


@pytest.mark.parametrize("family", ALL)
def test_prompts_state_the_answer_format_and_stay_short(family):
    for case in make_cases(family, 1, 0, 100):
        text = tasks.prompt(case)
        assert "Answer with" in text
        assert len(text) < 400, text


@pytest.mark.parametrize("family", ALL)
def test_answer_scores_true_and_tolerates_only_whitespace_and_a_trailing_period(family):
    for case in make_cases(family, 2, 0, 200):
        ans = tasks.answer(case)
        assert ans and ans == ans.strip()
        for ok in (ans, f"  {ans}\n", f"{ans}.", f" {ans}. "):
            assert tasks.score(case, ok), (ok, ans)
        for bad in ("", ans + "..", "The answer is " + ans, ans + " x", ans.upper() + "Z",
                    ans[:-1], ans + "0", f'"{ans}"', ans.replace(", ", ",")):
            if bad != ans:
                assert not tasks.score(case, bad), (bad, ans)


def _list_perturbations(ans: str) -> list[str]:
    items = ans.split(", ")
    out = [", ".join(items[:-1]), ", ".join(items + items[:1]), " ".join(items), ",".join(items)]
    if len(items) > 1:
        out.append(", ".join(reversed(items)))
        out.append(", ".join(items[1:] + items[:1]))
    return [p for p in out if p != ans]


@pytest.mark.parametrize("family", ["filtering", "sorting"])
def test_list_answers_reject_reordered_dropped_or_extra_items(family):
    for case in make_cases(family, 3, 0, 100):
        for bad in _list_perturbations(tasks.answer(case)):
            assert not tasks.score(case, bad), bad


def test_invoice_rejects_near_misses_and_other_formats():
    for case in make_cases("invoice", 3, 0, 100):
        ans = tasks.answer(case)
        cents = int(ans.replace(".", ""))
        for bad in (invoice.money(cents + 1), invoice.money(cents - 1), "$" + ans, ans[:-1],
                    ans.rstrip("0"), f"{cents / 100:,.2f}" if cents >= 100000 else ans + "0"):
            if bad != ans:
                assert not tasks.score(case, bad), bad


def test_lookup_hand_checked():
    case = Case("lookup-s0-000000", "lookup", 0, 0, {
        "columns": ["name", "age", "city"],
        "rows": [["Ava", 34, "Lima"], ["Ben", 51, "Oslo"], ["Cleo", 27, "Rome"],
                 ["Dan", 40, "Oslo"]],
        "row": "Ben", "column": "city"})
    assert lookup.prompt(case) == ("name | age | city\nAva | 34 | Lima\nBen | 51 | Oslo\n"
                                   "Cleo | 27 | Rome\nDan | 40 | Oslo\n"
                                   "What is the city of Ben? Answer with the value only.")
    assert lookup.answer(case) == "Oslo"
    assert lookup.score(case, "Oslo.") and not lookup.score(case, "oslo")
    age = Case("x", "lookup", 0, 0, {**case.payload, "row": "Cleo", "column": "age"})
    assert lookup.answer(age) == "27" and not lookup.score(age, "27 years")


def test_filtering_hand_checked():
    payload = {"items": [["pen", 12], ["lamp", 80], ["mug", 45], ["tea", 3], ["vase", 60]],
               "op": "above", "threshold": 44}
    above = Case("f", "filtering", 0, 0, payload)
    assert filtering.answer(above) == "lamp, mug, vase"
    assert "Prices: pen 12, lamp 80, mug 45, tea 3, vase 60." in filtering.prompt(above)
    below = Case("f", "filtering", 0, 0, {**payload, "op": "below"})
    assert filtering.answer(below) == "pen, tea"
    assert not filtering.score(below, "tea, pen")


def test_filtering_threshold_never_ties_and_splits_the_list():
    for case in make_cases("filtering", 4, 0, 500):
        prices = [p for _, p in case.payload["items"]]
        assert case.payload["threshold"] not in prices
        kept = tasks.answer(case).split(", ")
        assert 1 <= len(kept) < len(prices)


def test_sorting_hand_checked():
    case = Case("s", "sorting", 0, 0, {"numbers": [42, 7, 19, 88, 3], "order": "ascending"})
    assert sorting.answer(case) == "3, 7, 19, 42, 88"
    assert sorting.prompt(case).startswith("Numbers: 42, 7, 19, 88, 3.\nSort them in ascending")
    desc = Case("s", "sorting", 0, 0, {"numbers": [42, 7, 19, 88, 3], "order": "descending"})
    assert sorting.answer(desc) == "88, 42, 19, 7, 3"
    assert not sorting.score(desc, "3, 7, 19, 42, 88")


def test_invoice_hand_checked():
    lines = [["pens", 3, 125], ["mugs", 2, 410], ["bulbs", 7, 99]]
    case = Case("i", "invoice", 0, 0, {"lines": lines})
    # 3 * 1.25 + 2 * 4.10 + 7 * 0.99 = 3.75 + 8.20 + 6.93 = 18.88
    assert invoice.answer(case) == "18.88"
    rows = "3 x pens at 1.25 each\n2 x mugs at 4.10 each\n7 x bulbs at 0.99 each"
    assert rows in invoice.prompt(case)
    assert invoice.score(case, "18.88.") and not invoice.score(case, "18.9")
    assert invoice.money(5) == "0.05" and invoice.money(123456) == "1234.56"
    even = Case("i", "invoice", 0, 0, {"lines": [["pens", 2, 250], ["mugs", 1, 500]]})
    assert invoice.answer(even) == "10.00" and not invoice.score(even, "10")


def test_generated_cases_are_pinned():
    # Golden values: a change here means every stored case id now names different content.
    assert tasks.answer(make_cases("sorting", 0, 1, 1)[0]) == "12, 27, 33, 55, 65, 74"
    assert tasks.answer(make_cases("invoice", 0, 0, 1)[0]) == "154.14"
    assert tasks.answer(make_cases("lookup", 0, 1, 1)[0]) == "1991"
    assert tasks.answer(make_cases("filtering", 0, 1, 1)[0]) == "glove, lamp, yarn, fork"
    assert tasks.answer(make_cases("cheapest", 0, 1, 1)[0]) == "kettle"
    assert tasks.answer(make_cases("acronym", 0, 1, 1)[0]) == "OCH"


def test_cheapest_hand_checked():
    case = Case("c", "cheapest", 0, 0, {"items": [["pen", 12], ["lamp", 80], ["tea", 3], ["vase", 60]]})
    assert cheapest.prompt(case) == ("Shop:\npen: 12\nlamp: 80\ntea: 3\nvase: 60\n"
                                     "Which item is the cheapest? Answer with the item name only.")
    assert cheapest.answer(case) == "tea"
    assert cheapest.score(case, "tea.") and not cheapest.score(case, "Tea") and not cheapest.score(case, "tea: 3")


def test_cheapest_prices_never_tie():
    for case in make_cases("cheapest", 4, 0, 500):
        prices = [p for _, p in case.payload["items"]]
        names = [n for n, _ in case.payload["items"]]
        assert len(set(prices)) == len(prices) and len(set(names)) == len(names)
        assert 3 <= len(prices) <= 5 and tasks.answer(case) in names


def test_acronym_hand_checked():
    case = Case("a", "acronym", 0, 0, {"words": ["global", "data", "network"]})
    assert acronym.prompt(case) == ("Phrase: global data network\n"
                                    "What is its acronym? Answer with the capital first letters only.")
    assert acronym.answer(case) == "GDN"
    for bad in ("gdn", "G D N", "G.D.N", "GDN (global data network)", "GD"):
        assert not acronym.score(case, bad), bad
    assert acronym.score(case, " GDN. ")


def test_second_cohort_families_are_new_and_registered():
    assert set(tasks.SECOND_COHORT).isdisjoint(tasks.FIRST_COHORT)
    assert set(FAMILIES) == {*tasks.FIRST_COHORT, *tasks.SECOND_COHORT}
    from nshard.run.plan import DataSection

    assert DataSection().families == tasks.FIRST_COHORT


def test_case_ids_and_prompts_stay_disjoint_across_roles_and_cohorts():
    """A first study's training and evaluation cases, a cohort's training cases of the new families and its fresh
    cases of both cohorts' families (another eval seed): no id and no prompt in two roles."""
    roles = {"first training": [c for f in tasks.FIRST_COHORT for c in make_cases(f, 11, 0, 24)],
             "first evaluation": [c for f in tasks.FIRST_COHORT for c in make_cases(f, 1011, 0, 64)],
             "cohort training": [c for f in tasks.SECOND_COHORT for c in make_cases(f, 21, 0, 24)],
             "cohort evaluation": [c for f in FAMILIES for c in make_cases(f, 2021, 0, 64)]}
    tasks.check_disjoint_roles(roles)
    with pytest.raises(ValueError, match="case ids are in both first training and cohort evaluation"):
        tasks.check_disjoint_roles({**roles, "cohort evaluation": make_cases("lookup", 11, 3, 2)})
    # The same content under another seed: the prompt check fires even though the ids differ.
    same = make_cases("acronym", 21, 0, 1)[0]
    twin = tasks.base.new_case("acronym", 99, 0, same.payload)
    with pytest.raises(ValueError, match=f"repeats the prompt of cohort training case {same.case_id}"):
        tasks.check_disjoint_roles({**roles, "copy": [twin]})


def test_split_has_fresh_evaluation_cases():
    train, evaluation = split_cases(ALL, train_seed=0, eval_seed=1, n_train_per_family=200,
                                    n_eval_per_family=50)
    assert len(train) == 200 * len(ALL) and len(evaluation) == 50 * len(ALL)
    assert {c.seed for c in train} == {0} and {c.seed for c in evaluation} == {1}
    assert not {c.case_id for c in train} & {c.case_id for c in evaluation}
    assert not {tasks.prompt(c) for c in train} & {tasks.prompt(c) for c in evaluation}


def test_split_refuses_overlap():
    with pytest.raises(ValueError, match="must differ"):
        split_cases(ALL, 3, 3, 10, 10)
    with pytest.raises(ValueError, match="repeat"):
        split_cases(["sorting", "sorting"], 0, 1, 10, 10)
    with pytest.raises(ValueError, match="unknown task family"):
        split_cases(["nope"], 0, 1, 10, 10)


def test_overlap_check_catches_a_shared_prompt(monkeypatch):
    # Force every sorting case to the same content so the explicit prompt check must fire.
    fixed = {"numbers": [1, 2, 3, 4, 5], "order": "ascending"}
    monkeypatch.setattr(sorting, "generate",
                        lambda seed, index: tasks.base.new_case("sorting", seed, index, fixed))
    with pytest.raises(ValueError, match="repeats the prompt"):
        split_cases(["sorting"], 0, 1, 5, 5)


def replies(case: Case, rng) -> list[str]:
    """The right answer as a model may write it (spaces, a period, a newline after) and near misses of it."""
    right = tasks.answer(case)
    out = [right, f" {right}", f"{right}.", f"{right} .\n", f"\n{right}\n\n", f"{right}. More text", f"{right}!",
           f"{right}{right}", right[:-1], f"{right[:-1]}x", f"The answer is {right}", "", " ", ".", f"{right},"]
    for _ in range(20):  # one character changed, dropped or added somewhere
        k = rng.randrange(len(right) + 1)
        c = rng.choice("0123456789, .abcXYZ\n")
        out += [right[:k] + c + right[k + 1:], right[:k] + right[k + 1:], right[:k] + c + right[k:]]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_answer_is_cut_only_once_no_continuation_can_score_right(family):
    """Scoring stops generating an answer once could_still_score says no continuation can be right (evaluate.
    greedy_batch): for every reply and every prefix of it, a prefix said to be hopeless must belong to a reply that
    scores wrong, and every prefix of a reply that scores right must still be possible. This holds each family to
    exact_match: a family scored otherwise fails here until it gets its own rule."""
    import random

    rng = random.Random(7)
    module = FAMILIES[family]
    cut = kept = 0
    for case in make_cases(family, 5, 0, 25):
        for reply in replies(case, rng):
            right = tasks.score(case, reply)
            for k in range(len(reply) + 1):
                possible = tasks.could_still_score(case, reply[:k])
                assert possible or not right, (case.case_id, reply, k)
                cut += not possible
                kept += possible
            # Once hopeless, always hopeless: no longer prefix of the same reply is possible again.
            flags = [tasks.could_still_score(case, reply[:k]) for k in range(len(reply) + 1)]
            assert flags == sorted(flags, reverse=True), (case.case_id, reply)
        assert module.score(case, f" {tasks.answer(case)}.\n")
    assert cut > 0 and kept > 0


def test_own_answers_forgive_whitespace_only():
    from nshard.tasks.base import could_still_match

    assert could_still_match("B12", " B1", period=False) and could_still_match("B12", "B12 \n", period=False)
    assert not could_still_match("B12", "B12.", period=False) and could_still_match("B12", "B12.")
    assert not could_still_match("B12", "B13", period=False) and not could_still_match("B12", "B12 x", period=False)
