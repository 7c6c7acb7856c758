"""Plant each of eight named faults in a scratch copy of this checkout and show that the suite fails on it.

    python launch/mutants.py [--only NAME ...] [--tiers fast,full] [--whole] [--scratch DIR] [--record FILE]
                             [--keep]

The scratch copy is a clone of this checkout's HEAD with its uncommitted changes applied (tracked files and
untracked, not ignored ones), set up with launch/setup.sh in its own .venv, so the tests and every rank they launch
import the mutated code. It is removed at the end unless --keep (its logs stay in DIR-logs). Each mutant is a
textual replacement that must match its file exactly once; a mutant whose text is no longer there is an error (the
code moved: update the mutant here), never a pass.

Per mutant:
- fast tier (mutants marked so): `pytest -m "not slow" -x` in the scratch copy must fail;
- full suite: its guard tests (the ones that should catch it) run first with -x; when they fail the suite fails
  (they are part of it). `--whole` runs the README's whole command (`pytest -x`) instead, stopping at the first
  failure. A mutant the guards miss falls through to the whole suite.

Before any mutant, the same commands run on the unmutated copy and must pass, so a failure is the mutant's.
tests/test_mutants.py is left out of these runs (it fails on any planted mutant by design). A
mutant is "caught" only by failing tests (pytest exit 1, or pytest-xdist's exit 2 after -x stopped it on a failure); any other exit (collection error, interruption) stops the
script with exit 1, naming the log. Exit 0: every mutant caught in every tier asked for; 1: some mutant survived.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from nshard.cli import SPELLING_NOTE, ArgumentParser
from nshard.files import write_text_atomic

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]  # (file, exact text, replacement)
    guards: tuple[str, ...]
    fast: bool = False


MUTANTS = (
    Mutant("error-feedback-dropped", "the residual M - output is not carried into the next update (error := 0)",
           (("nshard/comm/feedback.py", "    def settle(self, name, m, delivered_2d):\n        m.sub_(delivered_2d)\n",
             "    def settle(self, name, m, delivered_2d):\n        m.zero_()\n"),
            ("nshard/comm/feedback.py", "        self.tensors[name].copy_(m.sub_(delivered_2d))\n",
             "        self.tensors[name].zero_()\n")),
           ("tests/test_comm_powersgd.py::test_error_feedback_loses_nothing",), fast=True),
    Mutant("q-not-averaged", "each rank keeps its own Q (no all-reduce, no division by the world size)",
           (("nshard/comm/powersgd.py",
             "    q_sent = transport.all_reduce_sum_(state.q_flat)\n    state.q_flat.div_(transport.world_size)\n",
             "    q_sent = 0\n"),),
           ("tests/test_comm_powersgd.py::test_below_full_rank_powersgd_matches_a_float64_reference",
            "tests/test_comm_powersgd.py::test_ranks_end_every_update_with_identical_outputs"), fast=True),
    Mutant("local-response-weight", "each rank normalizes by its own documents' response weight, not the global batch's",
           (("nshard/run/loss.py", "    scale = deepspeed_backward_scale(world) / global_weight\n",
             "    scale = deepspeed_backward_scale(world) / math.fsum(prepared[i].target_weight for m in share for i in m)\n"),),
           ("tests/test_objective.py",), fast=True),
    Mutant("replica-check-skipped", "the ranks' parameter roots are gathered but never compared (checks and export)",
           (("nshard/run/state.py", "        if len(set(roots)) != 1:\n            states = sealed_states(self.run.out)\n",
             "        if False:\n            states = sealed_states(self.run.out)\n"),
            ("nshard/run/training.py", "        if len(set(roots)) != 1:\n            raise RunError(f\"ranks disagree",
             "        if False:\n            raise RunError(f\"ranks disagree")),
           ("tests/test_resume.py::test_replica_divergence_stops_the_run_and_keeps_the_last_state",)),
    Mutant("manifest-extra-unchecked", "verify_manifest ignores an entry present in model/ but not listed",
           (("nshard/evidence/export.py", "    difference = first_difference(listed, found)\n",
             "    difference = first_difference(listed, {k: v for k, v in found.items() if k in listed})\n"),),
           ("tests/test_export.py::test_manifest_names_a_changed_missing_or_extra_file",)),
    Mutant("stored-score-trusted", "validation takes a task answer's stored correct flag instead of scoring its text",
           (("nshard/study/validate.py", "        correct = tasks.score(case, decoded)\n",
             "        correct = row.get(\"correct\")\n"),),
           ("tests/test_study.py::test_validation_catches_a_changed_correct_flag",)),
    Mutant("own-delta-twice", "the delta-sync owner adds its own quantized delta to its replica twice",
           (("nshard/comm/delta.py", "    codec.apply_(replicas[me], encoded[me])\n",
             "    codec.apply_(replicas[me], encoded[me])\n    codec.apply_(replicas[me], encoded[me])\n"),),
           ("tests/test_delta_sync.py::test_two_ranks_end_with_bit_identical_replicas_and_send_the_encoded_bytes",)),
    Mutant("resume-other-ranks-errors", "resume loads the next rank's reducer state (its error memory) into this rank",
           (("nshard/run/state.py", "            self.seam.load_state_dict(part[\"seam\"])\n            record = None\n",
             "            self.seam.load_state_dict(torch.load(state / f\"rank-{(self.run.rank + 1) % self.run.world}.pt\",\n"
             "                                                 map_location=\"cpu\", weights_only=False)[\"seam\"])\n"
             "            record = None\n"),),
           ("tests/test_resume.py::test_killed_run_resumes_bit_identical",)),
)


SELF_CHECK = ["--ignore=tests/test_mutants.py"]
"""Left out of every run here: it checks that each mutant's text is still in its file, so it fails on any planted
mutant (a catch that says nothing about the suite)."""


class Stale(RuntimeError):
    """A mutant's text is not in its file exactly once."""


