"""Acronym: the capital first letters of a 3-5 word phrase ("global data network" -> "GDN")."""

from __future__ import annotations

from nshard.tasks.base import Case, case_rng, exact_match, new_case

FAMILY = "acronym"

WORDS = ["active", "basic", "central", "digital", "early", "federal", "global", "human", "internal",
         "joint", "local", "modern", "national", "open", "public", "rapid", "social", "urban",
         "virtual", "world", "agency", "board", "council", "data", "energy", "forum", "group",
         "health", "index", "network", "office", "program", "research", "service", "system", "trade",
         "union", "unit", "water", "youth"]


def generate(seed: int, index: int) -> Case:
    rng = case_rng(FAMILY, seed, index)
    return new_case(FAMILY, seed, index, {"words": rng.sample(WORDS, rng.randint(3, 5))})


def prompt(case: Case) -> str:
    return (f"Phrase: {' '.join(case.payload['words'])}\n"
            "What is its acronym? Answer with the capital first letters only.")


def answer(case: Case) -> str:
    return "".join(word[0].upper() for word in case.payload["words"])


def score(case: Case, text: str) -> bool:
    return exact_match(answer(case), text)
