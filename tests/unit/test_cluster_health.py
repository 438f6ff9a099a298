"""Health thresholds on synthetic reports: every violation names its node."""

from __future__ import annotations

from infra.cluster.health import HealthReport, RankHealth, evaluate, violations
from infra.config import HealthConfig


def _report(**overrides: float) -> HealthReport:
    ranks = [
        RankHealth(0, 0, "gpu-a", "10.0.0.1", "cpu", 30.0, 100.0, "/w"),
        RankHealth(1, 0, "gpu-b", "10.0.0.2", "cpu", 30.0, 100.0, "/w", latency_ms=0.3, bandwidth_gbps=5.0),
    ]
    for key, value in overrides.items():
        setattr(ranks[1], key, value)
    return HealthReport(world_size=2, ranks=ranks, allreduce_latency_ms=0.2, allreduce_bandwidth_gbps=4.0,
                        probe_mb=4, seconds=0.1)


def test_healthy_report_passes() -> None:
    assert evaluate(_report(), HealthConfig(min_bandwidth_gbps=1.0)) == []


def test_each_threshold_names_the_node() -> None:
    th = HealthConfig(min_free_memory_gb=16, min_free_disk_gb=10, max_latency_ms=1, min_bandwidth_gbps=1)
    found = violations(_report(free_memory_gb=2.0, free_disk_gb=0.001, latency_ms=40.0, bandwidth_gbps=0.1), th)
    assert [rank for rank, _ in found] == [1, 1, 1, 1]
    text = "\n".join(msg for _, msg in found)
    assert text.count("node gpu-b (10.0.0.2) rank 1") == 4
    for needle in ("free memory 2.000 GB", "free disk 0.001 GB at /w", "latency to rank 0 40.00 ms", "0.100 GB/s"):
        assert needle in text


def test_group_bandwidth_points_at_slowest_link() -> None:
    report = _report()
    report.allreduce_bandwidth_gbps = 0.01
    (msg,) = evaluate(report, HealthConfig(min_bandwidth_gbps=1.0))
    assert "all-reduce bus bandwidth" in msg and "gpu-b" in msg
    assert evaluate(report, HealthConfig(min_bandwidth_gbps=0)) == []  # 0 = not checked


def test_json_round_trip() -> None:
    report = _report()
    assert HealthReport.from_json(report.to_json()) == report