def sh(*cmd, cwd=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(map(str, cmd)), cwd=cwd, check=True, **kw)


def make_scratch(scratch: Path) -> str:
    """A clone of HEAD plus this checkout's uncommitted changes; an existing scratch clone is reset (its .venv kept)."""
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if (scratch / ".git").is_dir():
        sh("git", "-C", scratch, "fetch", "-q", REPO, head)
        sh("git", "-C", scratch, "checkout", "-q", "--detach", "-f", head)
        sh("git", "-C", scratch, "clean", "-q", "-fdx", "-e", ".venv", "-e", ".cache")
    else:
        sh("git", "clone", "-q", "--no-local", REPO, scratch)
        sh("git", "-C", scratch, "checkout", "-q", "--detach", head)
    diff = subprocess.run(["git", "-C", REPO, "diff", "HEAD", "--binary"], capture_output=True, check=True).stdout
    if diff:
        subprocess.run(["git", "-C", scratch, "apply", "--whitespace=nowarn", "-"], input=diff, check=True)
    untracked = subprocess.run(["git", "-C", REPO, "ls-files", "-o", "--exclude-standard", "-z"], capture_output=True,
                               check=True).stdout.decode().split("\0")
    for rel in filter(None, untracked):
        (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, scratch / rel)
    return head + ("+changes" if diff or any(untracked) else "")


def stale(root: Path, mutant: Mutant) -> list[str]:
    """The edits of `mutant` whose text is not in its file under `root` exactly once."""
    return [f"{rel}: its text is there {(root / rel).read_text().count(old)} times, not once"
            for rel, old, _ in mutant.edits if (root / rel).read_text().count(old) != 1]


def apply(scratch: Path, mutant: Mutant) -> dict[Path, str]:
    """Plant the mutant (after checking every edit's text is there once: stale()); returns the original texts."""
    problems = stale(scratch, mutant)
    if problems:
        raise Stale(f"mutant {mutant.name}: {problems[0]}: the code moved; update the mutant in launch/mutants.py")
    originals: dict[Path, str] = {}
    for rel, old, new in mutant.edits:
        path = scratch / rel
        current = path.read_text()
        originals.setdefault(path, current)
        path.write_text(current.replace(old, new))
    return originals


@dataclass
class Outcome:
    rc: int
    seconds: float
    failed: list[str] = field(default_factory=list)


