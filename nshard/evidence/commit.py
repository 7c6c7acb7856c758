"""Commit-before-score: one record that names every candidate of a study before any of them is scored.

    python -m nshard.evidence.commit OUT.json --seed SEED_MODEL_DIR --arm NAME=RUN_DIR [--arm NAME=RUN_DIR ...]

For each candidate the record holds its exported model's per-file SHA-256, its parameter root,
the plan and ds_config hashes, the prepared identity and the source commit; the record's own
SHA-256 covers all of it. `nshard.study.evaluate` refuses a model that no record names.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
from nshard.evidence.export import ManifestError, entry_kind, source_commit, verify_manifest
from nshard.files import file_sha256, write_json_atomic


class CommitError(RuntimeError):
    """A candidate that cannot be committed, or a record that does not hold; the message says which."""


def model_files(model_dir: Path) -> dict[str, str]:
    """SHA-256 of every file under a model directory, by relative path. A link to a file counts as that file
    (a hub snapshot links its files into a blob store: the bytes that load are what is bound); any other
    entry but a folder (a FIFO, a dangling link, a link to a folder) is refused, since it would go unbound."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CommitError(f"model directory {model_dir} does not exist")
    paths = sorted(model_dir.rglob("*"))
    odd = [p for p in paths if not p.is_file() and (p.is_symlink() or not p.is_dir())]
    if odd:
        raise CommitError(f"model directory {model_dir}: {odd[0].relative_to(model_dir)} is a "
                          f"{entry_kind(odd[0])}, neither a file nor a folder; remove it")
    files = {str(p.relative_to(model_dir)): file_sha256(p) for p in paths if p.is_file()}
    if not files:
        raise CommitError(f"model directory {model_dir} holds no files")
    return files


def candidate_entry(name: str, run_dir: Path) -> dict:
    """What binds one trained arm: its finished run's hashes and its exported model's files."""
    run_dir = Path(run_dir)
    run_json = run_dir / "run.json"
    if not run_json.is_file():
        raise CommitError(f"candidate {name}: {run_json} does not exist; train the arm first")
    run = json.loads(run_json.read_text())
    if run.get("status") != "complete":
        raise CommitError(f"candidate {name}: {run_json} says status={run.get('status')!r}, not complete; "
                          "only finished runs can be committed")
    roots = {json.loads(p.read_text())["parameter_root"] for p in sorted((run_dir / "receipts").glob("rank-*.json"))}
    if run.get("interpolated"):  # made, not trained (nshard/study/derived.py): no rank, so no receipt; its manifest
        roots = {verify_manifest(run_dir / "model")["parameter_root"]}  # and run.json must name one root
    if roots != {run["parameter_root"]}:
        raise CommitError(f"candidate {name}: the receipts' parameter roots {sorted(roots)} differ from run.json's")
    try:  # the export must still be what the trainer sealed
        verify_manifest(run_dir / "model")
    except ManifestError as exc:
        raise CommitError(f"candidate {name}: {run_dir / 'model'} does not match its manifest: {exc}") from None
    return {"name": name, "run_dir": str(run_dir), "model_dir": str(run_dir / "model"),
            "files": model_files(run_dir / "model"), "parameter_root": run["parameter_root"],
            "plan_sha256": run["plan_sha256"], "ds_config_sha256": run["ds_config_sha256"],
            "prepared_identity": run["prepared_identity"], "world_size": run["world_size"],
            "replay": run.get("replay", True),
            "zero_stage": run.get("zero_stage"), "reducer": run.get("reducer"),
            **({"interpolated": run["interpolated"]} if run.get("interpolated") else {}),
            **({"budget": run["budget"]} if run.get("budget") else {})}


