"""Object storage: the data plane between pipeline stages.

Two backends behind one small protocol, chosen by URI scheme:

- ``file:///abs/folder`` (default): a local folder. Every put is :func:`infra.atomicio.write_atomic`:
  a temporary file in the same folder, fsync-ed, renamed into place, then the folder fsync-ed, so a
  reader never sees a half-written object and a committed object survives a power loss. Temporary
  files (``.tmp-*``) are never listed or read as objects; those a killed writer left are removed
  when a store opens, once older than a minute (a live writer's are kept).
- ``s3://bucket/prefix`` through boto3 (endpoint URL configurable: AWS, MinIO, R2, moto...).
  S3 PUTs are atomic per object; large objects use multipart upload via boto3's transfer manager.

Keys are ``/``-separated relative paths. Every artefact is keyed by run id and step by its
producer (see :func:`run_key`), so any stage can be retried or resumed without redoing finished work.
Reading a missing key raises :class:`ObjectNotFound`.
"""

from __future__ import annotations

import functools
import io
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlparse

from infra.atomicio import is_temp_name, remove_stale_temps, write_atomic
from infra.backends import Registry
from infra.errors import DeltaloopError

T = TypeVar("T")


class StorageError(DeltaloopError):
    """An object-store operation failed (network, throttling, a full disk): trying again can help."""

    retryable = True


class ObjectNotFound(StorageError, KeyError):
    """The key does not exist (not retryable: the writer has not committed it)."""

    retryable = False

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "object not found"


class BucketNotFound(StorageError):
    """The S3 bucket of the store does not exist (a configuration error: retrying cannot help)."""

    retryable = False


@runtime_checkable
class ObjectStore(Protocol):
    """Minimal object-store interface used by every stage."""

    uri: str

    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def get_range(self, key: str, start: int, length: int) -> bytes: ...
    def iter_range(self, key: str, start: int, length: int) -> Iterator[bytes]: ...
    def exists(self, key: str) -> bool: ...
    def size(self, key: str) -> int: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def delete(self, key: str) -> None: ...


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or "\\" in key:
        raise ValueError(f"invalid object key {key!r}: must be a non-empty relative '/'-path")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid object key {key!r}: empty, '.' or '..' segment")
    if is_temp_name(parts[-1]):
        raise ValueError(f"invalid object key {key!r}: names starting with '.tmp-' are temporary files")
    return key


def _check_prefix(prefix: str) -> str:
    """A list prefix: like a key (:func:`_check_key`) but may be empty or end with '/'."""
    if prefix:
        _check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


class FileStore:
    """Objects as files under a root folder; durable atomic writes (:func:`infra.atomicio.write_atomic`)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.uri = "file://" + str(self.root)
        remove_stale_temps(self.root)  # what writers killed between write and rename left

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put(self, key: str, data: bytes) -> None:
        write_atomic(self._path(key), data, mode=0o600)  # owner-only, as the store's objects always are

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.uri}/{key} not found") from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as fh:
                fh.seek(start)
                return fh.read(length)
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.uri}/{key} not found") from None

    def iter_range(self, key: str, start: int, length: int) -> Iterator[bytes]:
        """:meth:`get_range`'s bytes as one piece: a local read does not arrive over time."""
        yield self.get_range(key, start, length)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.uri}/{key} not found") from None

    def list(self, prefix: str = "") -> list[str]:
        base = self.root
        out: list[str] = []
        start = base / _check_prefix(prefix).rstrip("/") if prefix else base
        if base != start.resolve() and base not in start.resolve().parents:
            raise ValueError(f"invalid list prefix {prefix!r}: outside the store")
        if prefix and not prefix.endswith("/") and not start.is_dir():
            start = start.parent
        if not start.exists():
            return []
        for dirpath, _dirs, files in os.walk(start):
            for name in files:
                if is_temp_name(name):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), base).replace(os.sep, "/")
                if rel.startswith(prefix):
                    out.append(rel)
        return sorted(out)

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass


