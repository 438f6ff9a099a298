"""S3 object store through boto3 against a real S3-protocol server (moto) on loopback."""

from __future__ import annotations

import pytest

from infra.storage import ObjectNotFound, S3Store, open_store


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
