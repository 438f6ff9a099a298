"""ClusterConfig: provider-specific fields and their cross-field rules."""

from __future__ import annotations

import pytest

from infra.config import ClusterConfig, ConfigError, HostSpec, select_hosts, validate_config


def test_defaults_are_local() -> None:
    cfg = ClusterConfig()
    assert cfg.type == "local" and cfg.health.enabled and cfg.hosts == []


def test_hosts_needs_exactly_one_source() -> None:
    with pytest.raises(ValueError, match="exactly one of cluster.hostfile or cluster.hosts"):
        ClusterConfig(type="hosts")
    with pytest.raises(ValueError, match="exactly one"):
        ClusterConfig(type="hosts", hostfile="h.txt", hosts=[{"host": "a"}])


def test_hosts_fields_rejected_for_other_types() -> None:
    with pytest.raises(ValueError, match="only used with cluster.type 'hosts'"):
        ClusterConfig(type="local", hosts=[{"host": "a"}])


def test_slots_must_add_up_to_ranks() -> None:
    with pytest.raises(ValueError, match=r"a:2 \+ b:2 = 4"):
        ClusterConfig(type="hosts", ranks=3, hosts=[{"host": "a", "slots": 2}, {"host": "b", "slots": 2}])
    cfg = ClusterConfig(type="hosts", ranks=3, hosts=[{"host": "a", "slots": 2}, {"host": "b"}, {"host": "c"}])
    used, spares = select_hosts(cfg.hosts, cfg.ranks)
    assert [h.host for h in used] == ["a", "b"] and [h.host for h in spares] == ["c"]


def test_duplicate_host_rejected() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        select_hosts([HostSpec(host="a"), HostSpec(host="a")], 2)


def test_host_spec_bounds() -> None:
    with pytest.raises(ValueError):
        HostSpec(host="a; rm -rf /")
    with pytest.raises(ValueError):
        HostSpec(host="a", ssh_port=0)
    assert HostSpec(host="h", addr="10.0.0.1").node_addr == "10.0.0.1"


def test_kubernetes_rules() -> None:
    with pytest.raises(ValueError, match="image is required"):
        ClusterConfig(type="kubernetes", ranks=1)
    with pytest.raises(ValueError, match=r"nodes \* procs_per_node"):
        ClusterConfig(type="kubernetes", ranks=3, kubernetes={"image": "x", "nodes": 2})
    with pytest.raises(ValueError, match="nccl"):
        ClusterConfig(type="kubernetes", ranks=2, backend="nccl", kubernetes={"image": "x", "nodes": 2})
    with pytest.raises(ValueError):
        ClusterConfig(type="kubernetes", ranks=1, kubernetes={"image": "x", "job_name": "Bad_Name"})
    ok = ClusterConfig(type="kubernetes", ranks=4, kubernetes={"image": "x", "nodes": 2, "procs_per_node": 2})
    assert ok.kubernetes.nodes == 2


def test_errors_surface_through_load() -> None:
    with pytest.raises(ConfigError, match="cluster"):
        validate_config({"cluster": {"type": "hosts"}})


def test_health_thresholds_bounded() -> None:
    with pytest.raises(ValueError):
        ClusterConfig(health={"min_free_disk_gb": -1})
    with pytest.raises(ValueError):
        ClusterConfig(health={"max_latency_ms": 0})