class S3Store:
    """Objects in an S3 bucket under a prefix, through boto3.

    An endpoint that cannot be reached (a restarting server, a dropped connection, a timeout) is
    retried with backoff for up to ``outage_s`` seconds (:meth:`_call`) on top of boto3's own quick
    retries, so a storage server that restarts does not fail the stage that was talking to it; past
    that the failure is a :class:`StorageError` (retryable: the task is tried again)."""

    def __init__(
        self,
        uri: str,
        endpoint_url: str | None = None,
        region: str | None = None,
        multipart_threshold: int = 64 << 20,
        outage_s: float = 60.0,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"not an s3 URI: {uri!r} (expected s3://bucket/prefix)")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.uri = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        self._client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            config=Config(retries={"max_attempts": 5, "mode": "standard"}, max_pool_connections=32),
        )
        self._transfer = TransferConfig(multipart_threshold=multipart_threshold, max_concurrency=8)
        self._lock = threading.Lock()
        self.outage_s = outage_s

    def _call(self, key: str, request: Callable[[], T]) -> T:
        """Run one request; unreachable-endpoint errors are retried (0.25 s doubling to 4 s) until
        ``outage_s`` has passed, every other error is translated at once (:meth:`_err`)."""
        backoff = _Backoff(self.outage_s)
        while True:
            try:
                return request()
            except _unreachable() as exc:
                backoff.pause(self._err(exc, key))
            except Exception as exc:  # translate to our typed errors
                raise self._err(exc, key) from exc

    def _k(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _err(self, exc: Exception, key: str) -> Exception:
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                return ObjectNotFound(f"{self.uri}/{key} not found")
            if code == "NoSuchBucket":
                return BucketNotFound(f"bucket {self.bucket!r} does not exist ({self.uri})")
        return StorageError(f"{self.uri}/{key}: {exc}")

    def put(self, key: str, data: bytes) -> None:
        def request() -> None:
            if len(data) >= self._transfer.multipart_threshold:
                self._client.upload_fileobj(io.BytesIO(data), self.bucket, self._k(key), Config=self._transfer)
            else:
                self._client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data)

        self._call(key, request)

    def get(self, key: str) -> bytes:
        return self._call(key, lambda: self._client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"].read())

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        rng = f"bytes={start}-{start + length - 1}"
        return self._call(key, lambda: self._client.get_object(Bucket=self.bucket, Key=self._k(key),
                                                               Range=rng)["Body"].read())

    def iter_range(self, key: str, start: int, length: int) -> Iterator[bytes]:
        """:meth:`get_range`'s bytes in pieces of ~``RANGE_PIECE_BYTES`` as they arrive, so a caller
        can work on the first while the rest is on the wire. A connection that drops mid-body is
        resumed from the next byte not yet yielded (a new ranged GET), retried as :meth:`_call`."""
        end, pos = start + length, start
        backoff = _Backoff(self.outage_s)
        while pos < end:
            try:
                body = self._client.get_object(Bucket=self.bucket, Key=self._k(key),
                                               Range=f"bytes={pos}-{end - 1}")["Body"]
                try:
                    for piece in body.iter_chunks(RANGE_PIECE_BYTES):
                        pos += len(piece)
                        yield piece
                finally:
                    body.close()
                return
            except _unreachable() as exc:
                backoff.pause(self._err(exc, key))
            except Exception as exc:  # translate to our typed errors
                raise self._err(exc, key) from exc

    def exists(self, key: str) -> bool:
        try:
            self._call(key, lambda: self._client.head_object(Bucket=self.bucket, Key=self._k(key)))
            return True
        except ObjectNotFound:
            return False

    def size(self, key: str) -> int:
        head = self._call(key, lambda: self._client.head_object(Bucket=self.bucket, Key=self._k(key)))
        return int(head["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        if prefix.startswith("/") or ".." in prefix.split("/"):
            raise ValueError(f"invalid list prefix {prefix!r}")
        base = self.prefix + "/" if self.prefix else ""
        full = base + prefix
        strip = len(self.prefix) + 1 if self.prefix else 0

        def request() -> list[str]:
            out: list[str] = []
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                out.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
            return sorted(out)

        return self._call(prefix, request)

    def delete(self, key: str) -> None:
        self._call(key, lambda: self._client.delete_object(Bucket=self.bucket, Key=self._k(key)))

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (tests, first use against MinIO/moto)."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except Exception:
            self._client.create_bucket(Bucket=self.bucket)


#: Piece size of :meth:`S3Store.iter_range`: ~5 ms of a 50 MB/s link, a few frames of a delta.
RANGE_PIECE_BYTES = 256 << 10


class _Backoff:
    """Waits between retries of an unreachable endpoint: 0.25 s doubling to 4 s, for at most
    ``outage_s`` in all; then :meth:`pause` raises the error it is given."""

    def __init__(self, outage_s: float) -> None:
        self.deadline = time.monotonic() + outage_s
        self.delay = 0.25

    def pause(self, err: Exception) -> None:
        if time.monotonic() + self.delay > self.deadline:
            raise err
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 4.0)


@functools.cache
def _unreachable() -> tuple[type[Exception], ...]:
    """botocore's errors for an endpoint that could not be reached or dropped the connection,
    before or in the middle of a response body (imported on first use, an ``except`` clause
    evaluates it only when something was raised)."""
    from botocore.exceptions import ConnectionError as EndpointDown
    from botocore.exceptions import HTTPClientError, IncompleteReadError

    return (EndpointDown, HTTPClientError, IncompleteReadError)


def _file_store(uri: str, endpoint_url: str | None = None, region: str | None = None) -> FileStore:
    """``file:///abs``, ``file://relative`` or a plain path (endpoint and region do not apply)."""
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        return FileStore(uri)
    return FileStore(parsed.netloc + parsed.path if parsed.netloc else parsed.path)


#: URI scheme -> store (``""``, a plain path, is ``file``).
STORES: Registry[ObjectStore] = Registry("object-store scheme", {"file": _file_store, "s3": S3Store})


def open_store(uri: str, endpoint_url: str | None = None, region: str | None = None) -> ObjectStore:
    """Open an object store from a URI: ``file:///path``, a plain path, or ``s3://bucket/prefix``."""
    scheme = urlparse(uri).scheme or "file"
    try:
        factory = STORES.get(scheme)
    except ValueError as exc:
        raise ValueError(f"{exc} (in {uri!r})") from None
    return factory(uri, endpoint_url=endpoint_url, region=region)


def run_key(run_id: str, step: int | None, *parts: str) -> str:
    """Key of an artefact of run ``run_id`` at ``step`` (None = run-level)."""
    base = f"runs/{run_id}" if step is None else f"runs/{run_id}/step-{step:06d}"
    return "/".join([base, *parts])


def put_json(store: ObjectStore, key: str, obj: Any) -> None:
    """Write a JSON document."""
    store.put(key, json.dumps(obj, separators=(",", ":")).encode())


def get_json(store: ObjectStore, key: str) -> Any:
    """Read a JSON document."""
    return json.loads(store.get(key))


def iter_chunks(data: bytes, size: int) -> Iterator[bytes]:
    """Split ``data`` into ``size``-byte chunks (used by ranged/parallel transfers)."""
    for i in range(0, len(data), size):
        yield data[i : i + size]
