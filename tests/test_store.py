"""nshard.evidence.store against a local directory and a real S3-API server (moto) on loopback, with a fault-injecting proxy."""

import hashlib
import json
import os
import stat

import pytest

from nshard.evidence.store import object_key, pull, push
from s3server import FaultProxy
from stores import BUCKET, Target, aws_env, make_tree, raw_client, store, tree


@pytest.fixture(params=["local", "s3"])
def target(request, tmp_path):
    return Target(request.param, tmp_path, request.getfixturevalue("moto") if request.param == "s3" else None)


def test_push_readback_verify_pull_round_trip(target, tmp_path):
    src = make_tree(tmp_path / "src")
    pushed = store(target.env, "push", src, target.uri)
    assert pushed.returncode == 0, pushed.stderr
    summary = json.loads(pushed.stdout)
    assert summary["files"] == 3 and summary["objects_written"] == 3  # two objects and the index
    index = json.loads(target.raw_get("index.json"))
    assert hashlib.sha256(target.raw_get("index.json")).hexdigest() == summary["index_sha256"]
    for rel, data in tree(src).items():  # read back outside nshard: each path's object holds its bytes
        assert index["files"][rel] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        assert target.raw_get(object_key(index["files"][rel]["sha256"])) == data
    verified = store(target.env, "verify", target.uri)
    assert verified.returncode == 0 and json.loads(verified.stdout)["verified"], verified.stderr
    pulled = store(target.env, "pull", target.uri, tmp_path / "dest")
    assert pulled.returncode == 0, pulled.stderr
    assert tree(tmp_path / "dest") == tree(src)
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "dest").rglob("*") if p.is_file()} == {0o644}
    assert not [p for p in tmp_path.iterdir() if ".pull-" in p.name]


def test_second_push_is_a_noop(target, tmp_path):
    src = make_tree(tmp_path / "src")
    assert store(target.env, "push", src, target.uri).returncode == 0
    before = target.stamps()
    proxy = FaultProxy(target.moto.port) if target.kind == "s3" else None
    try:
        again = store(target.via(proxy) if proxy else target.env, "push", src, target.uri)
    finally:
        proxy and proxy.close()
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["objects_written"] == 0
    assert target.stamps() == before
    if proxy:  # nothing but reads reached the server: the existing objects were re-read, not re-sent
        methods = {m for m, _, _ in proxy.requests()}
        assert methods <= {"HEAD", "GET"} and "GET" in methods, proxy.requests()


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_verify_names_a_damaged_object_and_pull_refuses_it(target, tmp_path, damage):
    src = make_tree(tmp_path / "src")
    assert store(target.env, "push", src, target.uri).returncode == 0
    key = object_key(hashlib.sha256((src / "sub" / "b.bin").read_bytes()).hexdigest())
    data = bytearray(target.raw_get(key))
    if damage == "flip":
        data[12_345] ^= 0x04
        target.raw_put(key, bytes(data))
    elif target.kind == "local":
        (target.uri / key).unlink()
    else:
        raw_client(target.moto.url).delete_object(Bucket=BUCKET, Key=f"{target.prefix}/{key}")
    verified = store(target.env, "verify", target.uri)
    assert verified.returncode == 1
    assert key in verified.stderr and "sub/b.bin" in verified.stderr, verified.stderr
    assert "a.json" not in verified.stderr  # only the damaged object is named
    pulled = store(target.env, "pull", target.uri, tmp_path / "dest")
    assert pulled.returncode == 1 and key in pulled.stderr and "sub/b.bin" in pulled.stderr
    assert not (tmp_path / "dest").exists() and not [p for p in tmp_path.iterdir() if ".pull-" in p.name]
    if damage == "flip":  # a push never replaces a key's bytes, even to repair it: it fails naming the key
        again = store(target.env, "push", src, target.uri)
        assert again.returncode == 1 and key in again.stderr and "never overwritten" in again.stderr
        assert target.raw_get(key) == bytes(data)


def test_transient_failures_are_retried(moto, tmp_path):
    target = Target("s3", tmp_path, moto)
    src = make_tree(tmp_path / "src")
    seen = {"PUT": 0, "GET": 0, "HEAD": 0}

    def fault(method, path):
        seen[method] = seen.get(method, 0) + 1
        if method == "PUT":
            return "503" if seen["PUT"] <= 2 else None
        if method == "HEAD" and seen["HEAD"] == 2:
            return "reset"
        if method == "GET" and "/objects/" in path and seen["GET"] <= 2:
            return "reset-body" if seen["GET"] == 1 else "503"
        return None

    proxy = FaultProxy(moto.port, fault)
    try:
        pushed = store(target.via(proxy), "push", src, target.uri)
    finally:
        proxy.close()
    assert pushed.returncode == 0, pushed.stderr
    outcomes = [o for _, _, o in proxy.requests()]
    assert outcomes.count("503") == 3 and outcomes.count("reset") == 1 and outcomes.count("reset-body") == 1
    assert pushed.stderr.count("nshard.store: retry ") == 5, pushed.stderr
    assert store(target.env, "verify", target.uri).returncode == 0
    assert store(target.env, "pull", target.uri, tmp_path / "dest").returncode == 0
    assert tree(tmp_path / "dest") == tree(src)


