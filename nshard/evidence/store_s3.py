"""The S3 back-end of nshard.store: boto3 configured as AWS tools are, with bounded retries of transient errors.

Endpoint, region and credentials come only from the standard places (AWS_ENDPOINT_URL, AWS_PROFILE, the
environment, ~/.aws, instance roles). botocore's own retries are off so that every retry is counted and
reported here; error messages carry the operation, key and S3 error code, never credentials.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import sys
import time
from pathlib import Path

import boto3
import urllib3
from botocore import exceptions as boto_errors
from botocore.config import Config

from nshard.evidence.backend import BadInput, Sink, StoreError, backoff_s, hash_into, split_s3_uri
from nshard.files import CHUNK

TRANSIENT_CODES = {"RequestTimeout", "SlowDown", "Throttling", "ThrottlingException", "InternalError",
                   "ServiceUnavailable", "ConditionalRequestConflict"}  # 409: a racing conditional write, retry
TRANSIENT_ERRORS = (boto_errors.HTTPClientError, boto_errors.ConnectionError, boto_errors.IncompleteReadError,
                    boto_errors.FlexibleChecksumError, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)


def _status(exc: boto_errors.ClientError) -> int:
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)


def is_transient(exc: BaseException) -> bool:
    """5xx, 429, throttling, connection resets and timeouts; everything else (403, NoSuchBucket, ...) is permanent."""
    if isinstance(exc, boto_errors.ClientError):
        return _status(exc) >= 500 or _status(exc) == 429 or exc.response.get("Error", {}).get("Code") in TRANSIENT_CODES
    return isinstance(exc, TRANSIENT_ERRORS)


def taken(exc: BaseException) -> bool:
    """412 to an If-None-Match write: another writer created the key first."""
    return isinstance(exc, boto_errors.ClientError) and _status(exc) == 412


def sha256_b64(digest_hex: str) -> str:
    return base64.b64encode(bytes.fromhex(digest_hex)).decode()


def describe(exc: BaseException) -> str:
    if isinstance(exc, boto_errors.ClientError):
        error = exc.response.get("Error", {})
        return f"{error.get('Code', '?')} (HTTP {_status(exc)}): {error.get('Message', '')}".rstrip(": ")
    return f"{type(exc).__name__}: {exc}"


class S3Backend:
    """Objects under s3://bucket/prefix. Each request is one attempt; _call retries the transient failures."""

    def __init__(self, uri: str, *, attempts: int = 6, part_bytes: int = 64 << 20, connect_timeout_s: float = 10,
                 read_timeout_s: float = 60):
        self.bucket, self.prefix = split_s3_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.attempts, self.part_bytes, self.retries = attempts, part_bytes, 0
        self.written: dict[str, str] = {}  # key -> ETag of each object this backend created: delete() needs it
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

    def put(self, key: str, source: Path | bytes, sha256: str) -> bool:
        size = len(source) if isinstance(source, bytes) else Path(source).stat().st_size
        if size > self.part_bytes:
            return self._put_multipart(key, Path(source))
        # AWS S3 checks the body against this SHA-256 and refuses it if they differ (moto does not check it).
        # If-None-Match: a key that exists, written by anyone, is never replaced (412).

        def put_once():
            body = source if isinstance(source, bytes) else Path(source).read_bytes()
            try:
                return self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body, IfNoneMatch="*",
                                              ChecksumSHA256=sha256_b64(sha256))["ETag"]
            except boto_errors.ClientError as exc:
                if taken(exc):  # also what a retry sees when the first attempt's reply was lost
                    return None
                raise
        return self._created(key, self._call(f"PUT {self.uri}/{key}", put_once))

    def _created(self, key: str, etag: str | None) -> bool:
        if etag is not None:
            self.written[key] = etag
        return etag is not None

    def _put_multipart(self, key: str, path: Path) -> bool:
        where = dict(Bucket=self.bucket, Key=self._key(key))
        upload_id = self._call(f"start upload {self.uri}/{key}", lambda: self.client.create_multipart_upload(
            **where, ChecksumAlgorithm="SHA256")["UploadId"])
        try:
            parts = self._upload_parts(key, path, where, upload_id)

            def complete():
                try:
                    return self.client.complete_multipart_upload(**where, UploadId=upload_id, IfNoneMatch="*",
                                                                 MultipartUpload={"Parts": parts})["ETag"]
                except boto_errors.ClientError as exc:
                    if taken(exc):
                        return None
                    raise
            etag = self._call(f"complete upload {self.uri}/{key}", complete)
            if etag is None:
                self._abort(where, upload_id)
            return self._created(key, etag)
        except BaseException:
            self._abort(where, upload_id)
            raise

    def _upload_parts(self, key: str, path: Path, where: dict, upload_id: str) -> list[dict]:
        """Each part carries its own SHA-256, which S3 checks on arrival (a mismatch is refused: BadDigest)."""
        parts = []
        with open(path, "rb") as f:
            while chunk := f.read(self.part_bytes):
                number, checksum = len(parts) + 1, sha256_b64(hashlib.sha256(chunk).hexdigest())
                etag = self._call(f"PUT {self.uri}/{key} part {number}", lambda: self.client.upload_part(
                    **where, UploadId=upload_id, PartNumber=number, Body=chunk, ChecksumSHA256=checksum)["ETag"])
                parts.append({"PartNumber": number, "ETag": etag, "ChecksumSHA256": checksum})
        return parts

    def _abort(self, where: dict, upload_id: str) -> None:
        try:  # best effort: a dangling upload holds storage but is never visible as an object
            self.client.abort_multipart_upload(**where, UploadId=upload_id)
        except Exception:  # noqa: BLE001 -- best effort, as the line above says
            pass

    def delete(self, key: str) -> None:
        """Remove an object this backend wrote, and only if it is still that object (If-Match its ETag)."""
        if key not in self.written:
            raise StoreError(f"{self.uri}/{key} was not written by this push; it is never deleted")
        etag = self.written.pop(key)
        self._call(f"DELETE {self.uri}/{key}",
                   lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key), IfMatch=etag))

    def last_modified(self, key: str) -> tuple[str, str]:
        """The server's time of the object's creation (a HEAD's LastModified), not this machine's clock."""
        head = self._call(f"HEAD {self.uri}/{key}",
                          lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key)))
        return head["LastModified"].astimezone(datetime.timezone.utc).isoformat(), "s3-server"

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
