"""nshard/files.py's durable writes: a writer killed at any point leaves the old file or the whole new one, and
writers of one target never share a temp file."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nshard import files

REPO = Path(__file__).resolve().parent.parent

# A writer of 2,000 JSONL rows (~40 KB, past the file buffer, so a kill mid-write leaves bytes in its temp file)
# that stops at STAGE, says so on stdout, and waits to be killed.
WRITER = """
import sys, time
from pathlib import Path
from nshard import files
path, stage = Path(sys.argv[1]), sys.argv[2]
def stop(at, _path):
    if at == stage:
        print("stopped", flush=True)
        time.sleep(600)
files.CRASH_POINT = stop
def rows():
    for i in range(2000):
        if i == 1000:
            stop("mid-write", path)
        yield {"row": i, "version": "new"}
files.write_jsonl_atomic(path, rows())
"""


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("stage", ["mid-write", "written", "replaced"])
def test_a_killed_writer_leaves_the_old_file_or_the_whole_new_one(tmp_path, stage):
    target = tmp_path / "log.jsonl"
    files.write_jsonl_atomic(target, [{"row": i, "version": "old"} for i in range(3)])
    old = target.read_bytes()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target), stage], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline() == "stopped\n"
        temps = [p for p in tmp_path.iterdir() if p != target]
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    if stage == "replaced":  # the rename happened: the whole new file
        assert [r["row"] for r in read_rows(target)] == list(range(2000))
        assert {r["version"] for r in read_rows(target)} == {"new"}
        assert temps == []
    else:
        assert target.read_bytes() == old
        # What the kill interrupted: a hidden temp file of its own beside the target, partly or wholly written.
        assert len(temps) == 1 and temps[0].name.startswith(".log.jsonl.") and temps[0].name.endswith(".tmp")
        assert 0 < temps[0].stat().st_size <= len(json.dumps({"row": 1999, "version": "new"})) * 2000 + 2000
        if stage == "written":
            assert len(read_rows(temps[0])) == 2000
    # A later writer is not in the way of the leftover.
    files.write_json_atomic(target, {"after": stage})
    assert json.loads(target.read_text()) == {"after": stage}


def test_two_writers_of_one_target_never_share_a_temp_file(tmp_path, monkeypatch):
    """Writer A stops with its temp file whole and unrenamed; writer B (the same process, so the same pid) writes the
    same target start to finish; A then renames its own file. With one fixed temp name B would have overwritten A's
    temp file and taken it away under A's rename."""
    target = tmp_path / "commitment.json"
    a_written, a_go = threading.Event(), threading.Event()
    seen = []

    def hold_a(stage, path):
        if stage == "written" and threading.current_thread().name == "A":
            seen.append(sorted(p.name for p in tmp_path.iterdir()))
            a_written.set()
            assert a_go.wait(60)

    monkeypatch.setattr(files, "CRASH_POINT", hold_a)
    errors = []

    def write_a():
        try:
            files.write_json_atomic(target, {"writer": "A", "pad": "a" * 100_000})
        except BaseException as exc:  # noqa: BLE001 -- the main thread reports it
            errors.append(exc)

    a = threading.Thread(target=write_a, name="A")
    a.start()
    assert a_written.wait(60)
    files.write_json_atomic(target, {"writer": "B"})
    assert json.loads(target.read_text()) == {"writer": "B"}
    a_go.set()
    a.join()
    assert errors == []
    assert json.loads(target.read_text())["writer"] == "A"
    assert len(seen[0]) == 1 and seen[0][0].startswith(".commitment.json.")  # A's temp file, hidden, its own name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["commitment.json"]


def test_concurrent_processes_leave_a_whole_file(tmp_path):
    """Two processes write one target 50 times each while this one reads it: every read is one writer's whole file."""
    target = tmp_path / "shared.json"
    files.write_json_atomic(target, {"writer": "start", "n": -1, "pad": ""})
    code = ("import sys; from pathlib import Path; from nshard.files import write_json_atomic\n"
            "for n in range(50): write_json_atomic(Path(sys.argv[1]), {'writer': sys.argv[2], 'n': n, "
            "'pad': sys.argv[2] * 20000})")
    writers = [subprocess.Popen([sys.executable, "-c", code, str(target), name], cwd=REPO) for name in "xy"]
    reads = 0
    while any(w.poll() is None for w in writers) or reads == 0:
        body = json.loads(target.read_text())
        assert body["pad"] == (body["writer"] * 20000 if body["writer"] != "start" else "")
        reads += 1
    assert [w.wait() for w in writers] == [0, 0]
    assert json.loads(target.read_text())["n"] == 49
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.json"]


def test_an_error_in_the_block_leaves_the_target_and_no_temp_file(tmp_path):
    target = tmp_path / "report.md"
    files.write_text_atomic(target, "old\n")
    with pytest.raises(RuntimeError):
        with files.atomic_file(target) as f:
            f.write("half")
            raise RuntimeError("the writer failed")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


def test_the_new_file_has_the_mode_a_plain_open_gives(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    plain = tmp_path / "plain"
    plain.write_text("x")
    files.write_text_atomic(tmp_path / "atomic", "x")
    assert (tmp_path / "atomic").stat().st_mode == plain.stat().st_mode
