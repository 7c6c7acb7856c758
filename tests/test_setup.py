"""launch/setup.sh checks what it needs before any work starts, one line each naming the Debian package that brings
it: here on environments that lack one (a PATH without g++, a Python whose installation has no headers, a user who
is not root). `bash launch/setup.sh --check` runs the same check alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)


def setup_sh(args=(), env: dict | None = None, setup: Path = REPO / "launch" / "setup.sh", user: str | None = None):
    prefix = ["setpriv", f"--reuid={user}", "--regid=nogroup", "--clear-groups"] if user else []
    return subprocess.run([*prefix, "/bin/bash", str(setup), *args], capture_output=True, text=True, timeout=300,
                          env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), **(env or {})})


def path_without(tmp_path: Path, *missing: str) -> str:
    """A PATH holding the tools set-up's check calls, except `missing`."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("dirname", "id", "git", "g++", "sha256sum", "cut", "cat"):
        found = shutil.which(tool)
        if tool not in missing and found:
            (folder / tool).symlink_to(found)
    return str(folder)


def lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("setup: ")]


def test_without_a_compiler_setup_stops_before_any_work_naming_the_package(tmp_path):
    """A copy of the checkout's set-up files (no .venv there yet): the check runs first, says g++ is missing and what
    installs it, and stops with nothing created."""
    clone = tmp_path / "clone"
    for rel in ("launch/setup.sh", "pyproject.toml", "constraints.txt", "nshard/__init__.py", "nshard/cgroups.py"):
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, clone / rel)
    proc = setup_sh(env={"PATH": path_without(tmp_path, "g++"), "PYTHON": sys.executable}, setup=clone / "launch/setup.sh")
    assert proc.returncode == 1, proc.stderr
    found = lines(proc)
    assert ("setup: missing: a C++ compiler (g++), which compiles DeepSpeed's CPU collective: apt-get install g++ "
            "(or build-essential)") in found
    assert any(line.startswith("setup: ok: Python's headers") for line in found)
    assert any(line.startswith("setup: ok: the emulated hosts' cores pinned by ") for line in found)
    assert found[-1] == "setup: install what is missing above, then run launch/setup.sh again"
    assert not (clone / ".venv").exists()


def test_a_python_without_headers_is_named_with_its_package(tmp_path):
    """PYTHONHOME points the interpreter at a prefix that holds its standard library but no include/ (a Debian
    python3 without python3-dev): sysconfig's Python.h is not there."""
    home = tmp_path / "home"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (home / "lib").mkdir(parents=True)
    (home / "lib" / stdlib.name).symlink_to(stdlib)
    proc = setup_sh(["--check"], env={"PYTHON": BASE_PYTHON, "PYTHONHOME": str(home)})
    assert proc.returncode == 1, proc.stderr
    header = home / "include" / stdlib.name / "Python.h"
    assert (f"setup: missing: Python's headers ({header}), which DeepSpeed's CPU collective compiles against: "
            "apt-get install python3-dev") in lines(proc)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not Path("/usr/bin/python3").is_file(),
                    reason="drops root with setpriv and runs the system's /usr/bin/python3")
def test_without_root_setup_says_what_it_skips_and_that_the_speed_screen_cannot_compare():
    proc = setup_sh(["--check"], env={"PYTHON": "/usr/bin/python3", "HOME": "/nonexistent"}, user="nobody")
    found = lines(proc)
    assert ("setup: not root: skipped: apt-get install openmpi-bin libopenmpi-dev openssh-server pdsh (the mpi4py "
            "transport and launch/hosts.sh); the emulated hosts need root too, so the main job's speed screen will "
            "read NOT COMPARABLE") in found, proc.stderr
    # An unprivileged user can still narrow its own processes' affinity, but no cgroup.
    assert any(line.startswith("setup: ok: the emulated hosts' cores pinned by CPU affinity") for line in found)
