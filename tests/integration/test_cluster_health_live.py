"""Health checks for real through the local provider (torchrun, gloo): pass, and fail by name."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from infra.cluster import create_provider
from infra.cluster.health import HealthCheckFailed, check_health, provision
from infra.config import ClusterConfig

pytestmark = pytest.mark.slow


def test_local_health_report(tmp_path: Path) -> None:
    cfg = ClusterConfig(type="local", ranks=2, health={"probe_mb": 1, "iters": 3})
    report = check_health(create_provider(cfg), cfg, log_dir=str(tmp_path))
    assert report.world_size == 2 and report.problems == []
    assert [r.rank for r in report.ranks] == [0, 1]
    assert all(r.hostname == socket.gethostname() and r.free_disk_gb > 0 and r.free_memory_gb > 0 for r in report.ranks)
    assert report.ranks[1].latency_ms is not None and report.ranks[1].latency_ms > 0
    assert report.allreduce_bandwidth_gbps > 0 and report.allreduce_latency_ms > 0
    saved = json.loads(next(tmp_path.glob("health-*.json")).read_text())
    assert saved["world_size"] == 2


def test_unmeetable_threshold_stops_provisioning(tmp_path: Path) -> None:
    cfg = ClusterConfig(type="local", ranks=2, health={"min_free_memory_gb": 60000, "probe_mb": 1, "iters": 2})
    with pytest.raises(HealthCheckFailed) as err:
        provision(cfg, str(tmp_path))
    msg = str(err.value)
    assert "before training" in msg and f"node {socket.gethostname()} rank 0: free memory" in msg
    assert err.value.report is not None and len(err.value.report.problems) == 2


def test_health_disabled_skips(tmp_path: Path) -> None:
    cfg = ClusterConfig(type="local", ranks=1, health={"enabled": False})
    provider, report = provision(cfg, str(tmp_path))
    assert report is None and provider.world_size == 1
