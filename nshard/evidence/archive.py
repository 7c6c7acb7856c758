"""Evidence archive: a study's (or some runs') evidence files and a source snapshot in one tar, every byte bound
by SHA-256.

    python -m nshard.evidence.archive create STUDY_DIR ARCHIVE [--no_source]
    python -m nshard.evidence.archive create RUN_DIR [RUN_DIR ...] ARCHIVE [--extra FILE ...] [--no_source]
    python -m nshard.evidence.archive verify ARCHIVE [--sha256 HEX]
    python -m nshard.evidence.archive extract ARCHIVE DEST

Members:
- A run directory's evidence: its top-level files (plan.toml, ds_config.json, run.json, metrics.jsonl, ...),
  prepared/, receipts/ and model/manifest.json. The weights (model/'s other files) and state/ stay out: the
  manifest binds the export by SHA-256 instead.
- study/<path> for a study directory (one that holds study.json): every file it holds (study.json, plan.toml,
  commitment.json, anchor.json, validation.json, results.json, report.md, plots/, eval/, logs/, ...), except
  that in a run directory (arms/<arm>/, failed/<attempt>/) only the run's evidence is taken, as above, and its
  own evidence.tar, evidence.tar.sha256 and their temporary files are left out. Else runs/<run>/ and extra/<file>.
- A link or special file where evidence is taken is refused (it would go unbound), naming it.
- source/: `git archive` of a commit. When the runs' manifests agree on one commit present here and all say
  the tree was clean, that commit is exactly their source and nothing else is taken. Otherwise (dirty or
  unknown at training, runs that disagree, a commit missing here) the archive captures the working tree at
  archive time, and its index says so: source/ at the base (the runs' commit, else HEAD), source.diff
  (`git diff --binary BASE`: the tracked changes) and source-untracked/<path> (untracked, non-ignored files,
  except those inside the archived directories). It never presents a clean commit as a dirty run's source.
The first member, index.json, holds each member's SHA-256 and size and a hash of itself; the tar is canonical
(fixed order, times, modes), so verify rebuilds it and any changed byte shows. ARCHIVE.sha256 beside it
(sha256sum format) anchors the whole.
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
from pathlib import Path, PurePosixPath

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog
from nshard.evidence.export import entry_kind
from nshard.files import first_difference, staged_dir, write_bytes_atomic

INDEX = "index.json"
FORMAT = "nshard-evidence/2"
FORMATS = ("nshard-evidence/1", FORMAT)
"""Formats verify reads: /1 had no study layout and no dirty-tree capture; the checks are the same."""
RUN_SUBDIRS = ("prepared", "receipts")
STUDY_MARK = "study.json"
STUDY_ARCHIVE = "evidence.tar"
RUN_PARENTS = ("arms", "failed")
REPO = Path(__file__).resolve().parents[2]


class ArchiveError(RuntimeError):
    """The archive does not verify or would extract unsafely (exit 1); the message names the member."""


class BadInput(ArchiveError):
    """A missing run directory, an existing destination, ... (exit 2)."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_evidence_file(path: Path) -> bool:
    """True for a regular file, False for a folder; a link or special file is refused: it would go unbound."""
    kind = entry_kind(path)
    if kind not in ("file", "dir"):
        raise BadInput(f"{path} is a {kind}; evidence is files and folders only: replace it with the file it "
                       "stands for, or remove it")
    return kind == "file"


def run_members(run_dir: Path, require_run_json: bool = True) -> dict[str, bytes]:
    """The evidence files of one run directory, by path relative to it; weights and state stay out."""
    if require_run_json and not (run_dir / "run.json").is_file():
        raise BadInput(f"{run_dir} is not an nshard run directory (no run.json) nor a study directory (no study.json)")
    paths = [p for p in run_dir.iterdir() if is_evidence_file(p)]
    paths += [p for sub in RUN_SUBDIRS if (run_dir / sub).is_dir() for p in (run_dir / sub).rglob("*")
              if is_evidence_file(p)]
    manifest = run_dir / "model" / "manifest.json"
    if os.path.lexists(manifest) and is_evidence_file(manifest):
        paths.append(manifest)
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(paths)}


def run_entry(files: dict[str, bytes]) -> dict:
    """What the index says of a run: its status and the source its manifest records (None where absent)."""
    def field(name, key):
        try:
            return json.loads(files[name]).get(key)
        except (KeyError, ValueError, AttributeError):
            return None
    return {"status": field("run.json", "status"), "source": field("model/manifest.json", "source")}


def is_own_archive(name: str) -> bool:
    return name in (STUDY_ARCHIVE, f"{STUDY_ARCHIVE}.sha256") or name.startswith(f".{STUDY_ARCHIVE}.")


