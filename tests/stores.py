"""What the store tests share: the moto bucket's client and credentials, an operator's AWS environment, the store
CLI, sample trees, and a Target (a local directory or a fresh prefix in the moto bucket)."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3

from s3server import FaultProxy

REPO = Path(__file__).resolve().parent.parent
ACCESS_KEY, SECRET_KEY = "AKIANSHARDTESTONLY", "nshard-test-secret-must-never-be-printed"
BUCKET = "nshard-test"


def raw_client(url: str):
    """A plain boto3 client straight to moto, for the test's own reads and tampering (bypasses nshard)."""
    return boto3.client("s3", endpoint_url=url, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                        region_name="us-east-1")


def aws_env(endpoint: str, tmp_path: Path) -> dict:
    """How an operator configures AWS tools: environment only; no ~/.aws files of this machine leak in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"), "PYTHONPATH": str(REPO)}


def store(env: dict, *args) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "nshard.evidence.store", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=120)
    for stream in (proc.stdout, proc.stderr):
        assert SECRET_KEY not in stream and ACCESS_KEY not in stream, "credentials in the output"
    return proc


def make_tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.json").write_text('{"a": 1}\n')
    (root / "sub" / "b.bin").write_bytes(os.urandom(70_000))
    (root / "sub" / "same-as-a.json").write_text('{"a": 1}\n')  # one object for two paths
    return root


def tree(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class Target:
    """One store location: a local directory, or a fresh prefix in the moto bucket (direct, or via a proxy)."""

    def __init__(self, kind, tmp_path, moto=None):
        self.kind, self.tmp_path, self.moto = kind, tmp_path, moto
        self.prefix = f"t-{uuid.uuid4().hex[:12]}"
        self.uri = tmp_path / "store" if kind == "local" else f"s3://{BUCKET}/{self.prefix}"
        self.env = aws_env(moto.url if moto else "http://127.0.0.1:9", tmp_path)

    def via(self, proxy: FaultProxy) -> dict:
        return {**self.env, "AWS_ENDPOINT_URL": proxy.url}

    def raw_get(self, key: str) -> bytes:
        if self.kind == "local":
            return (self.uri / key).read_bytes()
        return raw_client(self.moto.url).get_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}")["Body"].read()

    def raw_put(self, key: str, data: bytes) -> None:
        if self.kind == "local":
            (self.uri / key).chmod(0o644)
            (self.uri / key).write_bytes(data)
        else:
            raw_client(self.moto.url).put_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}", Body=data)

    def raw_exists(self, key: str) -> bool:
        if self.kind == "local":
            return (self.uri / key).exists()
        listed = raw_client(self.moto.url).list_objects_v2(Bucket=BUCKET, Prefix=f"{self.prefix}/{key}")
        return listed.get("KeyCount", 0) > 0

    def stamps(self) -> dict:
        """Per stored key: what changes when it is written again (inode+mtime; ETag+LastModified)."""
        if self.kind == "local":
            return {p.as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns) for p in self.uri.rglob("*") if p.is_file()}
        listed = raw_client(self.moto.url).list_objects_v2(Bucket=BUCKET, Prefix=self.prefix)["Contents"]
        return {o["Key"]: (o["ETag"], o["LastModified"]) for o in listed}
