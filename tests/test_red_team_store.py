"""Attacks on nshard.evidence.store: a read-back that fails and must heal, a key another writer takes while we write
it, two pushes racing for one prefix, and parts that must carry their checksums. Real moto S3 on loopback."""

import base64
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading

import pytest
from botocore.exceptions import ClientError

from nshard.evidence.backend import StoreError
from nshard.evidence.store import INDEX, LocalBackend, object_key, push
from s3server import FaultProxy
from stores import BUCKET, Target, make_tree, raw_client, store, tree

SIX_MIB = 6 << 20
PART_BYTES = 5 << 20  # S3's smallest part but the last


def s3_env(monkeypatch, env: dict) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # what an operator sets; the client itself is boto3's own


def composite_sha256(data: bytes, part_bytes: int) -> str:
    """S3's composite checksum of a multipart object: SHA-256 over the parts' SHA-256 digests."""
    parts = [data[i:i + part_bytes] for i in range(0, len(data), part_bytes)]
    return base64.b64encode(hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in parts)).digest()).decode()


# ------------------------------------------------------------------ a failed read-back heals


@pytest.mark.parametrize("fault", ["object PUT corrupted", "object read-back corrupted", "index PUT corrupted"])
def test_s3_read_back_failure_removes_the_write_and_a_second_push_heals(moto, tmp_path, fault):
    target = Target("s3", tmp_path, moto)
    src = make_tree(tmp_path / "src")
    b_key = object_key(hashlib.sha256((src / "sub" / "b.bin").read_bytes()).hexdigest())
    hit = []

    def corrupt(method, path):
        if hit:
            return None
        if fault == "object PUT corrupted" and method == "PUT" and path.endswith(b_key):
            hit.append(path)
            return "corrupt"
        if fault == "object read-back corrupted" and method == "GET" and path.endswith(b_key):
            hit.append(path)
            return "corrupt-reply"  # the stored bytes are right; only what the read-back saw was changed
        if fault == "index PUT corrupted" and method == "PUT" and path.endswith("/" + INDEX):
            hit.append(path)
            return "corrupt"
        return None

    proxy = FaultProxy(moto.port, corrupt)
    try:
        pushed = store(target.via(proxy), "push", src, target.uri)
    finally:
        proxy.close()
    assert hit and pushed.returncode == 1 and pushed.stdout == "", pushed.stderr
    assert "read-back of s3://" in pushed.stderr and "removed again" in pushed.stderr, pushed.stderr
    bad_key = INDEX if fault.startswith("index") else b_key
    deletes = [(p, h) for m, p, h in proxy.headers_seen if m == "DELETE"]
    assert [p.split("?")[0].endswith(bad_key) for p, _ in deletes] == [True]
    assert deletes[0][1].get("if-match")  # only the object this push wrote: conditional on its ETag
    assert not target.raw_exists(bad_key) and not target.raw_exists(INDEX)

    healed = store(target.env, "push", src, target.uri)
    assert healed.returncode == 0, healed.stderr
    verified = store(target.env, "verify", target.uri)
    assert verified.returncode == 0 and json.loads(verified.stdout)["verified"], verified.stderr
    assert store(target.env, "pull", target.uri, tmp_path / "dest").returncode == 0
    assert tree(tmp_path / "dest") == tree(src)


class RottingDirectory(LocalBackend):
    """A directory whose storage flips one bit of the next file written: the write "succeeds", the bytes on disk
    are wrong (no fault path reaches a local disk from a test, so the storage is the attacker here)."""

    def __init__(self, root):
        super().__init__(root)
        self.rot_next = True

    def put(self, key, source, sha256):
        created = super().put(key, source, sha256)
        if created and self.rot_next:
            self.rot_next = False
            path = self.root / key
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x10
            path.write_bytes(bytes(data))
        return created


def test_local_read_back_failure_removes_the_write_and_a_second_push_heals(tmp_path):
    target = Target("local", tmp_path)
    src = make_tree(tmp_path / "src")
    with pytest.raises(StoreError, match="read-back of .* removed again"):
        push(src, RottingDirectory(target.uri))
    assert not [p for p in target.uri.rglob("*") if p.is_file()]  # the rotten object was removed again
    healed = store(target.env, "push", src, target.uri)
    assert healed.returncode == 0, healed.stderr
    assert store(target.env, "verify", target.uri).returncode == 0


# ------------------------------------------------------------------ another writer takes the key meanwhile