def study_members(study_dir: Path) -> tuple[dict[str, bytes], dict[str, dict]]:
    """Every file of a study directory (the module docstring's rule), and each run directory's index entry."""
    members, runs = {}, {}
    for top in sorted(study_dir.iterdir()):
        if is_own_archive(top.name):
            continue
        if top.name in RUN_PARENTS and not is_evidence_file(top):
            for run_dir in sorted(top.iterdir()):
                if is_evidence_file(run_dir):  # a stray file beside the run directories
                    members[f"{top.name}/{run_dir.name}"] = run_dir.read_bytes()
                    continue
                files = run_members(run_dir, require_run_json=False)
                runs[f"{top.name}/{run_dir.name}"] = run_entry(files)
                members.update({f"{top.name}/{run_dir.name}/{rel}": data for rel, data in files.items()})
        elif is_evidence_file(top):
            members[top.name] = top.read_bytes()
        else:
            members.update({p.relative_to(study_dir).as_posix(): p.read_bytes() for p in sorted(top.rglob("*"))
                            if is_evidence_file(p)})
    return members, runs


def gather(dirs: list[Path], extras: list[Path]) -> tuple[dict[str, bytes], dict, list, str | None]:
    """Members, the index's runs, the sources their manifests record, and the study's name (None for runs)."""
    members, runs = {}, {}
    if any((d / STUDY_MARK).is_file() for d in dirs):
        if len(dirs) != 1 or extras:
            raise BadInput(f"{dirs[0]} is a study directory; archive it on its own (no other directory, no --extra)")
        files, runs = study_members(dirs[0])
        sources = [r["source"] for key, r in runs.items() if key.startswith("arms/")]  # failed attempts: no results
        return {f"study/{rel}": data for rel, data in files.items()}, runs, sources, dirs[0].resolve().name
    for run_dir in dirs:
        name = run_dir.resolve().name
        if name in runs:
            raise BadInput(f"two run directories are named {name!r}; archive them separately")
        files = run_members(run_dir)
        runs[name] = run_entry(files)
        members.update({f"runs/{name}/{rel}": data for rel, data in files.items()})
    for extra in extras:
        if not extra.is_file() or extra.is_symlink():
            raise BadInput(f"{extra}: not a regular file")
        if f"extra/{extra.name}" in members:
            raise BadInput(f"two extra files are named {extra.name!r}")
        members[f"extra/{extra.name}"] = extra.read_bytes()
    return members, runs, [r["source"] for r in runs.values()], None


def dirty_at_training(sources: list) -> bool | None:
    """True if any run's manifest says its tree was dirty, False if all say clean, None if none says."""
    flags = {(s or {}).get("dirty") for s in sources if (s or {}).get("commit")}
    return True if True in flags else False if flags == {False} else None


