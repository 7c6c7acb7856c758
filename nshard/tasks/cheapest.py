"""Cheapest: name the item with the lowest price in a short list (3-5 items, distinct prices)."""

from __future__ import annotations

from nshard.tasks.base import Case, case_rng, exact_match, new_case

FAMILY = "cheapest"

ITEMS = ["apple", "bread", "chair", "desk", "egg", "fan", "glove", "hat", "ink", "jam", "kettle",
         "lamp", "mug", "nut", "oil", "pen", "quilt", "rope", "soap", "tea", "vase", "yarn", "book",
         "cup", "fork", "towel", "clock", "brush"]


def generate(seed: int, index: int) -> Case:
    rng = case_rng(FAMILY, seed, index)
    n = rng.randint(3, 5)
    # Distinct prices: the cheapest item is never a tie.
    payload = {"items": [[name, price] for name, price in zip(rng.sample(ITEMS, n), rng.sample(range(1, 100), n))]}
    return new_case(FAMILY, seed, index, payload)


def prompt(case: Case) -> str:
    listing = "\n".join(f"{name}: {price}" for name, price in case.payload["items"])
    return f"Shop:\n{listing}\nWhich item is the cheapest? Answer with the item name only."


def answer(case: Case) -> str:
    return min(case.payload["items"], key=lambda item: item[1])[0]


def score(case: Case, text: str) -> bool:
    return exact_match(answer(case), text)