def intruder(target: Target, key: str, data: bytes):
    """A fault hook: just before our write of `key` reaches the server, someone else writes `data` there."""
    done = []

    def hook(method, path):
        final_write = (method == "PUT" and "partNumber" not in path) or (method == "POST" and "uploadId=" in path)
        if not done and final_write and path.split("?")[0].endswith(key):
            done.append(path)
            target.raw_put(key, data)
        return None
    return hook


@pytest.mark.parametrize("route", ["single", "multipart"])
@pytest.mark.parametrize("theirs", ["same bytes", "other bytes"])
def test_a_key_taken_during_our_write_is_accepted_only_with_the_right_bytes_and_never_deleted(
        moto, tmp_path, monkeypatch, route, theirs):
    from nshard.evidence.store_s3 import S3Backend

    target = Target("s3", tmp_path, moto)
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(SIX_MIB if route == "multipart" else 70_000)
    (src / "w.bin").write_bytes(data)
    key = object_key(hashlib.sha256(data).hexdigest())
    foreign = data if theirs == "same bytes" else data[:-1] + b"?"
    proxy = FaultProxy(moto.port, intruder(target, key, foreign))
    s3_env(monkeypatch, target.via(proxy))
    try:
        backend = S3Backend(target.uri, part_bytes=PART_BYTES)
        if theirs == "same bytes":  # the conditional write lost (412); the object is right, so it counts
            assert push(src, backend)["objects_written"] == 1  # the index only
        else:
            with pytest.raises(StoreError, match="already exists with sha256 .* never overwritten"):
                push(src, backend)
    finally:
        proxy.close()
    deletes = [p for _, p, _ in proxy.requests("DELETE")]
    assert [p for p in deletes if "uploadId=" not in p] == []  # someone else's object is never removed
    assert len(deletes) == (route == "multipart")  # the upload whose complete lost (412) is aborted
    assert target.raw_get(key) == foreign
    uploads = raw_client(moto.url).list_multipart_uploads(Bucket=BUCKET, Prefix=target.prefix)
    assert not uploads.get("Uploads")
    if theirs == "other bytes":
        assert not target.raw_exists(INDEX)


def test_a_local_key_taken_during_our_write_is_never_deleted(tmp_path):
    class Raced(LocalBackend):
        def put(self, key, source, sha256):
            (self.root / key).parent.mkdir(parents=True, exist_ok=True)
            (self.root / key).write_bytes(b"someone else's bytes")  # a writer that got there first
            return super().put(key, source, sha256)

    src = make_tree(tmp_path / "src")
    with pytest.raises(StoreError, match="already exists with sha256 .* never overwritten"):
        push(src, Raced(tmp_path / "store"))
    written = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert [p.read_bytes() for p in written] == [b"someone else's bytes"]


# ------------------------------------------------------------------ two pushes race for one prefix


def racing_pushes(target: Target, proxy_env: dict, srcs) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen([sys.executable, "-m", "nshard.evidence.store", "push", str(src), str(target.uri)],
                              env=proxy_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for src in srcs]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


@pytest.mark.parametrize("trees", ["different", "same"])
def test_two_pushes_racing_for_one_s3_prefix(moto, tmp_path, trees):
    target = Target("s3", tmp_path, moto)
    src_a = make_tree(tmp_path / "a")
    src_b = src_a if trees == "same" else make_tree(tmp_path / "b")  # b.bin is random: another tree
    both_checked = threading.Barrier(2)
    one_at_a_time = threading.Lock()

    @contextlib.contextmanager
    def gate(method, path):
        if method == "PUT" and path.endswith("/" + INDEX):
            both_checked.wait(timeout=60)  # both pushes found no index: the check-then-write window is open
            with one_at_a_time:  # moto's own check-then-write is not atomic across its threads (S3's is)
                yield
        else:
            yield

    proxy = FaultProxy(moto.port, gate=gate)
    try:
        results = racing_pushes(target, target.via(proxy), [src_a, src_b])
    finally:
        proxy.close()
    index_puts = [p for m, p, _ in proxy.requests("PUT") if p.endswith("/" + INDEX)]
    assert len(index_puts) == 2  # both really tried to write the index
    winners = [r for r in results if r.returncode == 0]
    if trees == "same":
        assert len(winners) == 2, [r.stderr for r in results]
        assert len({json.loads(r.stdout)["index_sha256"] for r in winners}) == 1
    else:
        assert len(winners) == 1, [r.stderr for r in results]
        loser = next(r for r in results if r.returncode != 0)
        won = json.loads(winners[0].stdout)
        assert loser.returncode == 1 and loser.stdout == ""
        assert f"{target.uri} already holds another tree (index.json sha256 {won['index_sha256']}" in loser.stderr
        winner_src = src_a if winners[0] is results[0] else src_b
        assert store(target.env, "pull", target.uri, tmp_path / "dest").returncode == 0
        assert tree(tmp_path / "dest") == tree(winner_src)
    assert store(target.env, "verify", target.uri).returncode == 0
    with pytest.raises(ClientError, match="PreconditionFailed"):  # what the loser's index PUT met
        raw_client(moto.url).put_object(Bucket=BUCKET, Key=f"{target.prefix}/{INDEX}", Body=b"{}", IfNoneMatch="*")