def pytest(scratch: Path, args: list[str], log: Path) -> Outcome:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "NSHARD_CACHE"))}
    env["NSHARD_CACHE"] = os.environ.get("NSHARD_CACHE", str(REPO / ".cache" / "nshard"))  # one model conversion
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.run([scratch / ".venv/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                               *SELF_CHECK, *args], cwd=scratch, env=env, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)))
    rc = proc.returncode
    if rc == 2 and failed and re.search(r"^!+ xdist\.dsession\.Interrupted: stopping after \d+ failures", text, re.M):
        rc = 1  # pytest-xdist ends an -x run that failed with exit 2 ("Interrupted"): tests failed
    return Outcome(rc, time.monotonic() - t0, failed)


def check_baseline(what: str, outcome: Outcome, log: Path) -> None:
    if outcome.rc != 0:
        raise SystemExit(f"mutants: {what} fails on the unmutated copy (exit {outcome.rc}, {outcome.failed[:3]}); "
                         f"fix that first. Log: {log}")


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes the scratch clone (--scratch DIR, removed unless --keep), its logs in DIR-logs, and with "
              "--record FILE the outcome as JSON and a table beside it (.md). " + SPELLING_NOTE)
    parser = ArgumentParser(description=__doc__.split("\n")[0], epilog=epilog)
    parser.add_argument("--only", nargs="*", choices=[m.name for m in MUTANTS], help="these mutants only")
    parser.add_argument("--tiers", default="fast,full", help="comma-separated: fast, full (default both)")
    parser.add_argument("--whole", action="store_true", help="full tier: the whole suite with -x, not guards first")
    parser.add_argument("--scratch", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "nshard-mutants")
    parser.add_argument("--record", type=Path, help="write the outcome as JSON here (and a table beside it, .md)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the scratch clone and its .venv (about 2 GB) for the next run; removed otherwise")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tiers = [t for t in args.tiers.split(",") if t]
    if set(tiers) - {"fast", "full"} or not tiers:
        parser.error(f"--tiers {args.tiers!r}: name fast, full or both")
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    scratch = args.scratch.resolve()
    if scratch == REPO or REPO in scratch.parents:
        parser.error(f"--scratch {scratch}: put it outside this checkout")
    logs = scratch.parent / f"{scratch.name}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    source = make_scratch(scratch)  # raises before anything is removed: a --scratch that is not a clone stays as it was
    try:
        return plant_all(args, tiers, mutants, scratch, logs, source, t_start)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


def plant_all(args: argparse.Namespace, tiers: list[str], mutants: list[Mutant], scratch: Path, logs: Path,
              source: str, t_start: float) -> int:
    """Set up the scratch clone, check the unmutated copy, then plant and judge each mutant; 0 when all are caught."""
    print(f"mutants: scratch copy of {source} in {scratch}; setting up its .venv (log: {logs / 'setup.log'})",
          flush=True)
    with (logs / "setup.log").open("w") as f:
        if subprocess.run(["bash", "launch/setup.sh"], cwd=scratch, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"mutants: launch/setup.sh failed in {scratch}; see {logs / 'setup.log'}")

    def full_args(m: Mutant | None) -> list[str]:
        if args.whole:
            return ["-x"]
        guards = sorted({g for x in mutants for g in x.guards}) if m is None else list(m.guards)
        return ["-x", *guards]

    fast_args = ["-x", "-m", "not slow"]
    # The unmutated copy passes what each mutant will be judged by.
    if "fast" in tiers and any(m.fast for m in mutants):
        o = pytest(scratch, fast_args, logs / "unmutated-fast.log")
        check_baseline("the fast tier", o, logs / "unmutated-fast.log")
        print(f"mutants: unmutated fast tier passes ({o.seconds:.0f} s)", flush=True)
    if "full" in tiers:
        o = pytest(scratch, full_args(None), logs / "unmutated-full.log")
        check_baseline("the whole suite" if args.whole else "the guard tests", o, logs / "unmutated-full.log")
        print(f"mutants: unmutated {'suite' if args.whole else 'guard tests'} pass ({o.seconds:.0f} s)", flush=True)

    rows, survived = [], 0
    for m in mutants:
        originals = apply(scratch, m)
        row = {"mutant": m.name, "what": m.what, "files": sorted({e[0] for e in m.edits})}
        try:
            for tier in tiers:
                if tier == "fast" and not m.fast:
                    continue
                log = logs / f"{m.name}-{tier}.log"
                o = pytest(scratch, fast_args if tier == "fast" else full_args(m), log)
                how = "fast tier" if tier == "fast" else ("whole suite" if args.whole else "guards")
                if tier == "full" and not args.whole and o.rc == 0:  # the guards missed it: the whole suite decides
                    o = pytest(scratch, ["-x"], log)
                    how = "whole suite (guards missed it)"
                if o.rc not in (0, 1):
                    raise SystemExit(f"mutants: {m.name}, {tier}: pytest exit {o.rc} (not a test failure); log: {log}")
                caught = o.rc == 1
                survived += not caught
                row[tier] = {"caught": caught, "by": o.failed, "how": how, "seconds": round(o.seconds, 1)}
                print(f"mutants: {m.name:28s} {tier:4s} {'CAUGHT' if caught else 'SURVIVED'} in {o.seconds:5.0f} s "
                      f"({how}) by {', '.join(o.failed) or '-'}", flush=True)
        finally:
            for path, text in originals.items():
                path.write_text(text)
        rows.append(row)
    total = time.monotonic() - t_start
    result = {"source": source, "tiers": tiers, "whole": args.whole, "seconds": round(total, 1),
              "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "mutants": rows,
              "survived": survived}
    table = ["| mutant | " + " | ".join(tiers) + " |", "|---|" + "---|" * len(tiers)]
    for row in rows:
        cells = [("caught" if row[t]["caught"] else "**SURVIVED**") + f" ({row[t]['seconds']:.0f} s, "
                 f"{', '.join(x.split('::')[-1] for x in row[t]['by'][:2]) or '-'})" if t in row else "not marked"
                 for t in tiers]
        table.append(f"| {row['mutant']} | " + " | ".join(cells) + " |")
    print("\n".join(table))
    print(f"mutants: {len(rows)} planted, {survived} survived a tier; {total / 60:.1f} min in all", flush=True)
    if args.record:
        write_text_atomic(args.record, json.dumps(result, indent=1) + "\n")
        write_text_atomic(args.record.with_suffix(".md"), f"Mutants on {source}, {result['at']}, "
                          f"{total / 60:.1f} min:\n\n" + "\n".join(table) + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Stale as exc:
        print(f"mutants: {exc}", file=sys.stderr)
        sys.exit(2)
