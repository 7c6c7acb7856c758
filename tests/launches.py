"""Every launch the suite makes, counted per test: DeepSpeed's runner, the warm launcher (tests/warm.py), torchrun,
mpirun, a study, a launch/ script, the trainer as one process, and the spawn harness (tests/spawn.py).

A pytest plugin (tests/conftest.py loads it). It records each launch with its configuration, the test that made it
and its seconds; with NSHARD_LAUNCH_INVENTORY=FILE.md the session writes the table (docs/testing.md#launches) to
FILE.md and every record to FILE.json. With pytest-xdist each worker hands its records to the controller, which
writes them once. The launch budget (tests/launch_budget.txt) is checked at the end of every session: per test file,
its own launches; and the distinct shared runs (tests/runs.py cached_run), each launched once per session.

    .venv/bin/python tests/launches.py FILE.json [--budget]   # the table again from the records (or the budget lines)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUDGET_FILE = Path(__file__).resolve().parent / "launch_budget.txt"
INVENTORY_VARIABLE = "NSHARD_LAUNCH_INVENTORY"
SHARED = "shared runs"
"""The budget line of the runs that tests/runs.py cached_run launches once per session, by name."""

RECORDS: list[dict] = []
"""This process's launches, in the order they started."""
REQUESTS: list[dict] = []
"""Every cached_run call: {"test", "name"} (the name is launched once per session, by whichever test comes first)."""
_TEST: list[str | None] = [None]
_OWN = threading.local()  # set while runs.launch or the warm launcher starts its own processes: recorded there


def current_test() -> str | None:
    return _TEST[0]


def fingerprint(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:10]


@contextlib.contextmanager
def launching(kind: str, config: dict, shared: str | None = None):
    """Record one launch made by tests/runs.py (config: what it ran) around the code that makes it."""
    record = {"test": current_test(), "kind": kind, "config": config, "key": fingerprint([kind, config]),
              "shared": shared, "started": time.time(), "seconds": None}
    RECORDS.append(record)
    t0 = time.monotonic()
    _OWN.inside = True
    try:
        yield record
    finally:
        _OWN.inside = False
        record["seconds"] = round(time.monotonic() - t0, 2)


def requested(name: str) -> None:
    REQUESTS.append({"test": current_test(), "name": name})


def describe_ds_config(ds_config) -> str:
    """ZeRO stage, bf16 and the nshard section, then a fingerprint of the whole ds_config (two that differ elsewhere
    read alike but for it)."""
    if not isinstance(ds_config, dict):
        try:
            ds_config = json.loads(Path(ds_config).read_text())
        except (OSError, ValueError):
            return f"ds_config {describe_argv([ds_config])}"
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    words = [f"ZeRO-{stage}" if stage else "stage 0"]
    if (ds_config.get("bf16") or {}).get("enabled"):
        words.append("bf16")
    section = ds_config.get("nshard")
    if section:
        short = {"reducer": "", "rank": "r", "dense_warmup_updates": "warm-up ", "parameter_sync": "sync ",
                 "transport": "", "overlap_backward": "overlap "}
        words.append("nshard " + " ".join(f"{short.get(k, k + '=')}{v}" for k, v in section.items()
                                          if k in short or k not in POWERSGD_DEFAULTS or POWERSGD_DEFAULTS[k] != v))
    else:
        words.append("DeepSpeed's reduction")
    return " ".join(words) + f" [{fingerprint(ds_config)}]"


POWERSGD_DEFAULTS = {"min_compression_rate": 2, "error_feedback": "device", "warm_start": True, "seed": 0}
"""nshard-section keys the tests' configurations share: left out of the table's summary (the fingerprint keeps them)."""


def describe_plan(plan) -> str:
    path = Path(plan)
    try:
        text = path.read_text()
    except OSError:
        return str(plan)
    if REPO in path.resolve().parents:
        return str(path.resolve().relative_to(REPO))
    return f"{path.name} [{fingerprint(text)}]"


def describe_launch(ds_config, world: int, plan, env: dict | None, extra_args, mpi: bool = False,
                    cuda: bool = False) -> dict:
    """What runs.launch ran: the table's configuration (the output directory left out)."""
    described = {"world": world, "ds_config": describe_ds_config(ds_config), "plan": describe_plan(plan),
                 "env": {k: v for k, v in (env or {}).items() if not k.startswith(("WANDB", "AWS"))},
                 "args": [describe_argv([a]) for a in extra_args]}
    if mpi or cuda:
        described["args"].append("mpirun" if mpi else "cuda")
    return described


# ---------------------------------------------------------------- processes the tests start themselves

LAUNCH_SCRIPTS = re.compile(r"(^|/)launch/(demo|run|study|gpu_check|capped)\.sh$")


