"""The ``hosts`` provider for real: fake hosts made of network namespaces, each running sshd.

Needs root (``ip netns``, mounts); ``scripts/setup_netns_hosts.sh install`` is run when sshd is
missing. Three hosts are made (the third is a spare); host 1 has a 1 MiB tmpfs over the disk-check
folder, so it fails a free-disk threshold. The fixture removes namespaces and sshds afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from infra.cluster import create_provider
from infra.cluster.health import HealthCheckFailed, check_health, provision
from infra.cluster.hosts import REPO_ROOT, HostsGroup
from infra.config import ClusterConfig
from tests.integration.netns import NetnsCluster

pytestmark = pytest.mark.slow
JOB = "tests.integration.test_cluster_job"


@pytest.fixture(scope="module")
def fake_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 to create network namespaces")
    if not os.path.exists("/usr/sbin/sshd"):
        subprocess.run(["bash", f"{REPO_ROOT}/scripts/setup_netns_hosts.sh", "install"], check=True)
    wd = tmp_path_factory.mktemp("netns")
    scratch = wd / "scratch"
    scratch.mkdir()
    cluster = NetnsCluster(workdir=str(wd), n_hosts=3, tiny_disks={1: str(scratch)})
    with cluster:
        yield cluster
    assert not any(h.netns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
                   for h in cluster.hosts), "namespaces left behind"


def _cfg(cl: NetnsCluster, hosts: list[int], **kw: object) -> ClusterConfig:
    entries = cl.cluster_hosts()
    return ClusterConfig.model_validate({
        "type": "hosts", "ranks": 2, "hosts": [entries[i] for i in hosts], "ssh_key": cl.key,
        "ssh_options": cl.ssh_options(), "start_timeout_s": 300, **kw,
    })


def _wait(handle: HostsGroup, timeout: float = 400) -> int | None:
    deadline = time.monotonic() + timeout
    while handle.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return handle.poll()


def _ranks_running(cl: NetnsCluster) -> list[str]:
    """Command lines of rank processes (torchrun or the job) still alive in our namespaces."""
    found = []
    for h in cl.hosts:
        pids = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "torch.distributed.run" in cmd or JOB in cmd or "infra.cluster.hosts agent" in cmd:
                found.append(f"{h.hostname}: {cmd}")
    return found


def _wait_no_ranks(cl: NetnsCluster, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _ranks_running(cl)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_hosts_train_as_one_group(fake_hosts: NetnsCluster, tmp_path: Path, rendezvous: str) -> None:
    cfg = _cfg(fake_hosts, [0, 1], rendezvous=rendezvous)
    out = tmp_path / "job.json"
    handle = create_provider(cfg).launch(JOB, ["--out", str(out)], {"PYTHONUNBUFFERED": "1"}, str(tmp_path / "logs"))
    try:
        assert _wait(handle) == 0, handle.describe() + "\n" + "\n".join(Path(p).read_text() for p in handle.logs)
    finally:
        handle.terminate()
    res = json.loads(out.read_text())
    h0, h1 = fake_hosts.hosts[0], fake_hosts.hosts[1]
    assert res["world_size"] == 2
    assert res["hostnames"] == [h0.hostname, h1.hostname]  # one rank on each namespace host
    assert res["allreduce"] == [3.0] * 4  # 1 + 2 across the two hosts
    assert res["params_equal"] and res["losses"][-1] < res["losses"][0]
    assert res["master_addr"] == handle.master_addr == h0.addr


def test_tunnel_reaches_rank0_network(fake_hosts: NetnsCluster, tmp_path: Path) -> None:
    """The flow (root namespace) has no route to the hosts; a tunnel through rank 0's host does."""
    import socket

    cfg = _cfg(fake_hosts, [0, 1])
    handle = create_provider(cfg).launch(JOB, ["--out", str(tmp_path / "o.json"), "--steps", "1000000000"], {},
                                         str(tmp_path / "logs"))
    try:
        host, port = handle.tunnel(fake_hosts.hosts[1].addr, 22)  # any service on the hosts' network
        with socket.create_connection((host, port), timeout=10) as conn:
            assert conn.recv(64).startswith(b"SSH-2.0")
    finally:
        handle.terminate()
    assert all(t.poll() is not None for t in handle.tunnels)


