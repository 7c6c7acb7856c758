"""The export manifest: what model/ holds (every entry by kind; files by SHA-256) and what made it (run hashes,
source commit)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

from nshard.files import file_sha256, first_difference, make_readable

MANIFEST = "manifest.json"
GROWN = "nshard-grown.json"
"""A grown export's record beside its weights (nshard/grow.py): how it was grown, readable without nshard."""
FORMAT = "nshard-export/2"
FORMAT_1 = "nshard-export/1"
"""The earlier format listed regular files only; still verified, every other entry but their folders being extra."""
REPO = Path(__file__).resolve().parents[2]


class ManifestError(RuntimeError):
    """An exported directory that does not match its manifest; the message names the file."""


def source_commit(repo: Path = REPO) -> dict:
    """The commit the code was loaded from and whether tracked or new files differ from it (None outside git)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)

    try:
        head = git("rev-parse", "--verify", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        status = git("status", "--porcelain", "--untracked-files=normal")
    except (OSError, subprocess.TimeoutExpired):  # no git on this host, or a hung repository
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def entry_kind(path: Path) -> str:
    """file, dir, symlink, fifo, socket or device: the entry itself, never what a link points to."""
    mode = path.lstat().st_mode
    for kind, test in (("file", stat.S_ISREG), ("dir", stat.S_ISDIR), ("symlink", stat.S_ISLNK),
                       ("fifo", stat.S_ISFIFO), ("socket", stat.S_ISSOCK)):
        if test(mode):
            return kind
    return "device"


def entry_table(model_dir: Path) -> dict:
    """Every entry under model_dir but the manifest: a file by sha256 and bytes, anything else by kind alone
    (a FIFO or device is never opened)."""
    entries = {}
    for path in sorted(Path(model_dir).rglob("*")):  # rglob lists links, never follows them into folders
        rel = path.relative_to(model_dir).as_posix()
        if rel == MANIFEST:
            continue
        kind = entry_kind(path)
        entries[rel] = ({"kind": kind, "sha256": file_sha256(path), "bytes": path.stat().st_size}
                        if kind == "file" else {"kind": kind})
    return entries


def _listed_entries(body: dict) -> dict:
    """The manifest's entries; an nshard-export/1 manifest listed files only, so their folders are implied."""
    if body.get("format") == FORMAT:
        return body["entries"]
    files = {rel: {"kind": "file", **entry} for rel, entry in body["files"].items()}
    folders = {parent.as_posix(): {"kind": "dir"} for rel in files for parent in Path(rel).parents if parent != Path(".")}
    return {**folders, **files}


def write_manifest(model_dir: Path, *, parameter_root: str, plan_sha256: str | None, ds_config_sha256: str | None,
                   prepared_identity: str | None, weights: dict | None = None, grown: dict | None = None) -> dict:
    """Seal an export directory before it is published: manifest.json over every entry, then readable modes.
    A link or special file is refused: an export holds files and folders only. A grown export (nshard/grow.py) was
    not trained: its plan, ds_config and prepared identity are None and `grown` names its source and method."""
    model_dir = Path(model_dir)
    entries = entry_table(model_dir)
    odd = [f"{rel} ({e['kind']})" for rel, e in entries.items() if e["kind"] not in ("file", "dir")]
    if odd:
        raise ManifestError(f"{model_dir}: {', '.join(odd)} cannot be exported (only files and folders are); "
                            "remove it or copy what it points to")
    make_readable(model_dir)
    body = {"format": FORMAT, "entries": entries, "parameter_root": parameter_root,
            "plan_sha256": plan_sha256, "ds_config_sha256": ds_config_sha256,
            "prepared_identity": prepared_identity, "source": source_commit()}
    if weights is not None:  # what the weights are when they are not the replicas that parameter_root hashes
        body["weights"] = weights
    if grown is not None:
        body["grown"] = grown
    path = model_dir / MANIFEST
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    os.chmod(path, 0o644)
    return body


def verify_manifest(model_dir: Path) -> dict:
    """Re-list every entry and re-hash every file; raise ManifestError naming the first entry that is missing,
    extra, of another kind, or changed."""
    model_dir = Path(model_dir)
    path = model_dir / MANIFEST
    try:
        if path.is_symlink():
            raise OSError("it is a symlink, not the file the export wrote")
        body = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: unreadable manifest ({exc})") from None
    if body.get("format") not in (FORMAT, FORMAT_1):
        raise ManifestError(f"{path}: format {body.get('format')!r}, expected {FORMAT!r}")
    listed, found = _listed_entries(body), entry_table(model_dir)
    difference = first_difference(listed, found)
    if difference is not None:
        problem, rel = difference
        if problem == "missing":
            raise ManifestError(f"{rel}: listed in the manifest ({listed[rel]['kind']}) but missing")
        if problem == "extra":
            raise ManifestError(f"{rel}: a {found[rel]['kind']} present but not in the manifest")
        if found[rel]["kind"] != listed[rel]["kind"]:
            raise ManifestError(f"{rel}: a {found[rel]['kind']}, the manifest says {listed[rel]['kind']}")
        raise ManifestError(f"{rel}: sha256 {found[rel]['sha256']}, manifest says {listed[rel]['sha256']}")
    return body
