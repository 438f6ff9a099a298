"""Shared fixtures: hermetic tool state, and real services on loopback (S3 via moto, MLflow sqlite)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("DELTALOOP_STATE", ROOT / ".state"))
os.environ.setdefault("DELTALOOP_STATE", str(STATE))
from deltaloop.env import set_defaults  # noqa: E402

set_defaults()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-protocol server (moto) on a loopback port for the whole session."""
    port = _free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("moto server did not start")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture()
def s3_bucket(s3_endpoint: str, request: pytest.FixtureRequest) -> str:
    """A fresh bucket URI (``s3://bucket/prefix``) on the moto server."""
    import boto3

    name = f"t-{abs(hash(request.node.nodeid)) % 10**10}-{int(time.time() * 1000) % 10**6}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return f"s3://{name}/prefix"


@pytest.fixture()
def mlflow_uri(tmp_path: Path) -> str:
    """A fresh MLflow sqlite store (tracking + registry)."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"
