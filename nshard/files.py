"""Small file mechanics with one home: durable atomic writes (atomic_file and its JSON, JSONL, text and bytes
forms), file hashing, staged publishing of a directory, the missing/extra/mismatch check of a listing, and the
cache root."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO

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


CRASH_POINT: Callable[[str, Path], None] | None = None
"""Called as CRASH_POINT(stage, path) at "written" (the temp file whole and fsynced, before the rename) and
"replaced" (after the rename, before the directory's fsync); None in every run. tests/test_files.py stops a
writer there and kills it."""


def fsync_dir(folder: Path) -> None:
    """Make a rename (or link) inside `folder` survive a crash: fsync the directory itself."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO]:
    """A file to write `path` through: a temp file beside it with a name no other writer takes
    (`.NAME.PID.RANDOM.tmp`, created exclusively), fsynced when the block ends, renamed over `path` with
    os.replace, then the directory fsynced. Readers, and a crash at any point, see the old file or the whole new
    one; an error in the block removes the temp file and leaves `path` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:  # 0o666 less the umask, as a plain open would make it (mkstemp would make it 0600)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if CRASH_POINT:
            CRASH_POINT("written", path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if CRASH_POINT:
        CRASH_POINT("replaced", path)
    fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path, "wb") as f:
        f.write(data)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


def write_json_atomic(path: Path, obj) -> None:
    """JSON (indent 1, sorted keys) through atomic_file."""
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def write_jsonl_atomic(path: Path, rows: Iterable[dict]) -> None:
    """One JSON object per line through atomic_file."""
    with atomic_file(path) as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def rename_durably(tmp: Path, dest: Path) -> None:
    """Publish a directory filled beside `dest`: one rename, then the parent fsynced so the rename holds. The files
    inside are not fsynced one by one: every directory published this way is checked by its hashes where it is
    read (the export and state manifests, the model cache's marker, the store's keys, an archive's listing)."""
    os.rename(tmp, dest)
    fsync_dir(Path(dest).parent)


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
        rename_durably(tmp, dest)
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
