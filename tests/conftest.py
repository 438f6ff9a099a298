"""Shared fixtures: hermetic tool state, and real services on loopback (S3 via moto, MLflow sqlite)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("DELTALOOP_STATE", ROOT / ".state"))
os.environ.setdefault("DELTALOOP_STATE", str(STATE))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist each worker gets its own Prefect home: an ephemeral Prefect server keeps its
    # sqlite database there, and two servers on one database file block each other's writes.
    base = os.environ.get("PREFECT_HOME", str(STATE / "prefect"))
    os.environ["PREFECT_HOME"] = f"{base}-{os.environ['PYTEST_XDIST_WORKER']}"
from infra.process_env import set_defaults  # noqa: E402

set_defaults()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-protocol server (moto) on a loopback port for the whole session."""
    from bench.s3local import moto_server

    with moto_server(timeout_s=30) as (host, port):
        yield f"http://{host}:{port}"


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


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    """A one-rank gloo process group in this process (checkpoint save/restore are collectives)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