def classify(argv: list[str]) -> str | None:
    """The kind of launch a command is, or None for a command that launches nothing (git, a CLI that reads files)."""
    words = [str(w) for w in argv]
    if not words:
        return None
    head = Path(words[0]).name
    if head == "deepspeed":
        return "deepspeed"
    if head in ("torchrun", "mpirun", "mpiexec"):
        return "mpirun" if head == "mpiexec" else head
    if head in ("nshard-train",):
        return "train"
    if head == "nshard-study":
        return "study"
    if head in ("bash", "sh") and len(words) > 1 and LAUNCH_SCRIPTS.search(words[1]):
        return "study" if words[1].endswith("study.sh") else "script"
    if not head.startswith("python"):
        return None
    rest = [w for w in words[1:] if w != "-u"]
    if rest[:1] == ["-m"] and len(rest) > 1:
        module = rest[1]
        if module in ("nshard.study", "nshard.study.runner"):
            return "study"
        if module == "nshard.train":
            return "train"
        if module.startswith("launch.") and module != "launch.mutants":
            return "script"
        return None
    if rest and rest[0].endswith("nshard/train.py"):
        return "train"
    if rest and re.search(r"(^|/)launch/\w+\.py$", rest[0]) and not rest[0].endswith("mutants.py"):
        return "script"
    return None


def describe_argv(argv: list[str]) -> str:
    """The command with this session's temporary paths shortened, so that the same command in two tests reads alike."""
    text = " ".join(str(w) for w in argv)
    text = text.replace(str(REPO) + "/", "").replace(sys.executable, "python")
    text = re.sub(r"/tmp/pytest-of-[^/]+/pytest-\d+/(popen-gw\d+/)?[^/ ]+?\d*(?=/| |$)", "<tmp>", text)
    return re.sub(r"--master_port \d+", "--master_port N", text)


def _watch_popen() -> None:
    """Record the processes the tests start that launch (classify); their seconds end when their exit is seen."""
    popen = subprocess.Popen
    if getattr(popen, "_nshard_watched", False):
        return
    init, handle_exit = popen.__init__, popen._handle_exitstatus

    def watched_init(self, args, *a, **kw):
        init(self, args, *a, **kw)
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        kind = None if getattr(_OWN, "inside", False) else classify(argv)
        if kind:
            command = describe_argv(argv)
            self._nshard_record = {"test": current_test(), "kind": kind, "config": {"command": command},
                                   "key": fingerprint([kind, command]), "shared": None, "started": time.time(),
                                   "seconds": None, "_t0": time.monotonic()}
            RECORDS.append(self._nshard_record)

    def watched_exit(self, *a, **kw):
        out = handle_exit(self, *a, **kw)
        record = getattr(self, "_nshard_record", None)
        if record is not None and record["seconds"] is None:
            record["seconds"] = round(time.monotonic() - record.pop("_t0"), 2)
        return out

    popen.__init__, popen._handle_exitstatus, popen._nshard_watched = watched_init, watched_exit, True


# ---------------------------------------------------------------- the table

def budget_counts(records: list[dict], requests: list[dict]) -> dict[str, int]:
    """Per test file, the launches its tests made themselves; SHARED: the distinct shared runs. Neither depends on
    which worker got to a shared run first, and running part of the suite never counts more than the whole."""
    counts: collections.Counter = collections.Counter()
    for r in records:
        if not r["shared"]:
            counts[file_of(r["test"])] += 1
    names = {q["name"] for q in requests} | {r["shared"] for r in records if r["shared"]}
    if names:
        counts[SHARED] = len(names)
    return dict(counts)


def file_of(test: str | None) -> str:
    return (test or "(outside a test)").split("::")[0].removeprefix("tests/")


def rows(records: list[dict]) -> list[dict]:
    """One row per configuration: how many launches, by which tests, their seconds."""
    by_key: dict[str, dict] = {}
    for r in records:
        row = by_key.setdefault(r["key"], {"kind": r["kind"], "config": r["config"], "seconds": [], "tests": [],
                                           "shared": r["shared"]})
        row["seconds"].append(r["seconds"])
        if r["test"] not in row["tests"]:
            row["tests"].append(r["test"])
    return sorted(by_key.values(), key=lambda row: -sum(s or 0 for s in row["seconds"]))


def summary(config: dict) -> str:
    """A configuration in a table cell."""
    if "command" in config:
        return f"`{config['command'][:160]}`"
    parts = [f"{config['world']} rank{'s' * (config['world'] != 1)}", config["ds_config"]]
    parts.append(f"plan {config['plan']}")
    parts += [f"{k}={v}" for k, v in sorted(config.get("env", {}).items())]
    parts += config.get("args", [])
    return ", ".join(parts)


