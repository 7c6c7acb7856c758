"""Task families (one module each) and the split of their cases into training cases and fresh
evaluation cases."""

from __future__ import annotations

from types import ModuleType

from nshard.tasks import filtering, invoice, lookup, sorting
from nshard.tasks.base import Case

FAMILIES: dict[str, ModuleType] = {m.FAMILY: m for m in (lookup, filtering, sorting, invoice)}


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
    shared_ids = {c.case_id for c in train} & {c.case_id for c in evaluation}
    if shared_ids:
        raise ValueError(f"{len(shared_ids)} case ids are in both training and evaluation, "
                         f"e.g. {sorted(shared_ids)[0]}")
    train_prompts = {prompt(c): c.case_id for c in train}
    for c in evaluation:
        if prompt(c) in train_prompts:
            raise ValueError(f"evaluation case {c.case_id} repeats the prompt of training case "
                             f"{train_prompts[prompt(c)]}; choose another eval_seed")


__all__ = ["Case", "FAMILIES", "answer", "family_module", "make_cases", "prompt", "score",
           "split_cases"]
