"""Write a results file for docs/results/: a study's own report.md as the run printed it, with the commit it ran,
the exact commands, this machine's CPU (model and the flags that decide its kernels) and the set-up and run times.
The main job, a second cohort and the growth study each get their own (the run's plan.toml says which).

    .venv/bin/python -m launch.results_file --run runs/cpu-study --setup_s 134 --run_s 3300 \
        --command "bash launch/setup.sh" --command "bash launch/study.sh" --out docs/results

The report is copied byte for byte (the file says so, and holds its SHA-256); nothing in it is retyped. The file is
named <date>-<cpu>-<commit>.md for the main job and <date>-<cpu>-<commit>-cohort.md or -growth.md for the
follow-ups, so each machine, commit and study gets one. Run it on the machine that ran the study, from
the checkout that ran it (its commit is read with git; a checkout with uncommitted changes is refused).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
from nshard.files import write_text_atomic
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


def render(report: str, commit: str, commands: list[str], machine: dict, setup_s: float | None, run_s: float,
           date: str, note: str, kind: str = "main") -> str:
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
        text = render(report_path.read_text(), commit, args.command, machine, args.setup_s, args.run_s, date,
                      args.note, kind)
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{date}-{slug(machine['model'])}-{commit[:7]}{KINDS[kind][1]}.md"
        write_text_atomic(path, text)
    except (ResultsError, OSError) as exc:
        log.error("%s", exc)
        return 2
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog("launch.results_file"), description=__doc__,
                            epilog="Writes one file in --out and prints its path. " + SPELLING_NOTE)
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
