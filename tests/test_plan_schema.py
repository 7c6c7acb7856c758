"""The typed plan schema (nshard/schema.py, nshard/run/plan.py) reads every shipped plan exactly as the hand-written
validator before it did: the same plan hash (the run's plan_sha256 is the file's bytes) and the same parsed plan,
field for field (what the study and the data derive from), compared with the old plan.py taken from git history and
run on the same TOML in this test."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nshard.files import file_sha256
from nshard.run.plan import PlanError, load_plan
from spawn import require

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted([*(REPO / "launch" / "plans").glob("*.toml"), *(REPO / "launch" / "recipe").glob("*.toml")])


def git(*args: str) -> str | None:
    if shutil.which("git") is None:
        return None
    proc = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


@functools.cache
def reference_plan_module():
    """nshard/run/plan.py as it was in the newest commit that still validated by hand (before nshard/schema.py; a
    branch that added plan keys by hand while the schema was written counts: its keys are read both ways)."""
    source = None
    for commit in (git("log", "--format=%H", "--", "nshard/run/plan.py") or "").split():
        text = git("show", f"{commit}:nshard/run/plan.py")
        if text is not None and "nshard.schema" not in text:
            source = text
            break
    require(source is not None and bool(git("log", "--format=%H", "--", "nshard/schema.py")),
            "git history with the commit that added nshard/schema.py (not a shallow clone or a tarball)")
    spec = importlib.util.spec_from_loader("reference_plan", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(REPO / "nshard" / "run" / "plan.py")  # where it finds the repository root from
    sys.modules["reference_plan"] = module  # dataclasses look their module up while the class is made
    exec(compile(source, "reference plan.py", "exec"), module.__dict__)
    return module


def canonical(plan, fields_of=None) -> str:
    """The parsed plan as sorted JSON: every section, every field, with its type (1 and 1.0 differ); with
    `fields_of` (a reference plan), only the fields it has (a field added since is not the schema's doing)."""
    def typed(value):
        if isinstance(value, dict):
            return {k: typed(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [typed(v) for v in value]
        return [type(value).__name__, value]

    def only(value, ref):
        if isinstance(value, dict) and isinstance(ref, dict):
            return {k: only(v, ref[k]) for k, v in value.items() if k in ref}
        if isinstance(value, list) and isinstance(ref, list) and len(value) == len(ref):
            return [only(v, r) for v, r in zip(value, ref)]
        return value
    form = dataclasses.asdict(plan)
    if fields_of is not None:
        form = only(form, dataclasses.asdict(fields_of))
    return json.dumps(typed(form), sort_keys=True)


def test_every_shipped_plan_reads_as_the_hand_written_validator_read_it():
    reference = reference_plan_module()
    assert SHIPPED
    compared = []
    for path in SHIPPED:
        new = load_plan(path)
        try:
            old = reference.load_plan(path)
        except reference.PlanError as exc:  # a key added after the reference (merged from another branch)
            assert "unknown plan key" in str(exc), (path.name, str(exc))
            print(f"{path.relative_to(REPO)}: not compared, the reference does not know {exc}")
            continue
        compared.append(path.name)
        new_form, old_form = canonical(new, fields_of=old), canonical(old)
        print(f"{path.relative_to(REPO)}: plan_sha256 {file_sha256(path)[:16]}, parsed plan sha256 "
              f"old {hashlib.sha256(old_form.encode()).hexdigest()[:16]} new "
              f"{hashlib.sha256(new_form.encode()).hexdigest()[:16]}")
        assert file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
        assert new_form == old_form, path.name
    assert len(compared) >= len(SHIPPED) - 2, compared  # at most the plans of the newest features go uncompared


@pytest.mark.parametrize("edit", [
    {"train": {"updates": 0}}, {"data": {"replay_docs": -1}}, {"screens": {"confidence": 1.5}},
    {"study": {"link": "fast"}}, {"study": {"placement": "cloud"}}, {"study": {"cores_per_host": 0}},
    {"study": {"fault": {"arm": "dense", "update": 1, "phase": "later"}}},
    {"study": {"arms": [{"name": "a b"}]}}, {"study": {"arms": [{"name": "x", "ranks": 0}]}},
    {"cohort": {"from": "x", "start": "scratch"}}, {"growth": {"budget": "seconds"}},
    {"checkpoint": {"keep": 0}}, {"model": {"spec": " "}}, {"train": {"updaets": 2}},
])
def test_a_bad_plan_gets_the_same_one_line_error_as_before(edit):
    """Each declared rule refuses what the hand-written check refused, with the same line."""
    reference = reference_plan_module()
    raw = {"name": "p", **edit}
    errors = []
    for module_error, read in ((PlanError, load_plan.__globals__["plan_from_dict"]),
                               (reference.PlanError, reference.plan_from_dict)):
        with pytest.raises(module_error) as caught:
            read(json.loads(json.dumps(raw)))
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and "\n" not in errors[0]