def test_an_upload_changed_in_transit_is_caught_by_the_read_back(moto, tmp_path):
    target = Target("s3", tmp_path, moto)
    src = make_tree(tmp_path / "src")
    proxy = FaultProxy(moto.port, lambda m, p: "corrupt" if m == "PUT" and "/objects/" in p else None)
    try:
        pushed = store(target.via(proxy), "push", src, target.uri)
    finally:
        proxy.close()
    assert pushed.returncode == 1 and pushed.stdout == "" and "read-back of s3://" in pushed.stderr, pushed.stderr
    assert not target.raw_exists("index.json")
    verified = store(target.env, "verify", target.uri)
    assert verified.returncode == 1 and "no index.json" in verified.stderr


def test_a_read_timeout_is_retried(moto, tmp_path, monkeypatch):
    from nshard.evidence.store_s3 import S3Backend

    target = Target("s3", tmp_path, moto)
    src = make_tree(tmp_path / "src")
    gets = []
    proxy = FaultProxy(moto.port, lambda m, p: (gets.append(p), "slow:3")[1] if m == "GET" and not gets else None)
    try:
        for k, v in target.via(proxy).items():
            monkeypatch.setenv(k, v)  # the environment an operator sets; the client itself is boto3's own
        backend = S3Backend(target.uri, read_timeout_s=0.5)
        assert push(src, backend)["files"] == 3
    finally:
        proxy.close()
    assert backend.retries == 1 and len(gets) == 1
    assert store(target.env, "verify", target.uri).returncode == 0


def test_large_objects_go_up_in_verified_parts(moto, tmp_path, monkeypatch):
    from nshard.evidence.store_s3 import S3Backend

    target = Target("s3", tmp_path, moto)
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(11 << 20))
    for k, v in target.env.items():
        monkeypatch.setenv(k, v)
    assert push(src, S3Backend(target.uri, part_bytes=5 << 20))["objects_written"] == 2
    key = object_key(hashlib.sha256((src / "big.bin").read_bytes()).hexdigest())
    head = raw_client(moto.url).head_object(Bucket=BUCKET, Key=f"{target.prefix}/{key}")
    assert head["ETag"].strip('"').endswith("-3")  # three parts
    pull(S3Backend(target.uri), tmp_path / "dest")
    assert tree(tmp_path / "dest") == tree(src)


@pytest.mark.parametrize("failure", ["no-bucket", "403", "503-always"])
def test_a_permanent_failure_exits_nonzero_and_claims_nothing(moto, tmp_path, failure):
    target = Target("s3", tmp_path, moto)
    src = make_tree(tmp_path / "src")
    proxy = None
    if failure == "no-bucket":
        env, uri = target.env, f"s3://nshard-no-such-bucket/{target.prefix}"
    else:
        proxy = FaultProxy(moto.port, lambda m, p: ("403" if failure == "403" else "503") if m == "PUT" else None)
        env, uri = target.via(proxy), target.uri
    try:
        pushed = store(env, "push", src, uri)
    finally:
        proxy and proxy.close()
    assert pushed.returncode == 1 and pushed.stdout == ""
    lines = pushed.stderr.strip().splitlines()
    assert lines[-1].startswith("nshard.store: error: ")
    expected = {"no-bucket": "bucket nshard-no-such-bucket does not exist", "403": "AccessDenied (HTTP 403)",
                "503-always": "still failing after 6 attempts"}[failure]
    assert expected in lines[-1], pushed.stderr
    if failure == "403":  # permanent: one attempt, no retry
        assert len(proxy.requests("PUT")) == 1 and "retry" not in pushed.stderr
    if failure == "503-always":  # bounded: exactly `attempts` tries of the first object
        assert len(proxy.requests("PUT")) == 6
    assert not target.raw_exists("index.json")
    verified = store(target.env, "verify", target.uri)
    assert verified.returncode == 1 and "no index.json" in verified.stderr


def test_bad_input_is_one_line_and_exit_2(tmp_path, moto):
    env = aws_env(moto.url, tmp_path)
    make_tree(tmp_path / "src")
    (tmp_path / "dest").mkdir()
    for args in [("push", tmp_path / "missing", tmp_path / "s"), ("push", tmp_path / "src", "ftp://x/y"),
                 ("push", tmp_path / "src", "s3://Bad_Bucket/p"), ("verify", tmp_path / "not-a-store"),
                 ("pull", tmp_path / "src", tmp_path / "dest"), ("frobnicate",)]:
        proc = store(env, *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("nshard.store: error: "), proc.stderr
