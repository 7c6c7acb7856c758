"""Evidence archives: every changed byte is detected; extraction refuses what could land outside DEST."""

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from nshard.evidence.archive import (ArchiveError, BadInput, canonical_tar, create, create_study_archive, extract,
                                     index_bytes, sidecar, verify, verify_bytes)
from nshard.evidence.commit import CommitError, model_files
from nshard.evidence.export import ManifestError, verify_manifest, write_manifest
from runs import cached_run, tiny_config

REPO = Path(__file__).resolve().parent.parent


def fake_run(root: Path) -> Path:
    """The shape of a run directory, small: evidence files, weights and a state directory that must stay out."""
    files = {"plan.toml": 'name = "t"\n', "ds_config.json": "{}\n", "run.json": '{"status": "complete"}\n',
             "metrics.jsonl": '{"update": 1, "loss": 2.5}\n', "receipts/rank-0.json": '{"rank": 0}\n',
             "prepared/identity.json": '{"prepared_identity": "ab"}\n',
             "model/manifest.json": '{"source": {"commit": null, "dirty": null}}\n',
             "model/model.safetensors": "WEIGHTS", "state/0001/rank-0.pt": "STATE"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def archive_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nshard.evidence.archive", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_small_archive_holds_the_evidence_not_the_weights(tmp_path):
    run = fake_run(tmp_path / "r1")
    create(tmp_path / "a.tar", [run], [], repo=None)
    index, members, anchored = verify(tmp_path / "a.tar")
    assert anchored and set(members) == {f"runs/r1/{p}" for p in [
        "plan.toml", "ds_config.json", "run.json", "metrics.jsonl", "receipts/rank-0.json",
        "prepared/identity.json", "model/manifest.json"]}
    extract(tmp_path / "a.tar", tmp_path / "out")
    for name, data in members.items():
        assert (tmp_path / "out" / name).read_bytes() == data == (tmp_path / name.replace("runs/", "", 1)).read_bytes()


def test_every_changed_byte_of_the_archive_is_detected(tmp_path):
    create(tmp_path / "a.tar", [fake_run(tmp_path / "r1")], [], repo=None)
    data = (tmp_path / "a.tar").read_bytes()
    anchor = hashlib.sha256(data).hexdigest()
    with tarfile.open(tmp_path / "a.tar") as tar:  # where each member's bytes lie, to check the error names it
        regions = [(m.offset_data, m.offset_data + m.size, m.name) for m in tar.getmembers()]
    undetected = []
    for i in range(len(data)):
        changed = bytearray(data)
        changed[i] ^= 0x01  # the smallest change: one bit ('0' <-> '1' in a hex digest)
        changed = bytes(changed)
        with pytest.raises(ArchiveError, match="sha256") as anchored:
            verify_bytes(changed, anchor)
        assert anchor in str(anchored.value)
        try:  # and without the anchor: the index, its own hash and the canonical form catch it
            verify_bytes(changed)
            undetected.append(i)
        except ArchiveError as exc:
            inside = [name for start, end, name in regions if start <= i < end]
            assert not inside or inside[0] in str(exc) or inside[0] == "index.json", (i, inside, str(exc))
    assert not undetected, f"{len(undetected)} of {len(data)} changed bytes went unnoticed, first at {undetected[:5]}"


def test_every_changed_byte_of_the_sidecar_is_detected(tmp_path):
    create(tmp_path / "a.tar", [fake_run(tmp_path / "r1")], [], repo=None)
    original = sidecar(tmp_path / "a.tar").read_bytes()
    for i in range(len(original)):
        changed = bytearray(original)
        changed[i] ^= 0x01
        sidecar(tmp_path / "a.tar").write_bytes(bytes(changed))
        with pytest.raises(ArchiveError):
            verify(tmp_path / "a.tar")


def crafted(tmp_path: Path, member: tarfile.TarInfo, data: bytes = b"x") -> Path:
    path = tmp_path / "crafted.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(tarfile.TarInfo("index.json"), io.BytesIO(b""))
        member.size = len(data) if member.isreg() else 0
        tar.addfile(member, io.BytesIO(data) if member.isreg() else None)
    return path


def link(name: str, target: str, kind=tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize("make, why", [
    (lambda t: tarfile.TarInfo("../x"), "'..'"),
    (lambda t: tarfile.TarInfo("runs/../../x"), "'..'"),
    (lambda t: tarfile.TarInfo(str(t / "abs-x")), "absolute path"),
    (lambda t: link("runs/evil", "../../x"), "points outside"),
    (lambda t: link("runs/evil", "/etc/passwd"), "points outside"),
    (lambda t: link("runs/evil", "../x", tarfile.LNKTYPE), "points outside"),
], ids=["dotdot", "nested-dotdot", "absolute", "symlink-up", "symlink-absolute", "hardlink-up"])
def test_extraction_refuses_paths_and_links_that_leave_dest(tmp_path, make, why):
    member = make(tmp_path)
    archive = crafted(tmp_path, member)
    dest = tmp_path / "deep" / "dest"
    with pytest.raises(ArchiveError, match=why) as refused:
        extract(archive, dest)
    assert repr(member.name) in str(refused.value) and "refused" in str(refused.value)
    assert not (tmp_path / "deep").exists()  # nothing made, not even a temp directory
    assert not (tmp_path / "x").exists() and not (tmp_path / "deep" / "x").exists()
    assert not (tmp_path / "abs-x").exists()
    proc = archive_cli("extract", archive, dest)
    assert proc.returncode == 1 and proc.stderr.startswith("nshard.archive: error: member ") and not dest.exists()


@pytest.fixture(scope="module")
def real_run(runs_root):
    return cached_run(runs_root, "ds-dense", tiny_config())


def test_a_real_run_archives_with_its_source_and_extracts_whole(real_run, tmp_path):
    archive = tmp_path / "evidence.tar"
    made = archive_cli("create", real_run, archive)
    assert made.returncode == 0, made.stderr
    summary = json.loads(made.stdout)
    assert summary["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert subprocess.run(["sha256sum", "-c", sidecar(archive).name], cwd=tmp_path, capture_output=True).returncode == 0
    checked = archive_cli("verify", archive)
    assert checked.returncode == 0 and json.loads(checked.stdout)["anchored"], checked.stderr
    assert archive_cli("extract", archive, tmp_path / "out").returncode == 0
    out = tmp_path / "out"
    index = json.loads((out / "index.json").read_text())
    manifest = json.loads((real_run / "model" / "manifest.json").read_text())
    assert index["source"]["commit"] == manifest["source"]["commit"]
    assert index["source"]["chosen_from"] == "run manifests"
    run_out = out / "runs" / real_run.name
    for rel in ["plan.toml", "ds_config.json", "run.json", "metrics.jsonl", "prepared/identity.json",
                "prepared/documents.jsonl", "receipts/rank-0.json", "receipts/rank-1.json", "model/manifest.json"]:
        assert (run_out / rel).read_bytes() == (real_run / rel).read_bytes(), rel
    assert not (run_out / "model" / "model.safetensors").exists()  # the manifest binds the weights instead
    shown = subprocess.run(["git", "-C", str(REPO), "show", f"{manifest['source']['commit']}:nshard/run/training.py"],
                           capture_output=True, check=True).stdout
    assert (out / "source" / "nshard" / "run" / "training.py").read_bytes() == shown


def test_cli_bad_input_and_a_damaged_member(tmp_path):
    run = fake_run(tmp_path / "r1")
    assert archive_cli("create", run, tmp_path / "a.tar", "--no-source").returncode == 0
    assert archive_cli("create", run, tmp_path / "a.tar", "--no-source").returncode == 2  # never overwritten
    assert archive_cli("create", tmp_path / "nothing", tmp_path / "b.tar").returncode == 2
    assert archive_cli("verify", tmp_path / "missing.tar").returncode == 2
    (tmp_path / "taken").mkdir()
    assert archive_cli("extract", tmp_path / "a.tar", tmp_path / "taken").returncode == 2
    data = bytearray((tmp_path / "a.tar").read_bytes())
    data[data.index(b"2.5")] ^= 0x01  # the metrics line's loss
    (tmp_path / "a.tar").write_bytes(bytes(data))
    anchored = archive_cli("verify", tmp_path / "a.tar")
    assert anchored.returncode == 1 and "archive sha256 is" in anchored.stderr
    sidecar(tmp_path / "a.tar").unlink()
    internal = archive_cli("verify", tmp_path / "a.tar")
    assert internal.returncode == 1 and "runs/r1/metrics.jsonl" in internal.stderr
    assert internal.stderr.count("\n") == 1
    with pytest.raises(BadInput):
        create(tmp_path / "c.tar", [run, run], [], repo=None)


# ---- the export manifest binds every entry of model/, whatever its kind --------------------------------------

def sealed_export(root: Path) -> Path:
    model = root / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}\n")
    (model / "model.safetensors").write_bytes(b"W" * 64)
    (model / "sub" / "notes.txt").write_text("n\n")
    write_manifest(model, parameter_root="0" * 64, plan_sha256="1" * 64, ds_config_sha256="2" * 64,
                   prepared_identity="3" * 64)
    return model


ADDED = {"symlink": lambda p: p.symlink_to("config.json"), "dir": lambda p: p.mkdir(), "fifo": os.mkfifo}


@pytest.mark.parametrize("kind", ADDED)
@pytest.mark.parametrize("where", ["added", "sub/added"])
def test_an_entry_added_to_a_sealed_export_is_named(tmp_path, kind, where):
    """Attack: a symlink, an empty folder or a FIFO put into model/ after the manifest was written."""
    model = sealed_export(tmp_path)
    assert verify_manifest(model)["format"] == "nshard-export/2"
    ADDED[kind](model / where)
    with pytest.raises(ManifestError, match=f"^{where}: a {kind} present but not in the manifest"):
        verify_manifest(model)


def test_a_file_swapped_for_a_link_to_the_same_bytes_is_named(tmp_path):
    model = sealed_export(tmp_path)
    (tmp_path / "copy.json").write_bytes((model / "config.json").read_bytes())
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(tmp_path / "copy.json")
    with pytest.raises(ManifestError, match="^config.json: a symlink, the manifest says file"):
        verify_manifest(model)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_an_export_holding_a_link_or_special_file_is_refused_when_sealed(tmp_path, kind):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}\n")
    ADDED[kind](model / "odd")
    with pytest.raises(ManifestError, match=f"odd \\({kind}\\) cannot be exported"):
        write_manifest(model, parameter_root="0", plan_sha256="1", ds_config_sha256="2", prepared_identity="3")
    assert not (model / "manifest.json").exists()


def test_a_format_1_manifest_still_verifies_and_sees_added_entries(tmp_path):
    model = sealed_export(tmp_path)
    body = json.loads((model / "manifest.json").read_text())
    files = {rel: {"sha256": e["sha256"], "bytes": e["bytes"]} for rel, e in body.pop("entries").items()
             if e["kind"] == "file"}
    (model / "manifest.json").write_text(json.dumps({**body, "format": "nshard-export/1", "files": files}))
    verify_manifest(model)
    (model / "empty").mkdir()
    with pytest.raises(ManifestError, match="^empty: a dir present but not in the manifest"):
        verify_manifest(model)


def test_model_files_refuses_what_it_cannot_bind_and_follows_links_to_files(tmp_path):
    model = sealed_export(tmp_path)
    (tmp_path / "blob").write_text("{}\n")
    (model / "linked.json").symlink_to(tmp_path / "blob")  # a hub snapshot's shape: the bytes that load are bound
    assert model_files(model)["linked.json"] == model_files(model)["config.json"]
    os.mkfifo(model / "pipe")
    with pytest.raises(CommitError, match="pipe is a fifo, neither a file nor a folder"):
        model_files(model)


# ---- a dirty tree is carried as its exact diff, never presented as its clean commit -------------------------

def git(repo: Path, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def throwaway_repo(root: Path) -> tuple[Path, str]:
    repo = root / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "train.py").write_text("lr = 1\n")
    (repo / "pkg" / "gone.py").write_text("old\n")
    (repo / ".gitignore").write_text("*.log\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "base")
    return repo, git(repo, "rev-parse", "HEAD")


def run_recording(root: Path, commit: str, dirty: bool) -> Path:
    run = fake_run(root)
    (run / "model" / "manifest.json").write_text(json.dumps({"source": {"commit": commit, "dirty": dirty}}))
    return run


def make_dirty(repo: Path) -> None:
    (repo / "pkg" / "train.py").write_text("lr = 2\n")  # tracked, changed
    (repo / "pkg" / "gone.py").unlink()  # tracked, deleted
    (repo / "pkg" / "new.py").write_bytes(b"\x00\xffnew\n")  # untracked, binary
    (repo / "debug.log").write_text("ignored\n")  # ignored: not source


def test_a_dirty_tree_is_archived_as_commit_plus_its_exact_diff(tmp_path):
    """Attack: a run made from a dirty tree, archived; today's archive holds only the clean commit."""
    repo, commit = throwaway_repo(tmp_path)
    make_dirty(repo)
    create(tmp_path / "a.tar", [run_recording(tmp_path / "r1", commit, dirty=True)], [], repo=repo)
    index, members, _ = verify(tmp_path / "a.tar")
    source = index["source"]
    assert source["commit"] == commit and source["dirty_at_training"] is True
    assert source["captured"] == "working tree at archive time" and source["dirty"] is True
    assert source["diff_sha256"] == hashlib.sha256(members["source.diff"]).hexdigest()
    assert source["untracked"] == ["pkg/new.py"] and "source-untracked/debug.log" not in members
    # commit + diff + untracked files rebuild the working tree exactly
    rebuilt = tmp_path / "rebuilt"
    extract(tmp_path / "a.tar", tmp_path / "x")
    shutil.copytree(tmp_path / "x" / "source", rebuilt)
    subprocess.run(["git", "apply", "--binary", str(tmp_path / "x" / "source.diff")], cwd=rebuilt, check=True)
    shutil.copytree(tmp_path / "x" / "source-untracked", rebuilt, dirs_exist_ok=True)
    tree = lambda d: {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*")
                      if p.is_file() and ".git" not in p.parts and p.suffix != ".log"}
    assert tree(rebuilt) == tree(repo)


def test_a_dirty_run_archived_from_a_clean_tree_does_not_claim_its_commit(tmp_path):
    repo, commit = throwaway_repo(tmp_path)
    create(tmp_path / "a.tar", [run_recording(tmp_path / "r1", commit, dirty=True)], [], repo=repo)
    index, members, _ = verify(tmp_path / "a.tar")
    source = index["source"]
    assert source["dirty_at_training"] is True and source["captured"] == "working tree at archive time"
    assert source["dirty"] is False and "source.diff" not in members


def test_clean_runs_are_archived_at_their_commit_whatever_the_tree_is_now(tmp_path):
    repo, commit = throwaway_repo(tmp_path)
    make_dirty(repo)
    create(tmp_path / "a.tar", [run_recording(tmp_path / "r1", commit, dirty=False)], [], repo=repo)
    index, members, _ = verify(tmp_path / "a.tar")
    assert index["source"]["captured"] == "commit" and index["source"]["dirty_at_training"] is False
    assert members["source/pkg/train.py"] == b"lr = 1\n" and "source.diff" not in members
    assert not [m for m in members if m.startswith("source-untracked/")]


def test_an_index_that_presents_a_clean_commit_for_a_dirty_run_is_refused(tmp_path):
    repo, commit = throwaway_repo(tmp_path)
    create(tmp_path / "a.tar", [run_recording(tmp_path / "r1", commit, dirty=True)], [], repo=repo)
    index, members, _ = verify(tmp_path / "a.tar")
    forged = index_bytes({**index, "source": {**index["source"], "captured": "commit"}})
    with pytest.raises(ArchiveError, match="captured as a clean commit, but the runs were not recorded clean"):
        verify_bytes(canonical_tar(forged, members))


# ---- a study directory: every evidence file, no weights ------------------------------------------------------

def fake_study(root: Path) -> Path:
    """A study directory's shape: its own files, two arms (one failed), a failed attempt, an old archive."""
    study = root / "study"
    files = {"study.json": "{}\n", "plan.toml": "x\n", "commitment.json": "{}\n", "anchor.json": "{}\n",
             "validation.json": "{}\n", "results.json": "{}\n", "report.md": "# r\n", "plots/loss.png": "PNG",
             "eval/seed/cases.jsonl": "{}\n", "eval/seed/summary.json": "{}\n", "eval/a1/cases.jsonl": "{}\n",
             "logs/a1-attempt-1.log": "ok\n", "logs/broken-attempt-1.log": "error\n",
             "arms/broken/receipts/rank-0.json": "{}\n",  # failed before run.json
             "evidence.tar": "OLD", "evidence.tar.sha256": "OLD", ".evidence.tar.abc": "TEMP"}
    for rel, text in files.items():
        (study / rel).parent.mkdir(parents=True, exist_ok=True)
        (study / rel).write_text(text)
    fake_run(study / "arms" / "a1")
    fake_run(study / "failed" / "a1-attempt-0")
    (study / "arms" / "broken" / "state" / "0001").mkdir(parents=True)
    (study / "arms" / "broken" / "state" / "0001" / "rank-0.pt").write_text("STATE")
    return study


RUN_EVIDENCE = ["plan.toml", "ds_config.json", "run.json", "metrics.jsonl", "receipts/rank-0.json",
                "prepared/identity.json", "model/manifest.json"]


def test_a_study_archive_holds_every_evidence_file_and_no_weights(tmp_path):
    study = fake_study(tmp_path)
    made = create_study_archive(study, repo=None)
    assert made["archive"] == str(study / "evidence.tar") and (study / "evidence.tar.sha256").is_file()
    index, members, anchored = verify(study / "evidence.tar")
    own = ["study.json", "plan.toml", "commitment.json", "anchor.json", "validation.json", "results.json",
           "report.md", "plots/loss.png", "eval/seed/cases.jsonl", "eval/seed/summary.json", "eval/a1/cases.jsonl",
           "logs/a1-attempt-1.log", "logs/broken-attempt-1.log", "arms/broken/receipts/rank-0.json"]
    runs = [f"{d}/{rel}" for d in ("arms/a1", "failed/a1-attempt-0") for rel in RUN_EVIDENCE]
    assert anchored and set(members) == {f"study/{rel}" for rel in own + runs}
    assert index["study"] == "study" and set(index["runs"]) == {"arms/a1", "arms/broken", "failed/a1-attempt-0"}
    assert index["runs"]["arms/broken"] == {"status": None, "source": None}


def test_a_rerun_replaces_the_study_archive_atomically(tmp_path):
    study = fake_study(tmp_path)
    first = create_study_archive(study, repo=None)
    (study / "results.json").write_text('{"rerun": true}\n')
    second = create_study_archive(study, repo=None)
    assert first["sha256"] != second["sha256"]
    _, members, _ = verify(study / "evidence.tar")
    assert members["study/results.json"] == b'{"rerun": true}\n'
    assert not [p for p in study.iterdir() if p.name.startswith(".evidence.tar.") and p.name != ".evidence.tar.abc"]


@pytest.mark.parametrize("where", ["eval/seed/odd", "arms/a1/receipts/odd", "odd"])
def test_a_link_where_study_evidence_is_taken_is_refused_by_name(tmp_path, where):
    study = fake_study(tmp_path)
    (study / where).symlink_to(study / "results.json")
    with pytest.raises(BadInput, match=f"{where} is a symlink"):
        create_study_archive(study, repo=None)
    proc = archive_cli("create", study, tmp_path / "b.tar", "--no-source")
    assert proc.returncode == 2 and f"{where} is a symlink" in proc.stderr and not (tmp_path / "b.tar").exists()


def test_a_study_directory_is_archived_on_its_own(tmp_path):
    study = fake_study(tmp_path)
    proc = archive_cli("create", study, fake_run(tmp_path / "r1"), tmp_path / "b.tar", "--no-source")
    assert proc.returncode == 2 and "archive it on its own" in proc.stderr