def table(records: list[dict], requests: list[dict], note: str = "") -> str:
    by_kind = collections.Counter(r["kind"] for r in records)
    seconds = sum(r["seconds"] or 0 for r in records)
    out = [f"{len(records)} launches ({', '.join(f'{k} {n}' for k, n in by_kind.most_common())}), "
           f"{seconds:,.0f} s in all{note}; {len(rows(records))} configurations.", "",
           "| configuration | kind | launches | seconds (sum / median) | tests |", "|---|---|---|---|---|"]
    for row in rows(records):
        secs = [s for s in row["seconds"] if s is not None]
        tests = sorted({t.split("[")[0].removeprefix("tests/") if t else "(outside a test)" for t in row["tests"]})
        shown = ", ".join(tests[:3]) + (f" and {len(tests) - 3} more" if len(tests) > 3 else "")
        name = f" (shared `{row['shared']}`)" if row["shared"] else ""
        out.append(f"| {summary(row['config'])}{name} | {row['kind']} | {len(row['seconds'])} | "
                   f"{sum(secs):.0f} / {statistics.median(secs) if secs else 0:.1f} | {shown} |")
    counts = budget_counts(records, requests)
    out += ["", "| test file | launches of its own |", "|---|---|"]
    out += [f"| {name} | {n} |" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- the budget

def read_budget(path: Path = BUDGET_FILE) -> dict[str, int]:
    budget = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, count = line.rpartition(" ")
        if not name.strip() or not count.isdigit():
            raise ValueError(f"{path}:{number}: {line!r}: write `FILE COUNT` (e.g. `test_resume.py 14`)")
        budget[name.strip()] = int(count)
    return budget


def over_budget(records: list[dict], requests: list[dict], budget: dict[str, int]) -> str | None:
    """One line naming the test files (and their tests) that launched beyond the budget, or None."""
    counts = budget_counts(records, requests)
    over = {name: n for name, n in counts.items() if n > budget.get(name, 0)}
    if not over:
        return None
    parts = []
    for name, n in sorted(over.items()):
        if name == SHARED:
            firsts: dict[str, str] = {}
            for q in requests:
                firsts.setdefault(q["name"], q["test"])
            who = sorted({t for t in firsts.values() if t})
        else:
            per_test = collections.Counter(r["test"] for r in records if not r["shared"] and file_of(r["test"]) == name)
            who = [f"{t.split('::', 1)[-1]} {k}" for t, k in per_test.most_common()]
        parts.append(f"{name} {n} > {budget.get(name, 0)} ({', '.join(who)})")
    total, allowed = sum(counts.values()), sum(budget.values())
    return (f"launch budget: {'; '.join(parts)}. The suite launched {total} (budget {allowed}): reuse a launched run "
            f"(tests/runs.py cached_run) or raise the line in {BUDGET_FILE.relative_to(REPO)} in a reviewed commit")


# ---------------------------------------------------------------- pytest hooks (tests/conftest.py loads this module)

class Plugin:
    def __init__(self, config):
        self.config = config
        self.workers: list[dict] = []
        self.message: str | None = None
        _watch_popen()

    def pytest_runtest_protocol(self, item):
        _TEST[0] = item.nodeid
        return None

    def pytest_runtest_logfinish(self, nodeid):
        _TEST[0] = None

    def pytest_testnodedown(self, node, error):  # xdist controller: a worker's records
        data = getattr(node, "workeroutput", {}).get("nshard_launches")
        if data:
            self.workers.append(json.loads(data))

    @staticmethod
    def mine() -> dict:
        return {"records": [{k: v for k, v in r.items() if not k.startswith("_")} for r in RECORDS],
                "requests": REQUESTS}

    def pytest_sessionfinish(self, session):
        if hasattr(self.config, "workeroutput"):  # an xdist worker: the controller writes and checks
            self.config.workeroutput["nshard_launches"] = json.dumps(self.mine())
            return
        parts = self.workers or [self.mine()]
        records = sorted((r for p in parts for r in p["records"]), key=lambda r: r["started"])
        requests = [q for p in parts for q in p["requests"]]
        path = os.environ.get(INVENTORY_VARIABLE)
        if path:
            write_inventory(Path(path), records, requests)
        self.message = over_budget(records, requests, read_budget())
        if self.message and session.exitstatus == 0:
            session.exitstatus = 1

    def pytest_terminal_summary(self, terminalreporter):
        if self.message:
            terminalreporter.write_line(self.message, red=True, bold=True)


def write_inventory(path: Path, records: list[dict], requests: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"records": records, "requests": requests, "budget": budget_counts(records, requests)}
    for target, text in ((path.with_suffix(".json"), json.dumps(body, indent=1) + "\n"), (path, table(records, requests))):
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(target)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="The launch table (or the budget lines) from a session's records.")
    parser.add_argument("records", type=Path, help="the FILE.json a session wrote with NSHARD_LAUNCH_INVENTORY=FILE.md")
    parser.add_argument("--budget", action="store_true", help="print the counts as tests/launch_budget.txt lines")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    body = json.loads(args.records.read_text())
    if args.budget:
        counts = budget_counts(body["records"], body["requests"])
        print("\n".join(f"{name} {n}" for name, n in sorted(counts.items())))
    else:
        print(table(body["records"], body["requests"]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