def source_snapshot(repo: Path, sources: list, inside: list[Path] = ()) -> tuple[dict, dict[str, bytes]]:
    """The runs' exact source (a clean commit they agree on), else the working tree at archive time."""
    recorded = sorted({(s or {}).get("commit") for s in sources} - {None})
    info = {"commit": None, "chosen_from": None, "recorded_by_runs": recorded,
            "dirty_at_training": dirty_at_training(sources), "captured": None}
    top = subprocess.run(["git", "-C", str(repo), "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                         timeout=120) if shutil.which("git") else None
    if top is None or top.returncode != 0:
        return info, {}

    def git(*args, text=True):
        return subprocess.run(["git", "-C", top.stdout.strip(), *args], capture_output=True, text=text, timeout=120)

    if git("rev-parse", "--verify", "HEAD").returncode != 0:
        return info, {}
    commit, chosen_from = (recorded[0], "run manifests") if len(recorded) == 1 else (None, None)
    if commit is None or git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        commit, chosen_from = git("rev-parse", "--verify", "HEAD").stdout.strip(), "HEAD"
    info.update(commit=commit, chosen_from=chosen_from)
    files = {f"source/{name}": data for name, data in git_archive(git, commit)}
    if chosen_from == "run manifests" and info["dirty_at_training"] is False:
        return {**info, "captured": "commit", "dirty": False}, files
    captured, changes = working_tree(git, Path(top.stdout.strip()), commit, inside)
    return {**info, **captured}, {**files, **changes}


def working_tree(git, repo: Path, base: str, inside: list[Path]) -> tuple[dict, dict[str, bytes]]:
    """What the tree holds beyond BASE: source.diff (tracked changes) and source-untracked/ (untracked files not
    ignored, except those within `inside`, the directories being archived: they are evidence, not source)."""
    diff = git("diff", "--binary", "--no-color", "--no-ext-diff", "--no-textconv", base, text=False)
    listed = git("ls-files", "--others", "--exclude-standard", "-z", text=False)
    if diff.returncode != 0 or listed.returncode != 0:
        raise BadInput(f"git diff / ls-files failed in {repo}: {(diff.stderr or listed.stderr).decode(errors='replace')}")
    untracked = [n for n in sorted(os.fsdecode(n) for n in listed.stdout.split(b"\0") if n)
                 if not any((repo / n).resolve().is_relative_to(d.resolve()) for d in inside)]
    files = {}
    for name in untracked:
        if not is_evidence_file(repo / name):
            raise BadInput(f"{repo / name} is an untracked folder (a nested repository?); commit it, add it to "
                           ".gitignore or remove it, then archive again")
        files[f"source-untracked/{name}"] = (repo / name).read_bytes()
    if diff.stdout:
        files["source.diff"] = diff.stdout
    return {"captured": "working tree at archive time", "dirty": bool(diff.stdout or untracked),
            "diff_sha256": sha256(diff.stdout) if diff.stdout else None, "untracked": untracked}, files


def git_archive(git, commit: str) -> list[tuple[str, bytes]]:
    """The regular files of `git archive COMMIT`, by path."""
    with tarfile.open(fileobj=io.BytesIO(git("archive", "--format=tar", commit, text=False).stdout)) as tar:
        return [(info.name, tar.extractfile(info).read()) for info in tar if info.isreg()]


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


def create(archive: Path, dirs: list[Path], extras: list[Path] = (), repo: Path | None = REPO,
           replace: bool = False) -> dict:
    """Write ARCHIVE and ARCHIVE.sha256 from a study directory or run directories; an existing ARCHIVE is
    refused unless replace (each file is then swapped in by one rename)."""
    archive, dirs = Path(archive), [Path(d) for d in dirs]
    if archive.exists() and not replace:
        raise BadInput(f"{archive} already exists; evidence is not overwritten")
    members, runs, sources, study = gather(dirs, [Path(e) for e in extras])
    source = {"commit": None, "chosen_from": None, "captured": None}
    if repo is not None:
        source, files = source_snapshot(Path(repo), sources, inside=dirs)
        members.update(files)
    body = {"format": FORMAT, "runs": runs, "source": source,
            "members": {n: {"sha256": sha256(d), "bytes": len(d)} for n, d in sorted(members.items())}}
    index = index_bytes({**body, "study": study} if study else body)
    data = canonical_tar(index, members)
    digest = sha256(data)
    write_bytes_atomic(archive, data)
    write_bytes_atomic(sidecar(archive), f"{digest}  {archive.name}\n".encode())
    return {"archive": str(archive), "sha256": digest, "members": len(members), "bytes": len(data)}


def create_study_archive(study_dir: Path, repo: Path | None = REPO) -> dict:
    """STUDY_DIR/evidence.tar (+ .sha256) beside results.json. A re-run replaces both: the archive is the
    evidence of the study directory as the latest run left it (the old archive is not evidence of its own)."""
    return create(Path(study_dir) / STUDY_ARCHIVE, [Path(study_dir)], repo=repo, replace=True)


def sidecar(archive: Path) -> Path:
    return Path(f"{archive}.sha256")


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
        assert index["format"] in FORMATS
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
    check_source(index.get("source") or {}, found)
    return index, members


def check_source(source: dict, found: dict) -> None:
    """The index's account of the source agrees with the members: no clean commit for a dirty run, the diff's hash."""
    if source.get("captured") == "commit" and source.get("dirty_at_training") is not False:
        raise ArchiveError(f"{INDEX}: source captured as a clean commit, but the runs were not recorded clean")
    if source.get("diff_sha256") != found.get("source.diff", {}).get("sha256"):
        raise ArchiveError(f"member 'source.diff': sha256 {found.get('source.diff', {}).get('sha256')}, "
                           f"{INDEX} source.diff_sha256 says {source.get('diff_sha256')}")


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


class _Parser(ArgumentParser):
    def error(self, message):
        print(f"nshard.archive: error: {message} (see {prog('nshard.evidence.archive')} --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes: create, ARCHIVE (a tar) and ARCHIVE.sha256 beside it; extract, DEST (new); verify writes "
              "nothing. Each prints one JSON line. " + SPELLING_NOTE)
    parser = _Parser(prog=prog("nshard.evidence.archive"), description=__doc__, epilog=epilog)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("create", help="archive a study directory, or run directories (and extra files)")
    c.add_argument("paths", nargs="+", metavar="STUDY_DIR|RUN_DIR... ARCHIVE")
    c.add_argument("--extra", action="append", default=[], help="another file to include (a study's notes, ...)")
    c.add_argument("--no_source", action="store_true", help="leave out the git source snapshot")
    v = sub.add_parser("verify", help="check every member, the index and the archive's own SHA-256")
    v.add_argument("archive")
    v.add_argument("--sha256", help="the archive's expected SHA-256 (default: ARCHIVE.sha256 beside it)")
    x = sub.add_parser("extract", help="verify, then extract into a new directory")
    x.add_argument("archive")
    x.add_argument("dest")
    x.add_argument("--sha256", help="the archive's expected SHA-256 (default: ARCHIVE.sha256 beside it)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "create":
            if len(args.paths) < 2:
                raise BadInput("create needs a STUDY_DIR (or RUN_DIRs) and the ARCHIVE path")
            result = create(Path(args.paths[-1]), [Path(p) for p in args.paths[:-1]], [Path(e) for e in args.extra],
                            None if args.no_source else REPO)
        elif args.command == "verify":
            index, members, anchored = verify(Path(args.archive), args.sha256)
            result = {"archive": args.archive, "members": len(members), "anchored": anchored,
                      "source_commit": index.get("source", {}).get("commit"),
                      "source_captured": index.get("source", {}).get("captured")}
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
