"""docs/results/ holds each study's own report.md as the run wrote it: launch/results_file.py copies it byte for
byte with the commit, commands, CPU and times, and every results file still carries the report its SHA-256 names."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pytest

from launch import results_file

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"


def git(cwd: Path, *args) -> str:
    return subprocess.run(["git", "-C", str(cwd), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    repo = tmp_path / "clone"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "f.txt").write_text("x\n")
    git(repo, "add", "f.txt")
    git(repo, "commit", "-q", "-m", "c")
    return repo


def test_a_results_file_holds_the_report_byte_for_byte_with_its_commit_and_commands(checkout, tmp_path):
    run = checkout / "runs" / "cpu-study"
    run.mkdir(parents=True)
    (run / "plan.toml").write_text("[model]\nsource = 'x'\n[train]\nupdates = 1\n")
    report = "# Report\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\ttabs and trailing spaces stay   \n"
    (run / "report.md").write_text(report)
    out = tmp_path / "results"
    rc = results_file.main(["--run", str(run), "--checkout", str(checkout), "--command", "bash launch/setup.sh",
                            "--command", "bash launch/study.sh", "--setup_s", "134", "--run_s", "3300",
                            "--date", "2026-12-05", "--out", str(out)])
    assert rc == 0
    [written] = out.iterdir()
    commit = git(checkout, "rev-parse", "HEAD")
    assert written.name.startswith("2026-12-05-") and written.name.endswith(f"-{commit[:7]}.md")
    text = written.read_text()
    assert text.startswith("# The main job on ")
    assert text.endswith(report) and f"- Commit: `{commit}`" in text
    assert "time bash launch/setup.sh\ntime bash launch/study.sh\n" in text and "run: 3300 s (55.0 min)" in text
    assert hashlib.sha256(report.encode()).hexdigest() in text


def test_a_results_file_is_refused_for_a_checkout_with_changes_or_a_run_without_a_report(checkout, tmp_path, capsys):
    run = checkout / "runs" / "s"
    run.mkdir(parents=True)
    args = ["--run", str(run), "--checkout", str(checkout), "--command", "x", "--run_s", "1", "--out",
            str(tmp_path / "o")]
    assert results_file.main(args) == 2
    assert "report.md does not exist" in capsys.readouterr().err
    (run / "report.md").write_text("r\n")
    assert results_file.main(args) == 2
    assert "plan.toml does not exist" in capsys.readouterr().err
    (run / "plan.toml").write_text("[model\n")
    assert results_file.main(args) == 2
    assert "plan.toml cannot be read as TOML" in capsys.readouterr().err
    (run / "plan.toml").write_text("[model]\n")
    (checkout / "f.txt").write_text("changed\n")
    assert results_file.main(args) == 2
    assert "uncommitted changes" in capsys.readouterr().err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("sections, title, suffix", [("[cohort]\nfrom = 'runs/cpu-study'\n", "The second cohort", "-cohort"),
                                                     ("[cohort]\n[growth]\nexperts = 4\n", "The growth study", "-growth")])
def test_a_follow_up_study_gets_its_own_title_and_name(checkout, tmp_path, sections, title, suffix):
    run = checkout / "runs" / "follow-up"
    run.mkdir(parents=True)
    (run / "plan.toml").write_text("[model]\nsource = 'x'\n" + sections)
    (run / "report.md").write_text("r\n")
    out = tmp_path / "results"
    assert results_file.main(["--run", str(run), "--checkout", str(checkout), "--command", "c", "--run_s", "60",
                              "--date", "2026-12-05", "--out", str(out)]) == 0
    [written] = out.iterdir()
    assert written.name.endswith(f"-{git(checkout, 'rev-parse', 'HEAD')[:7]}{suffix}.md")
    assert written.read_text().startswith(f"# {title} on ") and "Set-up: not timed" in written.read_text()


def test_every_results_file_carries_the_report_its_sha256_names():
    files = sorted(p for p in RESULTS.glob("*.md") if p.name != "README.md")
    index = (RESULTS / "README.md").read_text()
    for path in files:
        text = path.read_text()
        digest = re.search(r"copied as the run wrote it \(SHA-256 `([0-9a-f]{64})`\):\n\n---\n", text)
        assert digest, f"{path.name}: no report SHA-256 line"
        report = text[digest.end():]
        assert hashlib.sha256(report.encode()).hexdigest() == digest.group(1), f"{path.name}: the report was edited"
        commit = re.search(r"- Commit: `([0-9a-f]{40})`", text)
        assert commit, path.name
        shallow = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"], capture_output=True,
                                 text=True).stdout.strip()
        if shallow == "false":  # a shallow CI clone may not hold it
            assert subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit.group(1)}^{{commit}}"]
                                  ).returncode == 0, f"{path.name}: commit {commit.group(1)} is not in the history"
        assert f"({path.name})" in index, f"docs/results/README.md does not link {path.name}"
