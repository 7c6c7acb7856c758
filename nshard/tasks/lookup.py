"""Lookup: read one cell of a small table (4-6 rows, 2-3 attribute columns)."""

from __future__ import annotations

from nshard.tasks.base import Case, case_rng, exact_match, new_case

FAMILY = "lookup"

NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivy", "Jon", "Kai", "Lena",
         "Max", "Nora", "Omar", "Pia", "Raj", "Sara", "Tom", "Uma", "Vic", "Wes", "Yara", "Zoe"]
CITIES = ["Lima", "Oslo", "Rome", "Paris", "Cairo", "Tokyo", "Quito", "Delhi", "Berlin", "Dublin",
          "Madrid", "Seoul", "Nairobi", "Lisbon", "Prague", "Austin"]
COLORS = ["red", "blue", "green", "black", "white", "yellow", "orange", "purple", "gray", "pink"]


def _value(rng, column: str):
    if column == "age":
        return rng.randint(18, 79)
    if column == "score":
        return rng.randint(0, 100)
    if column == "year":
        return rng.randint(1950, 2024)
    if column == "city":
        return rng.choice(CITIES)
    return rng.choice(COLORS)


def generate(seed: int, index: int) -> Case:
    rng = case_rng(FAMILY, seed, index)
    attributes = rng.sample(["age", "city", "score", "year", "color"], rng.randint(2, 3))
    names = rng.sample(NAMES, rng.randint(4, 6))
    rows = [[name] + [_value(rng, col) for col in attributes] for name in names]
    payload = {"columns": ["name"] + attributes, "rows": rows,
               "row": rng.choice(names), "column": rng.choice(attributes)}
    return new_case(FAMILY, seed, index, payload)


def prompt(case: Case) -> str:
    p = case.payload
    lines = [" | ".join(p["columns"])] + [" | ".join(str(v) for v in row) for row in p["rows"]]
    question = f"What is the {p['column']} of {p['row']}? Answer with the value only."
    return "\n".join(lines) + "\n" + question


def answer(case: Case) -> str:
    p = case.payload
    row = next(r for r in p["rows"] if r[0] == p["row"])
    return str(row[p["columns"].index(p["column"])])


def score(case: Case, text: str) -> bool:
    return exact_match(answer(case), text)
