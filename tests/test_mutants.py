"""launch/mutants.py stays current: each mutant's text is in its file exactly once, its guards name tests that exist,
and planting then restoring a mutant leaves the file as it was (the script itself runs the suite; docs/testing.md)."""

import re
import shutil
import subprocess
import sys

import pytest

from runs import REPO

sys.path.insert(0, str(REPO / "launch"))
import mutants


def test_every_mutant_still_matches_its_code_once():
    assert len(mutants.MUTANTS) == 8 and len({m.name for m in mutants.MUTANTS}) == 8
    for m in mutants.MUTANTS:
        assert mutants.stale(REPO, m) == [], m.name


def test_every_guard_names_a_test_that_exists():
    for m in mutants.MUTANTS:
        assert m.guards, m.name
        for guard in m.guards:
            path, _, name = guard.partition("::")
            text = (REPO / path).read_text()
            assert not name or re.search(rf"^def {re.escape(name)}\(", text, re.M), (m.name, guard)


def test_planting_changes_the_files_and_restoring_puts_them_back(tmp_path):
    for m in mutants.MUTANTS:
        for rel, _, _ in m.edits:
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, tmp_path / rel)
        before = {rel: (tmp_path / rel).read_text() for rel, _, _ in m.edits}
        originals = mutants.apply(tmp_path, m)
        assert any((tmp_path / rel).read_text() != before[rel] for rel in before), m.name
        for path, text in originals.items():
            path.write_text(text)
        assert {rel: (tmp_path / rel).read_text() for rel in before} == before, m.name


def test_a_scratch_directory_that_is_not_a_clone_is_left_as_it_was(tmp_path):
    scratch = tmp_path / "mine"
    scratch.mkdir()
    (scratch / "notes.txt").write_text("kept")
    with pytest.raises(subprocess.CalledProcessError):  # git clone refuses a non-empty directory
        mutants.main(["--scratch", str(scratch), "--only", "own-delta-twice", "--tiers", "full"])
    assert (scratch / "notes.txt").read_text() == "kept"
