"""Filtering: list the items (5-8, each with a price) whose price is above or below a threshold."""

from __future__ import annotations

from nshard.tasks.base import Case, case_rng, exact_match, join_list, new_case

FAMILY = "filtering"

ITEMS = ["apple", "bread", "chair", "desk", "egg", "fan", "glove", "hat", "ink", "jam", "kettle",
         "lamp", "mug", "nut", "oil", "pen", "quilt", "rope", "soap", "tea", "umbrella", "vase",
         "wallet", "yarn", "book", "cup", "fork", "towel", "clock", "brush"]


def _threshold(rng, prices: list[int]) -> int:
    """A threshold strictly between two prices, leaving at least one item on each side.

    It is never equal to a price, so "above" and "below" need no tie rule.
    """
    ordered = sorted(prices)
    gaps = [(lo, hi) for lo, hi in zip(ordered, ordered[1:]) if hi - lo >= 2]
    lo, hi = rng.choice(gaps)
    return rng.randint(lo + 1, hi - 1)


def generate(seed: int, index: int) -> Case:
    rng = case_rng(FAMILY, seed, index)
    n = rng.randint(5, 8)
    prices = rng.sample(range(1, 100), n)
    while all(b - a == 1 for a, b in zip(sorted(prices), sorted(prices)[1:])):
        prices = rng.sample(range(1, 100), n)  # consecutive prices leave no room for a threshold
    payload = {"items": [[name, price] for name, price in zip(rng.sample(ITEMS, n), prices)],
               "op": rng.choice(["above", "below"]), "threshold": _threshold(rng, prices)}
    return new_case(FAMILY, seed, index, payload)


def prompt(case: Case) -> str:
    p = case.payload
    listing = ", ".join(f"{name} {price}" for name, price in p["items"])
    return (f"Prices: {listing}.\n"
            f"Which items cost {p['op']} {p['threshold']}? Answer with the item names in the "
            f"order given, separated by a comma and a space.")


def answer(case: Case) -> str:
    p = case.payload
    if p["op"] == "above":
        kept = [name for name, price in p["items"] if price > p["threshold"]]
    else:
        kept = [name for name, price in p["items"] if price < p["threshold"]]
    return join_list(kept)


def score(case: Case, text: str) -> bool:
    return exact_match(answer(case), text)
