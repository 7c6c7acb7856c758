"""Task families (one module each), the split of their cases into training cases and fresh
evaluation cases, and the check that cases of different roles (and cohorts) never share an id or a prompt."""

from __future__ import annotations

from types import ModuleType

from collections.abc import Iterable, Mapping

from nshard.tasks import acronym, cheapest, filtering, invoice, lookup, sorting
from nshard.tasks.base import Case, could_still_match

FAMILIES: dict[str, ModuleType] = {m.FAMILY: m for m in (lookup, filtering, sorting, invoice, cheapest, acronym)}
FIRST_COHORT = ("lookup", "filtering", "sorting", "invoice")
"""The families the first study teaches (the plan's default data.families)."""
SECOND_COHORT = ("cheapest", "acronym")
"""Families a second cohort teaches: short lookup-like tasks the first cohort does not."""


def family_module(family: str) -> ModuleType:
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown task family {family!r}; known: {sorted(FAMILIES)}") from None


def make_cases(family: str, seed: int, start: int, count: int) -> list[Case]:
    """Cases `start .. start+count-1` of one family's stream for `seed`."""
    module = family_module(family)
    return [module.generate(seed, index) for index in range(start, start + count)]


def prompt(case: Case) -> str:
    return family_module(case.family).prompt(case)


def answer(case: Case) -> str:
    return family_module(case.family).answer(case)


def score(case: Case, text: str) -> bool:
    return family_module(case.family).score(case, text)


def could_still_score(case: Case, text: str) -> bool:
    """False once no continuation of `text` can be scored right. Every family scores by base.exact_match against its
    answer (tests/test_tasks.py holds each family to this rule), so its prefix rule is base.could_still_match."""
    return could_still_match(answer(case), text)


def split_cases(families, train_seed: int, eval_seed: int, n_train_per_family: int,
                n_eval_per_family: int) -> tuple[list[Case], list[Case]]:
    """Training cases from `train_seed` and fresh evaluation cases from `eval_seed`.

    Raises ValueError if the seeds are equal, or if any evaluation case shares an id or a prompt
    with a training case (the seeds make that unlikely; this checks it instead of assuming it).
    """
    if train_seed == eval_seed:
        raise ValueError(f"train_seed and eval_seed must differ (both are {train_seed})")
    families = list(families)
    if len(set(families)) != len(families):
        raise ValueError(f"task families repeat: {families}")
    train = [c for f in families for c in make_cases(f, train_seed, 0, n_train_per_family)]
    evaluation = [c for f in families for c in make_cases(f, eval_seed, 0, n_eval_per_family)]
    _check_disjoint(train, evaluation)
    return train, evaluation


def _check_disjoint(train: list[Case], evaluation: list[Case]) -> None:
    check_disjoint_roles({"training": train, "evaluation": evaluation})


def check_disjoint_roles(roles: Mapping[str, Iterable[Case]]) -> None:
    """No two roles (training, evaluation, a first cohort's training, ...) share a case id or a prompt.

    Raises ValueError naming both roles and the case; the seeds make an overlap unlikely, this checks it.
    """
    owner_of_id: dict[str, str] = {}
    owner_of_prompt: dict[str, tuple[str, str]] = {}
    for role, cases in roles.items():
        ids, prompts = {}, {}
        for c in cases:
            ids[c.case_id] = role
            prompts.setdefault(prompt(c), (role, c.case_id))
        shared = sorted(set(ids) & set(owner_of_id))
        if shared:
            raise ValueError(f"{len(shared)} case ids are in both {owner_of_id[shared[0]]} and {role}, "
                             f"e.g. {shared[0]}; give the roles different seeds")
        for text, (_, cid) in prompts.items():
            if text in owner_of_prompt:
                other_role, other_id = owner_of_prompt[text]
                raise ValueError(f"{role} case {cid} repeats the prompt of {other_role} case {other_id}; "
                                 "choose another seed for one of them")
        owner_of_id.update(ids)
        owner_of_prompt.update(prompts)


__all__ = ["Case", "FAMILIES", "FIRST_COHORT", "SECOND_COHORT", "answer", "check_disjoint_roles", "family_module",
           "make_cases", "prompt", "score", "split_cases"]
