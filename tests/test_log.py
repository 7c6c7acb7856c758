"""The nshard logger (nshard/log.py): rank 0 logs status lines, other ranks only warnings and errors, the level and
ranks set by NSHARD_LOG_LEVEL and NSHARD_LOG_RANKS; status on stdout, warnings and errors on stderr."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nshard import log as log_mod
from nshard.log import log

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def env(monkeypatch):
    """Set variables, reconfigure; the logger is configured from the real environment again afterwards."""
    def set_env(**values):
        for key in ("RANK", "NSHARD_LOG_LEVEL", "NSHARD_LOG_RANKS"):
            monkeypatch.delenv(key, raising=False)
        for key, value in values.items():
            monkeypatch.setenv(key, value)
        log_mod.configure()
    yield set_env
    monkeypatch.undo()
    log_mod.configure()


def say_all():
    log.info("status %d", 1)
    log.warning("careful")
    log.error("broken", extra={"rank": int(os.environ.get("RANK", "0"))})


@pytest.mark.parametrize("rank,status", [("0", "nshard: status 1\n"), ("1", "")])
def test_rank_0_logs_status_on_stdout_and_every_rank_warnings_on_stderr(env, capsys, rank, status):
    env(RANK=rank)
    say_all()
    assert capsys.readouterr() == (status, f"nshard: warning: careful\nnshard: error (rank {rank}): broken\n")


def test_the_level_and_the_ranks_are_set_by_the_environment(env, capsys):
    env(RANK="0", NSHARD_LOG_LEVEL="ERROR")
    say_all()
    assert capsys.readouterr() == ("", "nshard: error (rank 0): broken\n")
    env(RANK="1", NSHARD_LOG_RANKS="all")
    say_all()
    assert capsys.readouterr().out == "nshard: status 1\n"
    env(RANK="1", NSHARD_LOG_RANKS="0,1", NSHARD_LOG_LEVEL="debug")
    log.debug("detail")
    assert capsys.readouterr().out == "nshard: detail\n"


def test_a_bad_setting_is_named_and_the_default_kept(env, capsys):
    env(RANK="0", NSHARD_LOG_LEVEL="loud", NSHARD_LOG_RANKS="first")
    assert capsys.readouterr().err == (
        "nshard: warning: NSHARD_LOG_LEVEL='loud' is not a level; use one of debug, info, warning, error, critical; "
        "logging at info\n"
        "nshard: warning: NSHARD_LOG_RANKS='first' is not 'all' or a list of ranks such as 0,1; logging on rank 0\n")
    say_all()
    assert capsys.readouterr().out == "nshard: status 1\n"


def test_a_tool_error_reaches_stderr_once_under_the_level_a_user_set(tmp_path):
    """A tool's error is a logged line on stderr; NSHARD_LOG_LEVEL=error keeps it, and nothing is printed twice."""
    env = {**os.environ, "NSHARD_LOG_LEVEL": "error", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "nshard.run.hostfile", str(tmp_path / "missing")], cwd=REPO,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("nshard: error: ") == 1 and proc.stderr.startswith("nshard: error: "), proc.stderr
