"""Evidence archives: every changed byte is detected; extraction refuses what could land outside DEST."""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from nshard.evidence.archive import ArchiveError, BadInput, create, extract, sidecar, verify, verify_bytes
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
