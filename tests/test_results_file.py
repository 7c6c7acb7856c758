"""docs/results/ holds each study's own report.md as the run wrote it: launch/results_file.py copies it byte for
byte with the commit, commands, CPU and times, and every results file still carries the report its SHA-256 names."""

from __future__ import annotations

import hashlib
import json
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


def study_dir(checkout: Path, plan: str = "[model]\nsource = 'x'\n[train]\nupdates = 1\n") -> Path:
    """A study directory laid out as a study leaves it: tests/test_analysis.py's three arms, analysed by the real
    analysis (results.json, report.md) and archived by the real archive, with `plan` as its plan.toml."""
    from nshard.analysis.report import write_outputs
    from nshard.evidence.archive import create_study_archive
    from test_analysis import make_study

    run = make_study(checkout / "runs" / "cpu-study", candidate_correct=60, retention_shift=0.0, candidate_process_s=80.0)
    (run / "plan.toml").write_text(plan)
    write_outputs(run)
    create_study_archive(run, repo=None)
    return run


def test_a_results_file_holds_the_report_byte_for_byte_with_its_commit_and_commands(checkout, tmp_path):
    run = study_dir(checkout)
    report = (run / "report.md").read_text()
    out = tmp_path / "results"
    rc = results_file.main(["--run", str(run), "--checkout", str(checkout), "--command", "bash launch/setup.sh",
                            "--command", "bash launch/study.sh", "--setup_s", "134", "--run_s", "3300",
                            "--date", "2026-12-05", "--out", str(out)])
    assert rc == 0
    [written] = out.glob("*.md")
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
    assert results_file.main(args) == 2
    assert "lacks results.json or evidence.tar" in capsys.readouterr().err  # no figures to trace the report to
    (checkout / "f.txt").write_text("changed\n")
    assert results_file.main(args) == 2
    assert "uncommitted changes" in capsys.readouterr().err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("sections, title, suffix", [("[cohort]\nfrom = 'runs/cpu-study'\n", "The second cohort", "-cohort"),
                                                     ("[cohort]\n[growth]\nexperts = 4\n", "The growth study", "-growth")])
def test_a_follow_up_study_gets_its_own_title_and_name(checkout, tmp_path, sections, title, suffix):
    run = study_dir(checkout, "[model]\nsource = 'x'\n" + sections)
    out = tmp_path / "results"
    assert results_file.main(["--run", str(run), "--checkout", str(checkout), "--command", "c", "--run_s", "60",
                              "--date", "2026-12-05", "--out", str(out)]) == 0
    [written] = out.glob("*.md")
    assert written.name.endswith(f"-{git(checkout, 'rev-parse', 'HEAD')[:7]}{suffix}.md")
    assert written.read_text().startswith(f"# {title} on ") and "Set-up: not timed" in written.read_text()
    assert written.with_name(written.stem + results_file.AUDIT).is_dir()


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


def audited_results_file(checkout: Path, tmp_path: Path) -> tuple[Path, Path]:
    """study_dir's study and its results file written from it."""
    run = study_dir(checkout)
    out = tmp_path / "results"
    assert results_file.main(["--run", str(run), "--checkout", str(checkout), "--command", "bash launch/study.sh",
                              "--run_s", "60", "--date", "2026-12-06", "--out", str(out)]) == 0
    [written] = out.glob("*.md")
    return run, written


def test_a_results_file_keeps_its_audit_files_and_every_headline_figure_traces_to_them(checkout, tmp_path):
    run, written = audited_results_file(checkout, tmp_path)
    folder = written.with_name(written.stem + results_file.AUDIT)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "arms/dense/receipts/rank-0.json", "arms/dense/receipts/rank-1.json", "arms/one-rank/receipts/rank-0.json",
        "arms/powersgd/receipts/rank-0.json", "arms/powersgd/receipts/rank-1.json", "evidence-index.json",
        "evidence.tar.sha256", "results.json"]
    assert (folder / "results.json").read_bytes() == (run / "results.json").read_bytes()
    assert f"- Audit files: [{folder.name}/]({folder.name}/) (the study's `results.json`, 5 ranks' receipts" in \
        written.read_text()
    report = (run / "report.md").read_text()
    assert results_file.audit_mismatches(report, read_audit(folder)) == []


def read_audit(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_figure_that_does_not_trace_is_named_and_such_a_study_gets_no_results_file(checkout, tmp_path):
    run, written = audited_results_file(checkout, tmp_path)
    report = (run / "report.md").read_text()
    files = read_audit(written.with_name(written.stem + results_file.AUDIT))
    results = json.loads(files["results.json"])
    gain = results["screens"]["quality"]["conditions"][0]
    assert gain["name"] == "accuracy gain over seed, points" and f"= {gain['value']:+.4f} " in report
    # A gain retyped in the report, a speedup changed in results.json, a receipt missing or edited: each named.
    edited = report.replace(f"= {gain['value']:+.4f} ", f"= {gain['value'] + 0.01:+.4f} ")
    assert results_file.figure_mismatches(edited, results) == [
        f"screen line 'PASS: accuracy gain over seed, points = {gain['value'] + 0.01:+.4f}' is not in results.json",
        "results.json's condition 'accuracy gain over seed, points' is not in the report"]
    assert "report.md: its SHA-256 is not the one the archive's index gives study/report.md" in \
        results_file.audit_mismatches(edited, files)
    results["screens"]["speed"]["speedups"]["powersgd"]["complete_process"] *= 1.01
    assert results_file.figure_mismatches(report, results) == ["the speedups of powersgd differ from results.json's"]
    results = json.loads(files["results.json"])
    results["arms"][2]["retention"]["upper_nats"] += 1e-5
    assert results_file.figure_mismatches(report, results) == ["the report's retention bound row differs from results.json's"]
    gone = {k: v for k, v in files.items() if k != "arms/dense/receipts/rank-1.json"}
    assert results_file.audit_mismatches(report, gone) == [
        "arms/dense/receipts/rank-1.json: listed in the archive's index but not among the audit files"]
    forged = {**files, "arms/dense/receipts/rank-1.json": b"{}"}
    assert results_file.audit_mismatches(report, forged) == [
        "arms/dense/receipts/rank-1.json: its SHA-256 is not the one the archive's index gives "
        "study/arms/dense/receipts/rank-1.json"]
    # The study's results.json disagreeing with its report: refused, nothing written.
    (run / "report.md").write_text(edited)
    out = tmp_path / "refused"
    assert results_file.main(["--run", str(run), "--checkout", str(checkout), "--command", "c", "--run_s", "1",
                              "--out", str(out)]) == 2
    assert not out.exists()


def test_every_audited_results_file_traces_its_figures_and_the_others_are_named_as_unauditable():
    """A results file with a <name>.audit/ folder: its report's headline figures equal its results.json's, and its
    files are the ones the evidence archive's index lists. One without (its run is gone): docs/results/README.md
    names it among those that cannot be audited."""
    index = (RESULTS / "README.md").read_text()
    unauditable = index.split("cannot be audited", 1)[1].split("\n\n", 1)[0] if "cannot be audited" in index else ""
    for path in sorted(p for p in RESULTS.glob("*.md") if p.name != "README.md"):
        folder = path.with_name(path.stem + results_file.AUDIT)
        if not folder.is_dir():
            assert path.name in unauditable, f"{path.name} has no audit files and README.md does not say why"
            continue
        text = path.read_text()
        report = text[re.search(r"copied as the run wrote it \(SHA-256 `[0-9a-f]{64}`\):\n\n---\n", text).end():]
        assert results_file.audit_mismatches(report, read_audit(folder)) == [], path.name
