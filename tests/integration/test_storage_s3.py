"""S3 object store through boto3 against a real S3-protocol server (moto) on loopback."""

from __future__ import annotations

import os
from urllib.parse import urlparse

import pytest

from infra.storage import RANGE_PIECE_BYTES, ObjectNotFound, S3Store, open_store
from tests.tcp_forwarder import Forwarder


def test_s3_roundtrip(s3_endpoint: str, s3_bucket: str) -> None:
    store = open_store(s3_bucket, endpoint_url=s3_endpoint)
    assert isinstance(store, S3Store)
    store.put("runs/r/step-000001/a.json", b'{"x":1}')
    store.put("runs/r/step-000002/b.bin", bytes(range(256)))
    assert store.get("runs/r/step-000001/a.json") == b'{"x":1}'
    assert store.get_range("runs/r/step-000002/b.bin", 10, 5) == bytes(range(10, 15))
    assert store.size("runs/r/step-000002/b.bin") == 256
    assert store.list("runs/r/") == ["runs/r/step-000001/a.json", "runs/r/step-000002/b.bin"]
    assert store.exists("runs/r/step-000001/a.json") and not store.exists("runs/r/none")
    store.delete("runs/r/step-000001/a.json")
    with pytest.raises(ObjectNotFound):
        store.get("runs/r/step-000001/a.json")


def test_s3_multipart(s3_endpoint: str, s3_bucket: str) -> None:
    store = S3Store(s3_bucket, endpoint_url=s3_endpoint, multipart_threshold=5 << 20)
    blob = bytes(range(256)) * (6 * 4096)  # 6 MiB -> multipart upload
    store.put("big.bin", blob)
    assert store.get("big.bin") == blob


def test_s3_missing_bucket_is_clear(s3_endpoint: str) -> None:
    store = S3Store("s3://no-such-bucket-xyz/p", endpoint_url=s3_endpoint)
    with pytest.raises(Exception, match="no-such-bucket-xyz"):
        store.put("k", b"v")


def test_iter_range_streams_pieces_and_resumes_a_dropped_body(s3_endpoint: str, s3_bucket: str) -> None:
    """Pieces come as they arrive; a connection cut mid-body is resumed from the next byte (a new
    ranged GET), so the pieces add up to the range exactly once."""
    blob = os.urandom(3 << 20)
    S3Store(s3_bucket, endpoint_url=s3_endpoint).put("blob.bin", blob)
    u = urlparse(s3_endpoint)
    proxy = Forwarder((str(u.hostname), int(u.port or 80)), cut_after=(1 << 20) + 12345, cuts=1)
    try:
        store = S3Store(s3_bucket, endpoint_url=proxy.url, outage_s=20)
        pieces = list(store.iter_range("blob.bin", 100, len(blob) - 200))
    finally:
        proxy.close()
    assert b"".join(pieces) == blob[100:-100]
    assert proxy.cut == 1 and proxy.connections >= 2
    assert len(pieces) >= (len(blob) - 200) // RANGE_PIECE_BYTES and max(map(len, pieces)) <= RANGE_PIECE_BYTES
    with pytest.raises(ObjectNotFound):
        list(S3Store(s3_bucket, endpoint_url=s3_endpoint).iter_range("none.bin", 0, 10))
