"""The case record shared by every task family, its seeded RNG, and the strict answer matcher."""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    """One generated problem; everything needed to rebuild its prompt and answer is in `payload`."""

    case_id: str
    """Stable identity, "{family}-s{seed}-{index:06d}"; the same on every machine and run."""
    family: str
    """Task family name, a key of `nshard.tasks.FAMILIES`."""
    seed: int
    """Generation seed (training and evaluation use different seeds)."""
    index: int
    """Position of the case in its seed's stream."""
    payload: dict
    """The generated content; JSON-serializable (str, int, lists, dicts)."""

    def to_dict(self) -> dict:
        return {"case_id": self.case_id, "family": self.family, "seed": self.seed,
                "index": self.index, "payload": self.payload}

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        return cls(d["case_id"], d["family"], int(d["seed"]), int(d["index"]), d["payload"])


def case_id(family: str, seed: int, index: int) -> str:
    return f"{family}-s{seed}-{index:06d}"


def case_rng(family: str, seed: int, index: int) -> random.Random:
    """An RNG that depends only on (family, seed, index).

    Python's hash() is salted per process, so the seed comes from SHA-256 instead.
    """
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be >= 0, got seed={seed} index={index}")
    digest = hashlib.sha256(f"nshard.tasks/{family}/{seed}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def new_case(family: str, seed: int, index: int, payload: dict) -> Case:
    return Case(case_id(family, seed, index), family, seed, index, payload)


def normalize_reply(text: str) -> str:
    """Strip surrounding whitespace and one trailing period; nothing else is forgiven."""
    text = text.strip()
    if text.endswith("."):
        text = text[:-1].rstrip()
    return text


def exact_match(expected: str, text: str) -> bool:
    return normalize_reply(text) == expected


_TAILS = {True: re.compile(r"\s*(?:\.\s*)?"), False: re.compile(r"\s*")}


def could_still_match(expected: str, text: str, period: bool = True) -> bool:
    """Whether some continuation of `text` could still match `expected`: under exact_match (period=True: surrounding
    whitespace and one trailing period forgiven) or, with period=False, under a match that forgives surrounding
    whitespace only. False is final: whatever follows, the reply is wrong, so its generation may stop there."""
    head = text.lstrip()
    if len(head) <= len(expected):
        return expected.startswith(head)
    return head.startswith(expected) and _TAILS[period].fullmatch(head[len(expected):]) is not None


def join_list(items: list) -> str:
    """The one list format every family answers in: items separated by a comma and a space."""
    return ", ".join(str(x) for x in items)
