"""The house's hygiene: `ruff check` passes on the tree (pyproject.toml's [tool.ruff]), and constraints.txt pins every
package launch/setup.sh installs at one exact version."""

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.!+_-]*)$")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    lines = [line for line in (REPO / "constraints.txt").read_text().splitlines() if line and not line.startswith("#")]
    bad = [line for line in lines if not PIN.match(line)]
    assert not bad, f"constraints.txt: not NAME==VERSION: {bad}; rewrite it with bash launch/constraints.sh"
    return {normalized(PIN.match(line)[1]): PIN.match(line)[2] for line in lines}


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed: pip install -e '.[test]'")
def test_ruff_passes_on_the_tree():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_every_declared_dependency_is_pinned_once_and_nshard_is_not():
    pinned = pins()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    names = {normalized(re.match(r"[A-Za-z0-9._-]+", d)[0]) for d in declared if "python_version < '3.11'" not in d}
    assert not names - set(pinned), f"constraints.txt lacks {sorted(names - set(pinned))}: bash launch/constraints.sh"
    assert "nshard" not in pinned
    assert pinned["torch"] == "2.13.0"  # no local tag: the CPU wheel and a CUDA index's build both satisfy it
    text = (REPO / "constraints.txt").read_text()
    assert len(pinned) == len([line for line in text.splitlines() if line and not line.startswith("#")])


def test_setup_installs_every_python_package_with_the_constraints():
    lines = [line for line in (REPO / "launch" / "setup.sh").read_text().splitlines()
             if re.search(r"pip install", line) and not line.lstrip().startswith("#")]
    unpinned = [line for line in lines if "-c constraints.txt" not in line and "--upgrade pip" not in line
                and "--index-url" not in line]
    assert lines and not unpinned, unpinned
