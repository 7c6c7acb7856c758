"""Content-addressed storage of a directory: objects named by their SHA-256, in a local directory or on S3.

    python -m nshard.evidence.store push SRC URI      # SRC: a directory (or one file); URI: a directory or s3://bucket/prefix
    python -m nshard.evidence.store verify URI        # re-read every object; exit 1 naming any that does not match
    python -m nshard.evidence.store pull URI DEST     # rebuild the tree, hashes checked as it is written

Layout under URI: `objects/sha256/<2 hex>/<sha256>` for each file's bytes, and `index.json` (relative path ->
sha256, bytes), written last, only once every object has been read back and matched. Every write is
conditional (S3: If-None-Match; local: link), so a key is never replaced and of two pushes of different trees to
one URI exactly one writes its index; a write whose read-back does not match is removed again. S3 is configured
only as AWS tools are (AWS_ENDPOINT_URL, AWS_PROFILE, the standard credential chain); nshard never takes, prints
or logs credentials.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path, PurePosixPath
from typing import Iterator

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
from nshard.evidence.backend import Backend, BadInput, FileSink, MemorySink, Sink, StoreError, hash_into
from nshard.files import file_chunks, file_sha256, fsync_dir, staged_dir

INDEX = "index.json"
INDEX_FORMAT = "nshard-store/1"


def object_key(sha256: str) -> str:
    return f"objects/sha256/{sha256[:2]}/{sha256}"


def read_sha256(backend: Backend, key: str) -> str:
    return backend.read_to(key, Sink())


class LocalBackend:
    """A directory; every write is temp file + fsync + link, so a key appears whole and is never replaced."""

    def __init__(self, root: Path):
        self.root, self.uri = Path(root), str(root)
        self.written: dict[str, int] = {}  # key -> inode of each file this backend linked: delete() needs it

    def check(self, writing: bool) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise BadInput(f"{self.root} is not a directory")
        if not writing and not self.root.is_dir():
            raise BadInput(f"{self.root}: no such store directory")

    def size(self, key: str) -> int | None:
        path = self.root / key
        return path.stat().st_size if path.is_file() else None

    def put(self, key: str, source: Path | bytes, sha256: str) -> bool:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".put-")
        try:
            with os.fdopen(fd, "wb") as out:
                chunks = [source] if isinstance(source, bytes) else file_chunks(source)
                written = hash_into(chunks, FileSink(out))
                out.flush()
                os.fsync(out.fileno())
                os.fchmod(out.fileno(), 0o644)
            if written != sha256:
                raise StoreError(f"{key}: source changed while it was stored (sha256 {written}, expected {sha256})")
            try:
                os.link(tmp, path)  # unlike rename, link refuses an existing name: no key is ever replaced
            except FileExistsError:
                return False  # another writer got there first; the caller reads the key back either way
            fsync_dir(path.parent)
            self.written[key] = path.stat().st_ino
            return True
        finally:
            os.unlink(tmp)

    def delete(self, key: str) -> None:
        """Remove a file this backend linked, and only while it is still that file."""
        path = self.root / key
        if self.written.pop(key, None) != path.stat().st_ino:
            raise StoreError(f"{path} was not written by this push; it is never deleted")
        path.unlink()

    def read_to(self, key: str, sink: Sink) -> str:
        return hash_into(file_chunks(self.root / key), sink)

    def last_modified(self, key: str) -> tuple[str, str]:
        mtime = (self.root / key).stat().st_mtime
        return datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).isoformat(), "local"

    def keys(self, prefix: str) -> Iterator[str]:
        base = self.root / prefix
        for path in sorted(base.rglob("*")) if base.is_dir() else []:
            if path.is_file() and not path.name.startswith(".put-"):
                yield path.relative_to(self.root).as_posix()


def open_backend(uri: str) -> Backend:
    if uri.startswith("s3://"):
        from nshard.evidence.store_s3 import S3Backend

        return S3Backend(uri)
    if "://" in uri:
        raise BadInput(f"unsupported URI {uri!r}: use a local directory or s3://bucket/prefix")
    return LocalBackend(Path(uri))


def put_verified(backend: Backend, key: str, source: Path | bytes, sha256: str, taken: str = "") -> bool:
    """Store source under key unless it is already there; done only once a full read-back matches. True if written.
    A read-back that does not match removes what this call wrote, so pushing again can succeed. A key that
    someone else wrote (before, or racing this call) with other bytes is never touched: the error is `taken`
    (with {found} replaced) or names the key."""
    created = backend.size(key) is None and backend.put(key, source, sha256)  # put itself refuses an existing key
    found = read_sha256(backend, key)
    if found == sha256:
        return created
    if created:
        backend.delete(key)
        raise StoreError(f"read-back of {backend.uri}/{key}: sha256 {found}, uploaded {sha256}; "
                         "what was written is removed again: push again")
    raise StoreError(taken.replace("{found}", found) or f"{backend.uri}/{key} already exists with sha256 {found}, not "
                     f"{sha256}; it is never overwritten: check it and remove it by hand")


def source_files(src: Path) -> dict[str, Path]:
    """Relative POSIX path -> file, for a directory tree (or one file); links and special files are refused."""
    if not src.exists():
        raise BadInput(f"{src}: no such file or directory")
    if src.is_file() and not src.is_symlink():
        return {src.name: src}
    files = {}
    for path in sorted(src.rglob("*")):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise BadInput(f"{path}: links and special files are not stored; copy the target in instead")
        if path.is_file():
            files[path.relative_to(src).as_posix()] = path
    if not files:
        raise BadInput(f"{src}: no files to push")
    return files


def index_bytes(entries: dict) -> bytes:
    return (json.dumps({"format": INDEX_FORMAT, "files": entries}, indent=1, sort_keys=True) + "\n").encode()


def push(src: Path, backend: Backend) -> dict:
    return push_files(source_files(Path(src)), backend)


def push_files(files: dict[str, Path], backend: Backend) -> dict:
    """Store each file (relative POSIX path -> file) as an object, then the index naming them all."""
    backend.check(writing=True)
    entries, written = {}, 0
    for rel, path in files.items():
        sha = file_sha256(path)
        written += put_verified(backend, object_key(sha), path, sha)
        entries[rel] = {"sha256": sha, "bytes": path.stat().st_size}
    index = index_bytes(entries)
    index_sha = hashlib.sha256(index).hexdigest()
    # Last, and only after every object matched: an index in the store means the whole tree is there.
    # Only where no index exists (S3: If-None-Match; local: link), so of two pushes of different trees to one URI
    # exactly one wins; the same tree pushed twice finds its own index.
    written += put_verified(backend, INDEX, index, index_sha,
                            taken=f"{backend.uri} already holds another tree ({INDEX} sha256 {{found}}, this push's "
                                  f"{index_sha}); it was left as it is: push to a new prefix")
    return {"uri": backend.uri, "files": len(entries), "bytes": sum(e["bytes"] for e in entries.values()),
            "objects_written": written, "index_sha256": index_sha}


def read_index(backend: Backend) -> dict:
    if backend.size(INDEX) is None:
        raise StoreError(f"{backend.uri}: no {INDEX}: nothing was pushed here, or a push did not finish")
    buf = MemorySink()
    backend.read_to(INDEX, buf)
    try:
        index = json.loads(bytes(buf.data))
        files = index["files"]
        assert index["format"] == INDEX_FORMAT
        for rel, entry in files.items():
            _check_relative(rel)
            assert isinstance(entry["sha256"], str) and len(entry["sha256"]) == 64 and isinstance(entry["bytes"], int)
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise StoreError(f"{backend.uri}/{INDEX} is not an nshard store index ({type(exc).__name__}: {exc})") from None
    return files


def _check_relative(rel: str) -> None:
    parts = PurePosixPath(rel).parts
    if not rel or rel.startswith("/") or "\\" in rel or any(p in ("..", ".", "") for p in parts):
        raise ValueError(f"unsafe path {rel!r} in the index")


def verify(backend: Backend) -> list[str]:
    """Re-read every object under objects/ and check it against its name and the index; returns the problems."""
    backend.check(writing=False)
    files = read_index(backend)
    present = set(backend.keys("objects/"))
    problems, referenced = [], {}
    for rel, entry in sorted(files.items()):
        referenced.setdefault(object_key(entry["sha256"]), []).append(rel)
    for key in sorted(present | set(referenced)):
        paths = ", ".join(referenced.get(key, [])) or "no index entry"
        if key not in present:
            problems.append(f"object {key} ({paths}) is missing")
            continue
        found, named = read_sha256(backend, key), key.rsplit("/", 1)[-1]
        if found != named:
            problems.append(f"object {key} ({paths}) has sha256 {found}")
    return problems


def pull(backend: Backend, dest: Path) -> dict:
    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        raise BadInput(f"{dest} already exists; pull into a new directory")
    backend.check(writing=False)
    files = read_index(backend)
    with staged_dir(dest, "pull") as tmp:
        for rel, entry in sorted(files.items()):
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            key = object_key(entry["sha256"])
            try:
                with open(target, "wb") as out:
                    found = backend.read_to(key, FileSink(out))
            except (StoreError, OSError) as exc:
                raise StoreError(f"object {key} ({rel}) could not be read: {exc}") from None
            if found != entry["sha256"]:
                raise StoreError(f"object {key} ({rel}) has sha256 {found}; not pulled")
    return {"dest": str(dest), "files": len(files), "bytes": sum(e["bytes"] for e in files.values())}


class _Parser(ArgumentParser):
    def error(self, message):
        fail(f"{message} (see {prog('nshard.evidence.store')} --help)", 2)


def fail(message: str, code: int):
    print(f"nshard.store: error: {message}", file=sys.stderr)
    sys.exit(code)


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes: push, URI/objects/sha256/... and URI/index.json (last); pull, the tree at DEST (new); verify "
              "writes nothing. Each prints one JSON line; problems go to stderr. " + SPELLING_NOTE)
    parser = _Parser(prog=prog("nshard.evidence.store"), description=__doc__, epilog=epilog)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("push", help="store SRC under URI").add_argument("src")
    sub.choices["push"].add_argument("uri")
    sub.add_parser("verify", help="re-read every object under URI").add_argument("uri")
    sub.add_parser("pull", help="rebuild URI's tree at DEST").add_argument("uri")
    sub.choices["pull"].add_argument("dest")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        backend = open_backend(args.uri)
        if args.command == "push":
            print(json.dumps(push(Path(args.src), backend)), flush=True)
        elif args.command == "pull":
            print(json.dumps(pull(backend, Path(args.dest))), flush=True)
        else:
            problems = verify(backend)
            for line in problems:
                print(f"nshard.store: error: {line}", file=sys.stderr)
            if problems:
                return 1
            print(json.dumps({"uri": backend.uri, "verified": True}), flush=True)
    except BadInput as exc:
        fail(str(exc), 2)
    except (StoreError, OSError) as exc:
        fail(str(exc), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
