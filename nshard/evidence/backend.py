"""What every store back-end shares: the errors, the Backend protocol, the sinks read bytes go to, hashing while
streaming, and the retry back-off. nshard/evidence/store.py (the local back-end and the content-addressed rules)
and nshard/evidence/store_s3.py both import it; neither imports the other at load time."""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path
from typing import Iterator, Protocol


class StoreError(RuntimeError):
    """The store or the network failed; nothing was claimed (exit 1)."""


class BadInput(StoreError):
    """A bad argument: missing source, malformed URI, existing destination (exit 2)."""


class Backend(Protocol):
    """Raw key/value primitives; the content-addressed rules live in put_verified / push / verify / pull."""
    uri: str

    def check(self, writing: bool) -> None: ...           # the store is reachable (and exists, unless writing)
    def size(self, key: str) -> int | None: ...           # None when the key does not exist
    def put(self, key: str, source: Path | bytes, sha256: str) -> bool: ...  # False: the key existed, left as it was
    def delete(self, key: str) -> None: ...               # only a key this backend object wrote itself
    def read_to(self, key: str, sink: Sink) -> str: ...   # stream every byte into sink; returns their SHA-256
    def keys(self, prefix: str) -> Iterator[str]: ...
    def last_modified(self, key: str) -> tuple[str, str]: ...  # (ISO 8601 UTC time, "s3-server" or "local")


S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


def split_s3_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/prefix -> (bucket, prefix without outer slashes); BadInput for a malformed bucket name."""
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not uri.startswith("s3://") or not S3_BUCKET.fullmatch(bucket):
        raise BadInput(f"{uri!r}: expected s3://bucket/prefix with a valid bucket name")
    return bucket, prefix.strip("/")


class Sink:
    """Where read bytes go; reset() before a retried read starts again. This one discards them."""

    def write(self, chunk: bytes) -> None:
        pass

    def reset(self) -> None:
        pass


class MemorySink(Sink):
    def __init__(self):
        self.data = bytearray()

    def write(self, chunk: bytes) -> None:
        self.data += chunk

    def reset(self) -> None:
        self.data.clear()


class FileSink(Sink):
    def __init__(self, f):
        self.f = f

    def write(self, chunk: bytes) -> None:
        self.f.write(chunk)

    def reset(self) -> None:
        self.f.seek(0)
        self.f.truncate()


def hash_into(chunks, sink) -> str:
    """SHA-256 of the chunks, each also written into `sink`."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
        sink.write(chunk)
    return h.hexdigest()


def backoff_s(attempt: int, base_s: float = 0.2, cap_s: float = 8.0) -> float:
    """Exponential with jitter: half the step fixed, half random (attempt counts from 1)."""
    step = min(cap_s, base_s * 2 ** (attempt - 1))
    return step / 2 + random.random() * step / 2
