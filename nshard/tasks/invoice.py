"""Invoice: the total of 2-4 line items, quantity times unit price, in exact integer cents."""

from __future__ import annotations

from nshard.tasks.base import Case, case_rng, exact_match, new_case

FAMILY = "invoice"

PRODUCTS = ["pens", "notebooks", "folders", "mugs", "cables", "batteries", "lamps", "towels",
            "candles", "plates", "stamps", "tapes", "markers", "bulbs", "socks", "gloves"]


def money(cents: int) -> str:
    """Cents as a plain two-decimal amount: 123456 -> "1234.56" (no symbol, no separators)."""
    return f"{cents // 100}.{cents % 100:02d}"


def generate(seed: int, index: int) -> Case:
    rng = case_rng(FAMILY, seed, index)
    products = rng.sample(PRODUCTS, rng.randint(2, 4))
    # Prices are kept in integer cents so the answer is exact; no float ever touches it.
    lines = [[product, rng.randint(1, 9), rng.randint(50, 4999)] for product in products]
    return new_case(FAMILY, seed, index, {"lines": lines})


def prompt(case: Case) -> str:
    rows = [f"{qty} x {product} at {money(cents)} each"
            for product, qty, cents in case.payload["lines"]]
    return ("Invoice:\n" + "\n".join(rows) + "\n"
            "What is the invoice total? Answer with the number only, with two decimals "
            "(for example 12.50).")


def answer(case: Case) -> str:
    return money(sum(qty * cents for _, qty, cents in case.payload["lines"]))


def score(case: Case, text: str) -> bool:
    return exact_match(answer(case), text)