def test_terminate_and_dead_man_switch_leave_nothing(fake_hosts: NetnsCluster, tmp_path: Path) -> None:
    cfg = _cfg(fake_hosts, [0, 1])
    args = ["--out", str(tmp_path / "never.json"), "--steps", "1000000000"]
    provider = create_provider(cfg)
    handle = provider.launch(JOB, args, {}, str(tmp_path / "a"))
    deadline = time.monotonic() + 60
    while len([c for c in _ranks_running(fake_hosts) if JOB in c]) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert handle.poll() is None
    handle.terminate()
    assert handle.poll() is not None
    assert _wait_no_ranks(fake_hosts) == []
    # the flow process dies without cleaning up: its ssh connections drop, the agents kill the ranks
    handle = provider.launch(JOB, args, {}, str(tmp_path / "b"))
    deadline = time.monotonic() + 60
    while len([c for c in _ranks_running(fake_hosts) if JOB in c]) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    for node in handle.nodes:
        node.proc.kill()
    assert _wait_no_ranks(fake_hosts) == []
    handle.terminate()


def test_failing_disk_stops_provisioning_naming_the_host(fake_hosts: NetnsCluster, tmp_path: Path) -> None:
    scratch = str(Path(fake_hosts.workdir) / "scratch")
    cfg = _cfg(fake_hosts, [0, 1], health={"disk_path": scratch, "min_free_disk_gb": 0.05, "probe_mb": 1, "iters": 2})
    with pytest.raises(HealthCheckFailed) as err:
        check_health(create_provider(cfg), cfg, log_dir=str(tmp_path))
    bad = fake_hosts.hosts[1]
    msg = str(err.value)
    assert f"health check failed on {bad.addr} before training" in msg
    assert f"node {bad.hostname} ({bad.addr}) rank 1: free disk" in msg
    assert fake_hosts.hosts[0].hostname not in msg and err.value.bad_hosts == [bad.addr]


def test_unhealthy_host_replaced_by_spare(fake_hosts: NetnsCluster, tmp_path: Path) -> None:
    scratch = str(Path(fake_hosts.workdir) / "scratch")
    cfg = _cfg(fake_hosts, [0, 1, 2], health={"disk_path": scratch, "min_free_disk_gb": 0.05, "probe_mb": 1, "iters": 2})
    provider, report = provision(cfg, str(tmp_path))
    assert report is not None and report.problems == []
    assert [r.hostname for r in report.ranks] == [fake_hosts.hosts[0].hostname, fake_hosts.hosts[2].hostname]
    assert [h.host for h in provider.hosts] == [fake_hosts.hosts[0].addr, fake_hosts.hosts[2].addr]


def test_unreachable_host_is_named(fake_hosts: NetnsCluster, tmp_path: Path) -> None:
    entries = fake_hosts.cluster_hosts()
    entries[1] = {**entries[1], "ssh_port": 2}  # nothing listens there
    cfg = ClusterConfig.model_validate({
        "type": "hosts", "ranks": 2, "hosts": entries[:2], "ssh_key": fake_hosts.key,
        "ssh_options": fake_hosts.ssh_options(), "start_timeout_s": 20, "health": {"timeout_s": 60},
    })
    with pytest.raises(HealthCheckFailed, match=f"could not run on host\\(s\\) {fake_hosts.hosts[1].addr}"):
        check_health(create_provider(cfg), cfg, log_dir=str(tmp_path))
    assert _wait_no_ranks(fake_hosts) == []


def test_service_placed_on_a_host_reports_its_port(fake_hosts: NetnsCluster, tmp_path: Path) -> None:
    """launch_service runs one process on the first host; it binds port 0 there and reports the port."""
    import socket
    import sys

    from infra.proc import ServiceSpec, file_probe, wait_until

    ready = str(tmp_path / "ready.json")
    code = ("import socket, sys\nfrom infra.proc import bind_socket, report_ready\n"
            "sock = bind_socket('0.0.0.0', 0)\n"
            "report_ready(sys.argv[1], port=sock.getsockname()[1], host=socket.gethostname())\n"
            "while True:\n    conn, _ = sock.accept()\n    conn.sendall(b'hi')\n    conn.close()\n")
    spec = ServiceSpec(name="probe", argv=[sys.executable, "-c", code, ready], log=str(tmp_path / "probe.log"))
    handle = create_provider(_cfg(fake_hosts, [0, 1])).launch_service(spec)
    try:
        info = wait_until(file_probe(ready), 120, lambda: None if handle.poll() is None else handle.describe())
        assert handle.host == fake_hosts.hosts[0].addr and info["host"] == fake_hosts.hosts[0].hostname
        host, port = handle.tunnel(handle.host, info["port"])  # the flow has no route to the hosts
        with socket.create_connection((host, port), timeout=10) as conn:
            assert conn.recv(2) == b"hi"
    finally:
        handle.terminate()
    assert handle.poll() is not None and _wait_no_ranks(fake_hosts) == []