def files_sha256(files: dict[str, str]) -> str:
    """One hash for a model's file listing (relative path -> sha256), as a record holds it: a provenance chain names
    a committed model by it."""
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def record_sha256(body: dict) -> str:
    canonical = json.dumps({k: v for k, v in body.items() if k != "record_sha256"}, sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def build_commitment(seed_dir: Path, arms: dict[str, Path]) -> dict:
    """One record for all candidates together; they must share one prepared identity, but for arms trained without
    replay (a no-replay control), whose inputs differ by design."""
    candidates = [candidate_entry(name, run_dir) for name, run_dir in arms.items()]
    identities = {c["prepared_identity"] for c in candidates if c["replay"]} or {c["prepared_identity"]
                                                                               for c in candidates}
    if len(identities) > 1 and all(c.get("budget") for c in candidates):
        identities = {budget_cut_identity(candidates)}
    if len(identities) != 1:
        raise CommitError(f"the candidates were trained on different prepared inputs {sorted(identities)}; "
                          "a study compares arms of one plan")
    body = {"kind": "nshard-commitment", "version": 1,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "source": source_commit(), "prepared_identity": identities.pop(),
            "seed": {"name": "seed", "model_dir": str(seed_dir), "files": model_files(seed_dir)},
            "candidates": candidates}
    body["record_sha256"] = record_sha256(body)
    return body


def budget_cut_identity(candidates: list[dict]) -> str:
    """A growth study's arms (each with a training budget) train the same documents and sets, each the part of one
    schedule its budget buys: their schedules are prefixes of the longest. The longest arm's identity, else
    CommitError naming what differs."""
    def prepared(c, name):
        return (Path(c["run_dir"]) / "prepared" / name).read_bytes()

    longest = max(candidates, key=lambda c: len(json.loads(prepared(c, "schedule.json"))))
    full = json.loads(prepared(longest, "schedule.json"))
    for c in candidates:
        schedule = json.loads(prepared(c, "schedule.json"))
        same = all(prepared(c, f) == prepared(longest, f) for f in ("documents.jsonl", "sets.json"))
        if not same or schedule != full[:len(schedule)]:
            raise CommitError(f"the candidates {c['name']} and {longest['name']} were trained on different prepared "
                              "inputs: under one budget the arms train the same documents and sets, each a prefix of "
                              "one schedule; a study compares arms of one plan")
    return longest["prepared_identity"]


def write_commitment(path: Path, seed_dir: Path, arms: dict[str, Path]) -> dict:
    body = build_commitment(seed_dir, arms)
    write_json_atomic(path, body)
    return body


def load_commitment(path: Path) -> dict:
    """Read a record and check its own hash: an edited record is refused."""
    path = Path(path)
    if not path.is_file():
        raise CommitError(f"commitment {path} does not exist; run python -m nshard.evidence.commit first")
    try:
        body = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CommitError(f"commitment {path} is not JSON ({exc.msg})") from None
    if body.get("kind") != "nshard-commitment" or "record_sha256" not in body:
        raise CommitError(f"{path} is not an nshard commitment record")
    if record_sha256(body) != body["record_sha256"]:
        raise CommitError(f"commitment {path} was changed after it was written (its record_sha256 does not "
                          "match its contents); commit again")
    return body


def check_committed_as(record: dict, label: str, files: dict[str, str]) -> None:
    """A score counts only under the name the record gives exactly these files: `label` must name an entry
    of the record (the seed or a candidate) whose files are these; anything else is a CommitError."""
    entries = {e["name"]: e for e in [record["seed"], *record["candidates"]]}
    entry = entries.get(label)
    if entry is not None and entry["files"] == files:
        return
    named = committed_name(record, files)
    why = (f"the record commits these files as {named!r}, not {label!r}; score it under --label {named}"
           if named is not None else "the record names no model with these files")
    raise CommitError(f"{label}: commitment {record['record_sha256'][:12]} does not commit this model as "
                      f"{label!r}: {why}")


def committed_name(record: dict, files: dict[str, str]) -> str | None:
    """The name under which the record commits a model with exactly these files, or None."""
    for entry in [record["seed"], *record["candidates"]]:
        if entry["files"] == files:
            return entry["name"]
    return None


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes OUT (the commitment record, JSON, written atomically) and prints one JSON line: its path, "
              "record_sha256 and the candidates' names. " + SPELLING_NOTE)
    parser = ArgumentParser(prog=prog("nshard.evidence.commit"), description=__doc__, epilog=epilog)
    parser.add_argument("out", type=Path, help="commitment record to write (JSON)")
    parser.add_argument("--seed", required=True, type=Path, help="the untrained model's directory")
    parser.add_argument("--arm", action="append", default=[], metavar="NAME=RUN_DIR", help="a finished arm")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    arms = {}
    for item in args.arm:
        name, sep, run_dir = item.partition("=")
        if not sep or not name or not run_dir:
            print(f"nshard.commit: error: --arm {item!r} must be NAME=RUN_DIR", file=sys.stderr)
            return 2
        arms[name] = Path(run_dir)
    if not arms:
        print("nshard.commit: error: name at least one --arm NAME=RUN_DIR", file=sys.stderr)
        return 2
    try:
        body = write_commitment(args.out, args.seed, arms)
    except (CommitError, OSError) as exc:
        print(f"nshard.commit: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"commitment": str(args.out), "record_sha256": body["record_sha256"],
                      "candidates": [c["name"] for c in body["candidates"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
