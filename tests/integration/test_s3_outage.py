"""An S3 endpoint that goes away for seconds is waited for, not a failed stage (issue #16, the
S3-restart fault).

A real moto S3 server sits behind a loopback forwarder on a fixed port; the forwarder is torn down
(listener and every open connection closed, so the port refuses connections as a restarting server
does) and brought back on the same port 3 s later, with the server's objects intact. A ``put``
issued while it is down must succeed once it is back and read back intact; before, boto3's own
retries gave up within ~2 s and the stage failed with a ``StorageError``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from infra.proc import free_port
from infra.storage import StorageError, open_store
from tests.tcp_forwarder import Forwarder


def test_put_during_an_outage_waits_for_the_endpoint(s3_endpoint: str, tmp_path: Path) -> None:
    import boto3

    host, port = s3_endpoint.removeprefix("http://").split(":")
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket="outage")
    front = free_port()
    fwd = [Forwarder((host, int(port)), front)]
    store = open_store("s3://outage/p", endpoint_url=f"http://127.0.0.1:{front}")
    try:
        store.put("warm/a.json", b"{}")
        fwd[0].close()

        def come_back() -> None:
            time.sleep(3.0)
            fwd.append(Forwarder((host, int(port)), front))

        thread = threading.Thread(target=come_back)
        thread.start()
        t0 = time.monotonic()
        data = os.urandom(4096)
        store.put("step-000001/train.json", data)  # issued while the endpoint is down
        waited = time.monotonic() - t0
        thread.join()
        assert store.get("step-000001/train.json") == data and store.get("warm/a.json") == b"{}"
        assert waited >= 2.0  # it really was down when the put started
        fwd[-1].close()
        store.outage_s = 1.0  # type: ignore[attr-defined]
        with pytest.raises(StorageError):  # an outage longer than outage_s is a (retryable) StorageError
            store.get("warm/a.json")
    finally:
        for f in fwd:
            f.close()