def test_two_pushes_racing_for_one_local_directory(tmp_path):
    both_checked = threading.Barrier(2)

    class Racing(LocalBackend):
        def put(self, key, source, sha256):
            if key == INDEX:
                both_checked.wait(timeout=60)  # both found no index; now both link theirs
            return super().put(key, source, sha256)

    srcs = [make_tree(tmp_path / "a"), make_tree(tmp_path / "b")]
    results = [None, None]

    def run(i):
        try:
            results[i] = push(srcs[i], Racing(tmp_path / "store"))
        except StoreError as exc:
            results[i] = exc
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    won = [r for r in results if isinstance(r, dict)]
    lost = [r for r in results if isinstance(r, StoreError)]
    assert len(won) == 1 and len(lost) == 1, results
    assert f"already holds another tree (index.json sha256 {won[0]['index_sha256']}" in str(lost[0])
    env = Target("local", tmp_path).env
    assert store(env, "verify", tmp_path / "store").returncode == 0


# ------------------------------------------------------------------ multipart parts carry their checksums


def test_multipart_parts_carry_sha256_checksums_and_the_complete_is_conditional(moto, tmp_path, monkeypatch):
    from nshard.evidence.store_s3 import S3Backend

    target = Target("s3", tmp_path, moto)
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(11 << 20)
    (src / "big.bin").write_bytes(data)
    key = object_key(hashlib.sha256(data).hexdigest())
    proxy = FaultProxy(moto.port)
    s3_env(monkeypatch, target.via(proxy))
    try:
        assert push(src, S3Backend(target.uri, part_bytes=PART_BYTES))["objects_written"] == 2
    finally:
        proxy.close()
    seen = [(m, p, h) for m, p, h in proxy.headers_seen if p.split("?")[0].endswith(key) and m in ("PUT", "POST")]
    create, *parts, complete = seen
    assert create[2].get("x-amz-checksum-algorithm") == "SHA256"
    assert len(parts) == 3
    for n, (_, path, headers) in enumerate(parts):
        piece = data[n * PART_BYTES:(n + 1) * PART_BYTES]
        assert f"partNumber={n + 1}" in path
        assert headers["x-amz-checksum-sha256"] == base64.b64encode(hashlib.sha256(piece).digest()).decode()
    assert complete[2].get("if-none-match") == "*"
    # What the server assembled, from the bytes it received: the same composite checksum as ours.
    head = raw_client(moto.url).head_object(Bucket=BUCKET, Key=f"{target.prefix}/{key}", ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"].split("-")[0] == composite_sha256(data, PART_BYTES)


def test_a_part_changed_in_transit_never_becomes_an_object(moto, tmp_path, monkeypatch):
    """AWS refuses a part whose bytes miss its ChecksumSHA256 (BadDigest); moto 5.2.5 does not check part
    checksums and assembles it. Either way no wrong object stays: the read-back removes it, and a re-push heals."""
    from nshard.evidence.store_s3 import S3Backend

    target = Target("s3", tmp_path, moto)
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(SIX_MIB)
    (src / "big.bin").write_bytes(data)
    key = object_key(hashlib.sha256(data).hexdigest())
    proxy = FaultProxy(moto.port, lambda m, p: "corrupt" if m == "PUT" and "partNumber=2" in p else None)
    s3_env(monkeypatch, target.via(proxy))
    try:
        with pytest.raises(StoreError):
            push(src, S3Backend(target.uri, part_bytes=PART_BYTES))
    finally:
        proxy.close()
    assert not target.raw_exists(key) and not target.raw_exists(INDEX)
    assert not raw_client(moto.url).list_multipart_uploads(Bucket=BUCKET, Prefix=target.prefix).get("Uploads")
    assert store(target.env, "push", src, target.uri).returncode == 0
    assert store(target.env, "verify", target.uri).returncode == 0
