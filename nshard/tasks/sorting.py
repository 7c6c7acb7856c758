"""Sorting: put 5-8 distinct numbers in ascending or descending order."""

from __future__ import annotations

from nshard.tasks.base import Case, case_rng, exact_match, join_list, new_case

FAMILY = "sorting"


def generate(seed: int, index: int) -> Case:
    rng = case_rng(FAMILY, seed, index)
    numbers = rng.sample(range(1, 100), rng.randint(5, 8))
    payload = {"numbers": numbers, "order": rng.choice(["ascending", "descending"])}
    return new_case(FAMILY, seed, index, payload)


def prompt(case: Case) -> str:
    p = case.payload
    return (f"Numbers: {join_list(p['numbers'])}.\n"
            f"Sort them in {p['order']} order. Answer with the numbers only, separated by a "
            f"comma and a space.")


def answer(case: Case) -> str:
    p = case.payload
    return join_list(sorted(p["numbers"], reverse=p["order"] == "descending"))


def score(case: Case, text: str) -> bool:
    return exact_match(answer(case), text)
