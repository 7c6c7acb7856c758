"""Evidence archive: a run's (or a study's) small files and a source snapshot in one tar, every byte bound by SHA-256.

    python -m nshard.evidence.archive create RUN_DIR [RUN_DIR ...] ARCHIVE [--extra FILE ...] [--no-source]
    python -m nshard.evidence.archive verify ARCHIVE [--sha256 HEX]
    python -m nshard.evidence.archive extract ARCHIVE DEST

Members: runs/<run>/ (plan.toml, ds_config.json, run.json, metrics.jsonl and the other top-level files,
prepared/, receipts/, model/manifest.json: the manifest binds the weights, which stay out), extra/<file>, and
source/ (`git archive` of the commit the runs' manifests name, else HEAD). The first member, index.json, holds
each member's SHA-256 and size and a hash of itself; the tar is canonical (fixed order, times, modes), so
verify rebuilds it and any changed byte shows. ARCHIVE.sha256 beside it (sha256sum format) anchors the whole.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

from nshard.files import first_difference, staged_dir

INDEX = "index.json"
FORMAT = "nshard-evidence/1"
RUN_SUBDIRS = ("prepared", "receipts")
REPO = Path(__file__).resolve().parents[2]


class ArchiveError(RuntimeError):
    """The archive does not verify or would extract unsafely (exit 1); the message names the member."""


class BadInput(ArchiveError):
    """A missing run directory, an existing destination, ... (exit 2)."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_members(run_dir: Path) -> dict[str, bytes]:
    """The evidence files of one run directory, by path relative to it; weights and links stay out."""
    if not (run_dir / "run.json").is_file():
        raise BadInput(f"{run_dir} is not an nshard run directory (no run.json)")
    paths = [p for p in run_dir.iterdir() if p.is_file()]
    paths += [p for sub in RUN_SUBDIRS if (run_dir / sub).is_dir() for p in (run_dir / sub).rglob("*") if p.is_file()]
    if (run_dir / "model" / "manifest.json").is_file():
        paths.append(run_dir / "model" / "manifest.json")
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(paths) if not p.is_symlink()}


def source_snapshot(repo: Path, commits: list) -> tuple[dict, dict[str, bytes]]:
    """Tracked files at the commit the runs were made from (if they agree and it exists here), else at HEAD."""
    def git(*args, text=True):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=text, timeout=120)

    recorded = sorted({c for c in commits if c})
    if shutil.which("git") is None:
        return {"commit": None, "chosen_from": None, "recorded_by_runs": recorded}, {}
    chosen_from = "run manifests"
    commit = recorded[0] if len(recorded) == 1 else None
    if commit is None or git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        head = git("rev-parse", "--verify", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "chosen_from": None, "recorded_by_runs": recorded}, {}
        commit, chosen_from = head.stdout.strip(), "HEAD"
    tar_bytes = git("archive", "--format=tar", commit, text=False).stdout
    files = {}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for info in tar:
            if info.isreg():
                files[f"source/{info.name}"] = tar.extractfile(info).read()
    return {"commit": commit, "chosen_from": chosen_from, "recorded_by_runs": recorded}, files


def index_bytes(body: dict) -> bytes:
    """Canonical JSON with a hash over the rest of the index, so a change to any field of it shows."""
    body = {k: v for k, v in body.items() if k != "index_sha256"}
    inner = json.dumps(body, indent=1, sort_keys=True)
    return (json.dumps({**body, "index_sha256": sha256(inner.encode())}, indent=1, sort_keys=True) + "\n").encode()


