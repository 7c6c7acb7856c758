"""The export manifest: what model/ holds (per-file SHA-256) and what made it (run hashes, source commit)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from nshard.files import file_sha256, first_difference, make_readable

MANIFEST = "manifest.json"
FORMAT = "nshard-export/1"
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


def _file_table(model_dir: Path) -> dict:
    files = {}
    for path in sorted(Path(model_dir).rglob("*")):
        rel = path.relative_to(model_dir).as_posix()
        if rel != MANIFEST and path.is_file() and not path.is_symlink():
            files[rel] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    return files


def write_manifest(model_dir: Path, *, parameter_root: str, plan_sha256: str, ds_config_sha256: str,
                   prepared_identity: str) -> dict:
    """Seal an export directory before it is published: readable modes, then manifest.json over every file."""
    model_dir = Path(model_dir)
    make_readable(model_dir)
    body = {"format": FORMAT, "files": _file_table(model_dir), "parameter_root": parameter_root,
            "plan_sha256": plan_sha256, "ds_config_sha256": ds_config_sha256,
            "prepared_identity": prepared_identity, "source": source_commit()}
    path = model_dir / MANIFEST
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    os.chmod(path, 0o644)
    return body


def verify_manifest(model_dir: Path) -> dict:
    """Re-hash every file; raise ManifestError naming the first missing, extra or changed file."""
    model_dir = Path(model_dir)
    try:
        body = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{model_dir / MANIFEST}: unreadable manifest ({exc})") from None
    if body.get("format") != FORMAT:
        raise ManifestError(f"{model_dir / MANIFEST}: format {body.get('format')!r}, expected {FORMAT!r}")
    found = _file_table(model_dir)
    difference = first_difference(body["files"], found)
    if difference is not None:
        kind, rel = difference
        if kind == "missing":
            raise ManifestError(f"{rel}: listed in the manifest but missing")
        if kind == "extra":
            raise ManifestError(f"{rel}: present but not in the manifest")
        raise ManifestError(f"{rel}: sha256 {found[rel]['sha256']}, manifest says {body['files'][rel]['sha256']}")
    return body
