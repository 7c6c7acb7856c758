"""Typed config sections: frozen dataclasses whose fields declare their type (the annotation) and their rule once,
beside the default (`setting(default, rule)`); one validator, `field_problems`, checks every rule and returns one
line per bad field naming the key, the value and the fix. The plan's sections (nshard/run/plan.py) and the
ds_config's "nshard" section (nshard/comm/config.py) are built on it; cross-field rules stay in each section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Rule:
    """What a field's value must satisfy, and the line for one that does not (formatted with `key` and `value`,
    e.g. "{key}={value} must be positive")."""

    ok: Callable[[Any], bool]
    problem: str

    def check(self, key: str, value: Any) -> str | None:
        try:
            good = self.ok(value)
        except TypeError:  # a value of another type compares with nothing: it fails the rule
            good = False
        return None if good else self.problem.format(key=key, value=value)


def setting(default: Any = dataclasses.MISSING, rule: Rule | None = None, **field_args):
    """A dataclass field with its rule: dataclasses.field(default, metadata={"rule": rule})."""
    return dataclasses.field(default=default, metadata={"rule": rule} if rule else {}, **field_args)


def field_problems(section, prefix: str) -> list[str]:
    """Every field of `section` that breaks its rule, in field order, each named `prefix.field`."""
    problems = []
    for f in dataclasses.fields(section):
        rule = f.metadata.get("rule")
        problem = rule and rule.check(f"{prefix}.{f.name}", getattr(section, f.name))
        if problem:
            problems.append(problem)
    return problems


def choice(choices: tuple, problem: str) -> Rule:
    """One of `choices` (by value and type: true is not 1)."""
    return Rule(lambda v: any(v == c and type(v) is type(c) for c in choices), problem)