def canonical_tar(index: bytes, members: dict[str, bytes]) -> bytes:
    """index.json first, then members in name order; zero times, 0644, no owners: same input, same bytes."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [(INDEX, index), *sorted(members.items())]:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = \
                len(data), 0, 0o644, 0, 0, "", ""
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def create(archive: Path, run_dirs: list[Path], extras: list[Path] = (), repo: Path | None = REPO) -> dict:
    archive = Path(archive)
    if archive.exists():
        raise BadInput(f"{archive} already exists; evidence is not overwritten")
    members, runs = {}, {}
    for run_dir in map(Path, run_dirs):
        name = run_dir.resolve().name
        if name in runs:
            raise BadInput(f"two run directories are named {name!r}; archive them separately")
        files = run_members(run_dir)
        manifest = json.loads(files["model/manifest.json"]) if "model/manifest.json" in files else {}
        runs[name] = {"status": json.loads(files["run.json"]).get("status"), "source": manifest.get("source")}
        members.update({f"runs/{name}/{rel}": data for rel, data in files.items()})
    for extra in map(Path, extras):
        if not extra.is_file() or extra.is_symlink():
            raise BadInput(f"{extra}: not a regular file")
        if f"extra/{extra.name}" in members:
            raise BadInput(f"two extra files are named {extra.name!r}")
        members[f"extra/{extra.name}"] = extra.read_bytes()
    source = {"commit": None, "chosen_from": None}
    if repo is not None:
        source, files = source_snapshot(Path(repo), [(r["source"] or {}).get("commit") for r in runs.values()])
        members.update(files)
    index = index_bytes({"format": FORMAT, "runs": runs, "source": source,
                         "members": {n: {"sha256": sha256(d), "bytes": len(d)} for n, d in sorted(members.items())}})
    data = canonical_tar(index, members)
    digest = sha256(data)
    _write_atomic(archive, data)
    _write_atomic(sidecar(archive), f"{digest}  {archive.name}\n".encode())
    return {"archive": str(archive), "sha256": digest, "members": len(members), "bytes": len(data)}


def sidecar(archive: Path) -> Path:
    return Path(f"{archive}.sha256")


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def check_member(info: tarfile.TarInfo) -> None:
    """Refuse what could write outside DEST: absolute names, `..`, links (inside or out), devices."""
    name = info.name
    parts = PurePosixPath(name).parts
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name) or "\\" in name or "\0" in name:
        raise ArchiveError(f"member {name!r}: absolute path refused")
    if not parts or any(p in ("..", ".") for p in parts):
        raise ArchiveError(f"member {name!r}: '..' or '.' in the path refused")
    if info.issym() or info.islnk():
        target = PurePosixPath(name).parent / info.linkname if info.issym() else PurePosixPath(info.linkname)
        outside = info.linkname.startswith("/") or _escapes(target)
        kind = "symlink" if info.issym() else "hard link"
        raise ArchiveError(f"member {name!r}: {kind} to {info.linkname!r} refused"
                           + (" (it points outside the archive)" if outside else " (links are not evidence)"))
    if not info.isreg():
        raise ArchiveError(f"member {name!r}: not a regular file (type {info.type!r}) refused")


def _escapes(path: PurePosixPath) -> bool:
    depth = 0
    for part in path.parts:
        depth += -1 if part == ".." else 0 if part in (".", "") else 1
        if depth < 0:
            return True
    return False


def read_members(data: bytes) -> list[tuple[str, bytes]]:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            out = []
            for info in tar:
                check_member(info)
                out.append((info.name, tar.extractfile(info).read()))
            return out
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ArchiveError(f"not a readable tar archive ({type(exc).__name__}: {exc})") from None


def verify_bytes(data: bytes, expected_sha256: str | None = None) -> tuple[dict, dict[str, bytes]]:
    """Check the anchor (if given), every member's safety and hash, the index's own hash, and canonical form."""
    if expected_sha256 is not None and sha256(data) != expected_sha256:
        raise ArchiveError(f"archive sha256 is {sha256(data)}, expected {expected_sha256}")
    listed = read_members(data)
    if not listed or listed[0][0] != INDEX:
        raise ArchiveError(f"the first member is not {INDEX}")
    members = dict(listed[1:])
    if len(members) != len(listed) - 1 or INDEX in members:
        raise ArchiveError("a member name appears twice")
    try:
        index = json.loads(listed[0][1])
        table = index["members"]
        assert index["format"] == FORMAT
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise ArchiveError(f"{INDEX} is not an nshard evidence index ({type(exc).__name__}: {exc})") from None
    if index_bytes(index) != listed[0][1]:
        raise ArchiveError(f"{INDEX} does not match its own index_sha256 (or is not in canonical form)")
    found = {name: {"sha256": sha256(data), "bytes": len(data)} for name, data in members.items()}
    difference = first_difference(table, found)
    if difference is not None:
        kind, name = difference
        if kind == "missing":
            raise ArchiveError(f"member {name!r} is in {INDEX} but not in the archive")
        if kind == "extra":
            raise ArchiveError(f"member {name!r} is not in {INDEX}")
        raise ArchiveError(f"member {name!r}: sha256 {found[name]['sha256']} ({found[name]['bytes']} bytes), "
                           f"{INDEX} says {table[name]['sha256']} ({table[name]['bytes']} bytes)")
    if canonical_tar(listed[0][1], members) != data:
        raise ArchiveError("tar headers or padding differ from the canonical form written by create")
    return index, members


def read_sidecar(archive: Path) -> str | None:
    path = sidecar(archive)
    if not path.exists():
        return None
    match = re.fullmatch(r"([0-9a-f]{64})  (.+)\n", path.read_text(errors="replace"))
    if not match or match.group(2) != archive.name:
        raise ArchiveError(f"{path} is not '<sha256>  {archive.name}'")
    return match.group(1)


def verify(archive: Path, expected_sha256: str | None = None) -> tuple[dict, dict[str, bytes], bool]:
    """verify_bytes with the anchor from --sha256, else from ARCHIVE.sha256; says whether one was checked."""
    archive = Path(archive)
    if not archive.is_file():
        raise BadInput(f"{archive}: no such archive")
    anchor = read_sidecar(archive)
    if expected_sha256 and anchor and expected_sha256 != anchor:
        raise ArchiveError(f"{sidecar(archive)} says {anchor}, --sha256 says {expected_sha256}")
    index, members = verify_bytes(archive.read_bytes(), expected_sha256 or anchor)
    return index, members, bool(expected_sha256 or anchor)


def extract(archive: Path, dest: Path, expected_sha256: str | None = None) -> dict:
    """Verify everything, write into a temp directory beside DEST, then rename: DEST appears whole or not at all."""
    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        raise BadInput(f"{dest} already exists; extract into a new directory")
    index, members, anchored = verify(archive, expected_sha256)
    with staged_dir(dest, "extract") as tmp:
        for name, data in [(INDEX, index_bytes(index)), *members.items()]:
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    return {"dest": str(dest), "members": len(members), "anchored": anchored}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"nshard.archive: error: {message} (see python -m nshard.evidence.archive --help)", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> int:
    parser = _Parser(prog="nshard.evidence.archive", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("create", help="archive run directories (and extra files)")
    c.add_argument("paths", nargs="+", metavar="RUN_DIR... ARCHIVE")
    c.add_argument("--extra", action="append", default=[], help="another file to include (a study's notes, ...)")
    c.add_argument("--no-source", action="store_true", help="leave out the git source snapshot")
    v = sub.add_parser("verify", help="check every member, the index and the archive's own SHA-256")
    v.add_argument("archive")
    v.add_argument("--sha256", help="the archive's expected SHA-256 (default: ARCHIVE.sha256 beside it)")
    x = sub.add_parser("extract", help="verify, then extract into a new directory")
    x.add_argument("archive")
    x.add_argument("dest")
    x.add_argument("--sha256", help="the archive's expected SHA-256 (default: ARCHIVE.sha256 beside it)")
    args = parser.parse_args(argv)
    try:
        if args.command == "create":
            if len(args.paths) < 2:
                raise BadInput("create needs at least one RUN_DIR and the ARCHIVE path")
            result = create(Path(args.paths[-1]), [Path(p) for p in args.paths[:-1]], [Path(e) for e in args.extra],
                            None if args.no_source else REPO)
        elif args.command == "verify":
            index, members, anchored = verify(Path(args.archive), args.sha256)
            result = {"archive": args.archive, "members": len(members), "anchored": anchored,
                      "source_commit": index.get("source", {}).get("commit")}
            if not anchored:
                print(f"nshard.archive: note: no {sidecar(Path(args.archive)).name} and no --sha256: "
                      "checked internal consistency only", file=sys.stderr)
        else:
            result = extract(Path(args.archive), Path(args.dest), args.sha256)
    except BadInput as exc:
        print(f"nshard.archive: error: {exc}", file=sys.stderr)
        return 2
    except (ArchiveError, OSError) as exc:
        print(f"nshard.archive: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
