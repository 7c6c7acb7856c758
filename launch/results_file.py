"""Write a results file for docs/results/: a study's own report.md as the run printed it, with the commit it ran,
the exact commands, this machine's CPU (model and the flags that decide its kernels) and the set-up and run times.
The main job, a second cohort and the growth study each get their own (the run's plan.toml says which).

    .venv/bin/python -m launch.results_file --run runs/cpu-study --setup_s 134 --run_s 3300 \
        --command "bash launch/setup.sh" --command "bash launch/study.sh" --out docs/results

The report is copied byte for byte (the file says so, and holds its SHA-256); nothing in it is retyped. The file is
named <date>-<cpu>-<commit>.md for the main job and <date>-<cpu>-<commit>-cohort.md or -growth.md for the
follow-ups, so each machine, commit and study gets one. Run it on the machine that ran the study, from
the checkout that ran it (its commit is read with git; a checkout with uncommitted changes is refused).

Beside it, <name>.audit/ holds what the report's figures come from (small files, no weights): the study's
results.json, every rank's receipts (arms/<arm>/receipts/rank-<r>.json, and failed attempts' under failed/), the
evidence archive's member index (evidence-index.json) and its SHA-256 line. Before anything is written, the archive
is verified, and the report's headline figures (screen conditions, paired bounds, retention, correct counts,
speedups, parameter roots) must equal results.json's, and each audit file the archive's index entry for it: a
study whose files disagree gets no results file.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
from nshard.evidence import archive
from nshard.files import staged_dir, write_text_atomic
from nshard.log import log

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "avx_vnni")
"""The CPU flags that decide which kernels torch takes (fp32 AVX2, AVX-512, bf16 on AVX512-BF16 or AMX)."""


class ResultsError(Exception):
    pass


def cpu() -> dict:
    """The CPU's model name, vendor family/model and the flags of FLAGS it has, from /proc/cpuinfo."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    return {"model": info.get("model name") or platform.processor() or "unknown",
            "family": info.get("cpu family"), "model_number": info.get("model"),
            "flags": [f for f in FLAGS if f in flags], "cores": len(os.sched_getaffinity(0))}


KINDS = {"main": ("The main job", ""), "cohort": ("The second cohort", "-cohort"),
         "growth": ("The growth study", "-growth")}
"""A study's kind: its results file's title and the suffix of its name."""


def kind_of(run: Path) -> str:
    """"growth" for a plan with a [growth] section, "cohort" for one with [cohort] alone, else "main"."""
    path = run / "plan.toml"
    try:
        plan = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{path} does not exist: give --run a study directory (the study writes its plan there)")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ResultsError(f"{path} cannot be read as TOML ({exc}): give --run the directory the study wrote")
    return "growth" if "growth" in plan else "cohort" if "cohort" in plan else "main"


