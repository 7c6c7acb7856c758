"""Small file mechanics with one home: atomic JSON and JSONL writes, file hashing, staged publishing of a
directory, the missing/extra/mismatch check of a listing, and the cache root."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

CHUNK = 1 << 20
"""Bytes read at a time when hashing or streaming a file (model weights are gigabytes)."""


def cache_root() -> Path:
    """$NSHARD_CACHE, else ~/.cache/nshard: converted models, replay answers."""
    return Path(os.environ.get("NSHARD_CACHE") or Path.home() / ".cache" / "nshard")


ONE_TIME_WORK: list[str] = []
"""What this process filled a shared cache with (a model converted, replay answers generated, DeepSpeed's CPU
collective compiled): work the first run on a machine pays and later runs skip. The receipts carry it, so a
study can show that no timed arm paid for what the others reused."""


def note_one_time_work(what: str) -> None:
    ONE_TIME_WORK.append(what)


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temp file beside `path`, then rename: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def write_text_atomic(path: Path, text: str) -> None:
    """Text into a temp file beside `path`, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_jsonl_atomic(path: Path, rows: Iterable[dict]) -> None:
    """One JSON object per line into a temp file beside `path` (named by this process, so concurrent writers of
    the same file never share one), then rename: readers see the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


def make_readable(root: Path) -> None:
    """0755 directories and 0644 files under `root` (save_pretrained and mkstemp leave files 0600)."""
    os.chmod(root, 0o755)
    for path in Path(root).rglob("*"):
        if not path.is_symlink():
            os.chmod(path, 0o755 if path.is_dir() else 0o644)


@contextlib.contextmanager
def staged_dir(dest: Path, stage: str) -> Iterator[Path]:
    """A fresh temp directory beside `dest` (`.<dest>.<stage>-*`) to fill; when the block ends it becomes
    readable by others and takes dest's name in one rename, so dest appears whole or not at all. An error
    in the block (or in the rename) removes it."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.{stage}-"))
    try:
        yield tmp
        make_readable(tmp)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def file_chunks(path: str | Path) -> Iterator[bytes]:
    """A file's bytes, CHUNK at a time."""
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(CHUNK), b"")


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    for chunk in file_chunks(path):
        h.update(chunk)
    return h.hexdigest()


def first_difference(expected: Mapping, found: Mapping) -> tuple[str, str] | None:
    """The first key, in sorted order, where two listings (path -> hash, say) disagree: ("missing", key) when
    `found` lacks it, ("extra", key) when `expected` does, ("mismatch", key) when their values differ; None when
    they agree. Callers name the problem in their own words."""
    for key in sorted(set(expected) | set(found)):
        if key not in found:
            return "missing", key
        if key not in expected:
            return "extra", key
        if found[key] != expected[key]:
            return "mismatch", key
    return None
