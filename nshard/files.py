"""Small file helpers with one home: atomic JSON writes, file hashes, the cache root."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_root() -> Path:
    """$NSHARD_CACHE, else ~/.cache/nshard: converted models, replay answers."""
    return Path(os.environ.get("NSHARD_CACHE") or Path.home() / ".cache" / "nshard")


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temp file beside `path`, then rename: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def make_readable(root: Path) -> None:
    """0755 directories and 0644 files under `root` (save_pretrained and mkstemp leave files 0600)."""
    os.chmod(root, 0o755)
    for path in Path(root).rglob("*"):
        if not path.is_symlink():
            os.chmod(path, 0o755 if path.is_dir() else 0o644)


def publish_dir(tmp: Path, dest: Path) -> None:
    """A finished temp directory becomes readable by others and takes its final name in one rename."""
    make_readable(tmp)
    Path(tmp).rename(dest)


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks (model weights are gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