def slug(model: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[:40] or "cpu"


def commit_of(checkout: Path) -> str:
    def git(*args):
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        raise ResultsError(f"{checkout} is not a git checkout: run this from the checkout that ran the study")
    if git("status", "--porcelain", "--untracked-files=no").stdout.strip():
        raise ResultsError(f"{checkout} has uncommitted changes: a results file names one commit; run the study "
                           "from a clean checkout")
    return head.stdout.strip()


AUDIT = ".audit"
"""The audit folder's suffix: docs/results/<name>.audit/ beside docs/results/<name>.md."""
INDEX = "evidence-index.json"
RECEIPTS = ("arms/*/receipts/rank-*.json", "failed/*/receipts/rank-*.json")


def audit_files(run: Path) -> dict[str, bytes]:
    """The audit folder's files by relative path, from a study directory whose evidence archive verifies."""
    tar, sidecar = run / archive.STUDY_ARCHIVE, archive.sidecar(run / archive.STUDY_ARCHIVE)
    if not (run / "results.json").is_file() or not tar.is_file() or not sidecar.is_file():
        raise ResultsError(f"{run} lacks results.json or {tar.name} and its .sha256: give --run a study directory "
                           "whose study finished (the analysis and the archive are its last steps)")
    try:
        index, members = archive.verify_bytes(tar.read_bytes(), sidecar.read_text().split()[0])
    except archive.ArchiveError as exc:
        raise ResultsError(f"{tar} does not verify ({exc}); its study's files cannot be audited") from None
    # The archive's own copies, the bytes its index binds (a study with a store adds its locators to the
    # results.json on disk after the archive is made).
    if "study/results.json" not in members:
        raise ResultsError(f"{tar} holds no study/results.json: archive the study again after its analysis "
                           f"(python -m nshard.evidence.archive create {run} {tar})")
    files = {"results.json": members["study/results.json"], INDEX: archive.index_bytes(index),
             f"{tar.name}.sha256": sidecar.read_bytes()}
    files.update({name[len("study/"):]: data for name, data in members.items()
                  if any(fnmatch.fnmatch(name, f"study/{pattern}") for pattern in RECEIPTS)})
    return files


def audit_mismatches(report: str, files: dict[str, bytes]) -> list[str]:
    """Every way the report and the audit files disagree: a headline figure the report prints that results.json
    does not hold, or an audit file (results.json, a receipt) or the report whose SHA-256 is not the archive
    index's, or a receipt the index lists that is missing. Empty: every figure traces to its files."""
    try:
        index = json.loads(files[INDEX])
        results = json.loads(files["results.json"])
    except (KeyError, ValueError) as exc:
        return [f"the audit files lack a readable {INDEX} or results.json ({exc})"]
    problems = [] if archive.index_bytes(index) == files[INDEX] else [f"{INDEX} does not match its own index_sha256"]
    members = index.get("members", {})
    listed = {n[len("study/"):] for n in members if re.fullmatch(r"study/(arms|failed)/[^/]+/receipts/rank-\d+\.json", n)}
    problems += [f"{name}: listed in the archive's index but not among the audit files" for name in sorted(listed - set(files))]
    for name, data in [("report.md", report.encode()), *files.items()]:
        if name in (INDEX, f"{archive.STUDY_ARCHIVE}.sha256"):
            continue
        entry = members.get(f"study/{name}")
        if entry is None or entry["sha256"] != hashlib.sha256(data).hexdigest():
            problems.append(f"{name}: its SHA-256 is not the one the archive's index gives study/{name}")
    return problems + figure_mismatches(report, results)


def _near(printed: str, value, digits: int) -> bool:
    """The printed number is `value` as the report rounds it (to `digits` decimals)."""
    try:
        return isinstance(value, (int, float)) and abs(float(printed.replace(",", "")) - value) <= 0.51 * 10 ** -digits
    except ValueError:
        return False


def _decimals(printed: str) -> int:
    return len(printed.partition(".")[2].rstrip("×%"))


def figure_mismatches(report: str, results: dict) -> list[str]:
    """The report's headline figures against results.json: every screen condition (PASS/FAIL/NOT COMPARABLE, its
    value), the paired comparisons, the correct counts and retention rows, the speedups and the parameter roots."""
    problems = screen_mismatches(report, results) + paired_mismatches(report, results) + row_mismatches(report, results)
    speedups = (results.get("screens", {}).get("speed") or {}).get("speedups", {})
    for name, complete, active, device in re.findall(
            r"^- (\S+): complete-process speedup (\S+)×, active (\S+)×, (\S+)× the baseline's device seconds$",
            report, re.M):
        sp = speedups.get(name, {})
        if not all(_near(v, sp.get(k), 3) for v, k in ((complete, "complete_process"), (active, "active"),
                                                       (device, "device_seconds_ratio"))):
            problems.append(f"the speedups of {name} differ from results.json's")
    roots = dict(re.findall(r"^- (\S+): parameter root `([^`]+)`$", report, re.M))
    return problems + [f"{a['name']}'s parameter root differs from results.json's" for a in results.get("arms", [])
                       if a.get("status") == "complete" and roots.get(a["name"]) != a.get("parameter_root")]


def screen_mismatches(report: str, results: dict) -> list[str]:
    """Each printed screen line matched to one condition of results.json (name, verdict, rule, value), and back."""
    unmatched = [c for screen in results.get("screens", {}).values() if isinstance(screen, dict)
                 for c in screen.get("conditions", [])]
    lines = re.findall(r"^- (PASS|FAIL|NOT COMPARABLE): (.+) = (\S+) \(needs (.+)\)$", report, re.M)
    problems = [] if lines else ["the report prints no screen condition"]
    for verdict, name, shown, rule in lines:
        passed = {"PASS": True, "FAIL": False, "NOT COMPARABLE": None}[verdict]
        hit = next((c for c in unmatched if c["name"] == name and c["passed"] is passed and c.get("rule") == rule and (
            _near(shown, c["value"], _decimals(shown)) if isinstance(c["value"], float) else str(c["value"]) == shown)),
                   None)
        if hit is None:
            problems.append(f"screen line '{verdict}: {name} = {shown}' is not in results.json")
        else:
            unmatched.remove(hit)
    return problems + [f"results.json's condition '{c['name']}' is not in the report" for c in unmatched]


def paired_mismatches(report: str, results: dict) -> list[str]:
    problems = []
    for cand, ctrl, n, disc, diff, low, up in re.findall(
            r"^\| (\S+) − (\S+) \| (\d+) \| (\d+) \| (\S+) \| \[(\S+), (\S+)\] \|$", report, re.M):
        c = next((c for c in results.get("comparisons", []) if (c["candidate"], c["control"]) == (cand, ctrl)), None)
        if c is None or (c["n"], c["discordant"]) != (int(n), int(disc)) or not all(
                _near(v, c[k], 2) for v, k in ((diff, "difference_points"), (low, "lower_points"), (up, "upper_points"))):
            problems.append(f"paired comparison {cand} − {ctrl} differs from results.json's")
    return problems


def row_mismatches(report: str, results: dict) -> list[str]:
    """The learning table's correct counts and retention rows (exposed; held out where the arms have it), cell by
    cell against the seed's and each arm's figures."""
    arms = results.get("arms", [])
    exposed = [{}] + [a.get("retention") or {} for a in arms]  # the seed's column: no change of its own
    held = [{}] + [a.get("retention_heldout") or {} for a in arms]
    rows = {"correct": (r"Correct / [\d,]+", [m.get("correct") for m in [results.get("seed", {}), *arms]]),
            "retention mean": (r"Mean retention-loss change, nats", [r.get("mean_change_nats") for r in exposed]),
            "retention bound": (r"Approximate \d+% upper retention bound", [r.get("upper_nats") for r in exposed])}
    if any(held):
        rows.update({"held-out retention mean": (r"Mean held-out retention-loss change \([^)]*\), nats",
                                                 [h.get("mean_change_nats") for h in held]),
                     "held-out retention bound": (r"Approximate \d+% upper held-out retention bound",
                                                  [h.get("upper_nats") for h in held])})
    problems = []
    for label, (pattern, values) in rows.items():
        row = re.search(rf"^\| {pattern} \|(.*)\|$", report, re.M)
        cells = [c.strip() for c in row.group(1).split("|")] if row else []
        if len(cells) != len(values) or not all(
                (v is None and c in ("—", "failed")) or (v is not None and _near(c, v, _decimals(c)))
                for c, v in zip(cells, values)):
            problems.append(f"the report's {label} row differs from results.json's")
    return problems


def render(report: str, commit: str, commands: list[str], machine: dict, setup_s: float | None, run_s: float,
           date: str, note: str, kind: str = "main", audit: tuple[str, dict] | None = None) -> str:
    digest = hashlib.sha256(report.encode()).hexdigest()
    flags = ", ".join(machine["flags"]) or "none of " + ", ".join(FLAGS)
    lines = [f"# {KINDS[kind][0]} on {machine['model']}, commit {commit[:7]}", "",
             f"- Date: {date}",
             f"- Commit: `{commit}`",
             f"- Machine: {machine['model']} (family {machine['family']}, model {machine['model_number']}), "
             f"{machine['cores']} cores; CPU flags that decide the kernels: {flags}",
             f"- Set-up: {f'{setup_s:.0f} s' if setup_s is not None else 'not timed'}; run: {run_s:.0f} s "
             f"({run_s / 60:.1f} min)",
             "- Commands, from a fresh clone of that commit:", "", "```bash",
             *(f"time {c}" for c in commands), "```", ""]
    if audit:
        folder, files = audit
        receipts = sum(1 for n in files if n.endswith(".json") and "/receipts/" in n)
        lines.insert(lines.index("- Commands, from a fresh clone of that commit:"),
                     f"- Audit files: [{folder}/]({folder}/) (the study's `results.json`, {receipts} ranks' receipts, "
                     f"the evidence archive's member index and its SHA-256), which the report's figures trace to")
    if note:
        lines += [note.strip(), ""]
    lines += [f"The study's `report.md`, copied as the run wrote it (SHA-256 `{digest}`):", "", "---", ""]
    return "\n".join(lines) + report


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report_path = args.run / "report.md"
        if not report_path.is_file():
            raise ResultsError(f"{report_path} does not exist: give --run a study directory whose study finished")
        kind = kind_of(args.run)
        commit = commit_of(args.checkout)
        machine = cpu()
        date = args.date or datetime.date.today().isoformat()
        report = report_path.read_text()
        files = audit_files(args.run)
        problems = audit_mismatches(report, files)
        if problems:
            raise ResultsError(f"{args.run}: the report does not trace to its files: " + "; ".join(problems[:5]))
        path = args.out / f"{date}-{slug(machine['model'])}-{commit[:7]}{KINDS[kind][1]}.md"
        folder = path.with_name(path.stem + AUDIT)
        text = render(report, commit, args.command, machine, args.setup_s, args.run_s, date, args.note, kind,
                      (folder.name, files))
        if folder.exists():
            shutil.rmtree(folder)  # the same machine, commit and study written again: its files replace the old
        with staged_dir(folder, "audit") as tmp:
            for name, data in files.items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).write_bytes(data)
        write_text_atomic(path, text)
    except (ResultsError, OSError) as exc:
        log.error("%s", exc)
        return 2
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog("launch.results_file"), description=__doc__,
                            epilog="Writes one file and its audit folder in --out and prints the file's path. " + SPELLING_NOTE)
    parser.add_argument("--run", type=Path, required=True, help="the study directory (holds report.md and plan.toml)")
    parser.add_argument("--checkout", type=Path, default=Path("."), help="the checkout that ran it (default: here)")
    parser.add_argument("--command", action="append", required=True, help="a command as typed (repeat, in order)")
    parser.add_argument("--setup_s", type=float, default=None, help="seconds the set-up command took")
    parser.add_argument("--run_s", type=float, required=True, help="seconds the study command took")
    parser.add_argument("--date", default=None, help="the run's date, YYYY-MM-DD (default: today)")
    parser.add_argument("--note", default="", help="a paragraph on the conditions (load, what else ran)")
    parser.add_argument("--out", type=Path, default=Path("docs/results"), help="where to write (docs/results)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
