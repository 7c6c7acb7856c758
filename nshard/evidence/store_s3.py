"""The S3 back-end of nshard.store: boto3 configured as AWS tools are, with bounded retries of transient errors.

Endpoint, region and credentials come only from the standard places (AWS_ENDPOINT_URL, AWS_PROFILE, the
environment, ~/.aws, instance roles). botocore's own retries are off so that every retry is counted and
reported here; error messages carry the operation, key and S3 error code, never credentials.
"""

from __future__ import annotations

import base64
import re
import sys
import time
from pathlib import Path

import boto3
import urllib3
from botocore import exceptions as boto_errors
from botocore.config import Config

from nshard.evidence.backend import BadInput, Sink, StoreError, backoff_s, hash_into
from nshard.files import CHUNK

TRANSIENT_CODES = {"RequestTimeout", "SlowDown", "Throttling", "ThrottlingException", "InternalError",
                   "ServiceUnavailable"}
TRANSIENT_ERRORS = (boto_errors.HTTPClientError, boto_errors.ConnectionError, boto_errors.IncompleteReadError,
                    boto_errors.FlexibleChecksumError, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)


def _status(exc: boto_errors.ClientError) -> int:
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)


def is_transient(exc: BaseException) -> bool:
    """5xx, 429, throttling, connection resets and timeouts; everything else (403, NoSuchBucket, ...) is permanent."""
    if isinstance(exc, boto_errors.ClientError):
        return _status(exc) >= 500 or _status(exc) == 429 or exc.response.get("Error", {}).get("Code") in TRANSIENT_CODES
    return isinstance(exc, TRANSIENT_ERRORS)


def describe(exc: BaseException) -> str:
    if isinstance(exc, boto_errors.ClientError):
        error = exc.response.get("Error", {})
        return f"{error.get('Code', '?')} (HTTP {_status(exc)}): {error.get('Message', '')}".rstrip(": ")
    return f"{type(exc).__name__}: {exc}"


class S3Backend:
    """Objects under s3://bucket/prefix. Each request is one attempt; _call retries the transient failures."""

    def __init__(self, uri: str, *, attempts: int = 6, part_bytes: int = 64 << 20, connect_timeout_s: float = 10,
                 read_timeout_s: float = 60):
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
            raise BadInput(f"{uri!r}: expected s3://bucket/prefix with a valid bucket name")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.attempts, self.part_bytes, self.retries = attempts, part_bytes, 0
        try:
            session = boto3.session.Session()  # AWS_PROFILE, environment, config files, instance roles
        except boto_errors.ProfileNotFound as exc:
            raise BadInput(str(exc)) from None
        self.client = session.client("s3", config=Config(retries={"total_max_attempts": 1},
                                                         connect_timeout=connect_timeout_s,
                                                         read_timeout=read_timeout_s))

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn):
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except StoreError:
                raise
            except Exception as exc:  # noqa: BLE001 -- sorted into transient and permanent just below
                if not is_transient(exc):
                    raise StoreError(f"{what}: {describe(exc)}") from None
                if attempt == self.attempts:
                    raise StoreError(f"{what}: still failing after {attempt} attempts: {describe(exc)}") from None
                delay = backoff_s(attempt)
                self.retries += 1
                print(f"nshard.store: retry {attempt}/{self.attempts - 1} of {what} in {delay:.2f} s "
                      f"after {describe(exc)}", file=sys.stderr, flush=True)
                time.sleep(delay)

    def check(self, writing: bool) -> None:
        def head():
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except boto_errors.ClientError as exc:
                if _status(exc) in (403, 404):  # a HEAD has no error body: name the two usual causes
                    why = "does not exist" if _status(exc) == 404 else "denies access to these credentials"
                    raise StoreError(f"bucket {self.bucket} {why} ({describe(exc)})") from None
                raise
        self._call(f"HEAD bucket {self.bucket}", head)

    def size(self, key: str) -> int | None:
        def head():
            try:
                return self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
            except boto_errors.ClientError as exc:
                if _status(exc) == 404:
                    return None
                raise
        return self._call(f"HEAD {self.uri}/{key}", head)

    def put(self, key: str, source: Path | bytes, sha256: str) -> None:
        size = len(source) if isinstance(source, bytes) else Path(source).stat().st_size
        if size > self.part_bytes:
            return self._put_multipart(key, Path(source))
        # AWS S3 checks the body against this SHA-256 and refuses it if they differ (moto does not check it).
        checksum = base64.b64encode(bytes.fromhex(sha256)).decode()

        def put_once():
            body = source if isinstance(source, bytes) else Path(source).read_bytes()
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body, ChecksumSHA256=checksum)
        self._call(f"PUT {self.uri}/{key}", put_once)

    def _put_multipart(self, key: str, path: Path) -> None:
        where = dict(Bucket=self.bucket, Key=self._key(key))
        upload_id = self._call(f"start upload {self.uri}/{key}",
                               lambda: self.client.create_multipart_upload(**where)["UploadId"])
        try:
            parts = []
            with open(path, "rb") as f:
                while chunk := f.read(self.part_bytes):
                    number = len(parts) + 1
                    etag = self._call(f"PUT {self.uri}/{key} part {number}", lambda: self.client.upload_part(
                        **where, UploadId=upload_id, PartNumber=number, Body=chunk)["ETag"])
                    parts.append({"PartNumber": number, "ETag": etag})
            self._call(f"complete upload {self.uri}/{key}", lambda: self.client.complete_multipart_upload(
                **where, UploadId=upload_id, MultipartUpload={"Parts": parts}))
        except BaseException:
            try:  # best effort: a dangling upload holds storage but is never visible as an object
                self.client.abort_multipart_upload(**where, UploadId=upload_id)
            except Exception:  # noqa: BLE001
                pass
            raise

    def read_to(self, key: str, sink: Sink) -> str:
        def get():
            sink.reset()
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
            try:
                return hash_into(body.iter_chunks(CHUNK), sink)
            finally:
                body.close()
        return self._call(f"GET {self.uri}/{key}", get)

    def keys(self, prefix: str) -> list[str]:
        def listing():
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
            strip = len(self._key(""))
            return [obj["Key"][strip:] for page in pages for obj in page.get("Contents", [])]
        return self._call(f"LIST {self.uri}/{prefix}", listing)
