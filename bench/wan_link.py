"""WAN links for benchmarks: a server namespace and N client namespaces, each behind a shaped link.

Layout (root needed; ``ip`` and ``tc`` from iproute2)::

    root ns  ── veth (unshaped) ──  ns <tag>-srv  ── veth i (rate-shaped) ──  ns <tag>-c<i>
    10.232.<k>.2                    10.232.<k>.1 / 10.231.<i>.1                10.231.<i>.2

(``k``: the first /24 of 10.232/16 that the root namespace does not use yet, so several sets of
links can be up at once; the other addresses live only inside our namespaces.)

The publisher lives in the root namespace (the trainer's region: its path to the store is not the
WAN), the object store in ``<tag>-srv``, every reader in its own ``<tag>-c<i>``. Each client link is
shaped on *both* ends' egress with ``tbf`` at ``rate`` bytes/s, so every reader has its own link
of that rate each way (the store's side is not a shared bottleneck, as with a real object store).

Round-trip time: with ``sch_netem`` in the kernel, ``netem delay RTT/2 rate R`` replaces ``tbf``
on both ends (``latency_method = "netem"``). Kernels built without it (``tc`` answers
"Specified qdisc kind is unknown") get a user-space delay relay instead (``latency_method =
"relay"``): one process per client namespace listening on that namespace's loopback, forwarding to
the server across the shaped link and holding every chunk it forwards for RTT/2 in each direction
(and a new connection's first bytes for one more RTT: the TCP handshake). The relay does not model
TCP's congestion window over a long path (the relayed TCP connection itself sees ~0 RTT), so slow
start after an idle period is not paid; say so beside its numbers.

:meth:`WanLinks.down` kills every process we started and anything left in our namespaces, then
deletes the namespaces (which removes their veths); it is idempotent and runs on any failure of
:meth:`WanLinks.up`.

CLI (run inside a client namespace by :meth:`WanLinks.start_relays`)::

    python -m bench.wan_link relay --target HOST:PORT --delay-ms 20 --rtt-ms 40 --port-file F
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from infra.proc import ServiceProcess, ServiceSpec, file_probe, spawn

def _free_publisher_subnet() -> str:
    """``10.232.<k>`` with the smallest ``k`` no root-namespace address uses."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for k in range(256):
        if f" 10.232.{k}." not in used:
            return f"10.232.{k}"
    raise RuntimeError("no free 10.232.<k>.0/24 for the publisher link")


def client_addrs(i: int) -> tuple[str, str]:
    """(server side, client side) addresses of client link ``i``."""
    return f"10.231.{i}.1", f"10.231.{i}.2"


def ip(*args: str) -> str:
    """Run ``ip ARGS``; raise RuntimeError with its stderr on failure."""
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


def tc(ns: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``tc ARGS`` inside namespace ``ns`` (no check)."""
    return subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class WanLinks:
    """Namespaces, veths, shaping and relays; ``up()`` then ``down()`` (or use ``with``)."""

    clients: int = 4
    rtt_ms: float = 40.0
    rate: float = 50e6  # bytes/s per client link, each direction
    tag: str = field(default_factory=lambda: f"wl{os.getpid() % 100000}")
    latency_method: str = ""  # "netem" or "relay", set by up()
    latency_note: str = ""
    relays: list[ServiceProcess] = field(default_factory=list)
    relay_ports: list[int] = field(default_factory=list)
    procs: list[ServiceProcess] = field(default_factory=list)  # other processes placed in our namespaces
    server_addr: str = ""  # the store's address as the root namespace (the publisher) reaches it

    @property
    def server_ns(self) -> str:
        return f"{self.tag}-srv"

    def client_ns(self, i: int) -> str:
        return f"{self.tag}-c{i}"

    def namespaces(self) -> list[str]:
        return [self.server_ns] + [self.client_ns(i) for i in range(self.clients)]

    def up(self) -> "WanLinks":
        """Create namespaces and links and shape them; on any failure undo and re-raise."""
        try:
            ip("netns", "add", self.server_ns)
            ip("-n", self.server_ns, "link", "set", "lo", "up")
            pub, srv = f"{self.tag}p0", f"{self.tag}p1"
            ip("link", "add", pub, "type", "veth", "peer", "name", srv)
            ip("link", "set", srv, "netns", self.server_ns)
            subnet = _free_publisher_subnet()
            self.server_addr = f"{subnet}.1"
            ip("addr", "add", f"{subnet}.2/24", "dev", pub)
            ip("link", "set", pub, "up")
            ip("-n", self.server_ns, "addr", "add", f"{self.server_addr}/24", "dev", srv)
            ip("-n", self.server_ns, "link", "set", srv, "up")
            netem = self._netem_available()
            self.latency_method = "netem" if netem else "relay"
            self.latency_note = ("tc netem delay RTT/2 + rate on both ends of each link" if netem else
                                 "kernel has no sch_netem (tc: 'Specified qdisc kind is unknown'): tbf shapes "
                                 "the rate on both ends, a user-space relay in each reader's namespace holds "
                                 "every chunk RTT/2 each way (+1 RTT per new connection)")
            for i in range(self.clients):
                self._client(i, netem)
        except BaseException:
            self.down()
            raise
        return self

    def _netem_available(self) -> bool:
        """Try a netem qdisc on the server's loopback (removed again)."""
        res = tc(self.server_ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
        if res.returncode == 0:
            tc(self.server_ns, "qdisc", "del", "dev", "lo", "root")
            return True
        return False

    def _client(self, i: int, netem: bool) -> None:
        ns = self.client_ns(i)
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
        inner, outer = f"{self.tag}c{i}", f"{self.tag}s{i}"
        ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        ip("link", "set", inner, "netns", ns)
        ip("link", "set", outer, "netns", self.server_ns)
        ip("-n", ns, "link", "set", inner, "name", "eth0")
        srv_addr, cli_addr = client_addrs(i)
        ip("-n", ns, "addr", "add", f"{cli_addr}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", self.server_ns, "addr", "add", f"{srv_addr}/24", "dev", outer)
        ip("-n", self.server_ns, "link", "set", outer, "up")
        for where, dev in ((ns, "eth0"), (self.server_ns, outer)):
            res = tc(where, "qdisc", "add", "dev", dev, "root", *self._qdisc(netem))
            if res.returncode:
                raise RuntimeError(f"tc on {where}/{dev}: {res.stderr.strip()}")

    def _qdisc(self, netem: bool) -> list[str]:
        bits = f"{int(self.rate * 8)}bit"
        if netem:
            return ["netem", "delay", f"{self.rtt_ms / 2:g}ms", "rate", bits, "limit", "100000"]
        burst = max(64 << 10, int(self.rate * 0.004))  # >= one timer tick of bytes at HZ 250
        return ["tbf", "rate", bits, "burst", str(burst), "latency", "200ms"]

    def start_relays(self, port: int, workdir: str) -> list[str]:
        """Endpoints (one per client, as seen from inside its namespace) of a server on ``port``:
        the relay's loopback address, or the server's address on the link when netem delays it."""
        if self.latency_method == "netem":
            return [f"http://{client_addrs(i)[0]}:{port}" for i in range(self.clients)]
        urls = []
        for i in range(self.clients):
            pf = Path(workdir) / f"relay{i}.json"
            pf.unlink(missing_ok=True)
            spec = ServiceSpec(f"delay relay {i}", ["ip", "netns", "exec", self.client_ns(i), sys.executable, "-m",
                                                    "bench.wan_link", "relay", "--target",
                                                    f"{client_addrs(i)[0]}:{port}", "--delay-ms",
                                                    f"{self.rtt_ms / 2}", "--rtt-ms", f"{self.rtt_ms}",
                                                    "--port-file", str(pf)],
                               log=str(Path(workdir) / f"relay{i}.log"))
            proc = spawn(spec)
            self.relays.append(proc)
            info = proc.wait_ready(file_probe(str(pf)), 30)
            self.relay_ports.append(int(info["port"]))
            urls.append(f"http://127.0.0.1:{info['port']}")
        return urls

    def exec_argv(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]

    def down(self) -> None:
        """Stop our processes, kill anything left in our namespaces, delete them. Idempotent."""
        for p in self.relays + self.procs:
            p.terminate(timeout=2)
        self.relays, self.procs, self.relay_ports = [], [], []
        delete_namespaces([ns for ns in self.namespaces() if ns in netns_list()])
        subprocess.run(["ip", "link", "del", f"{self.tag}p0"], capture_output=True)  # gone with its peer, normally

    def __enter__(self) -> "WanLinks":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def delete_namespaces(names: list[str]) -> None:
    """SIGKILL every process left in each of ``names`` (network namespaces we made), then delete them."""
    for ns in names:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in out.stdout.split():
            _kill(int(pid), signal.SIGKILL)
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def netns_list() -> list[str]:
    """Names of the network namespaces that exist now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------- relay
class DelayRelay:
    """Forward connections on ``127.0.0.1:<port>`` to ``target``, each chunk held ``delay`` s."""

    def __init__(self, target: tuple[str, int], delay: float, rtt: float, chunk: int = 256 << 10) -> None:
        self.target, self.delay, self.rtt, self.chunk = target, delay, rtt, chunk
        self.srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(128)
        self.port = self.srv.getsockname()[1]

    def serve(self) -> None:
        """Accept forever (until the process is killed)."""
        while True:
            client, _ = self.srv.accept()
            ready = time.monotonic() + self.rtt  # the handshake across the path: one round trip
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pipe(client, upstream, ready)
            self._pipe(upstream, client, ready)

    def _pipe(self, src: socket.socket, dst: socket.socket, ready: float) -> None:
        """Two threads: one stamps chunks as they arrive, one sends each when it is due."""
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        cond = threading.Condition()

        def recv() -> None:
            try:
                while True:
                    # ack at once: a server that writes headers and body apart (Nagle) would
                    # otherwise wait for our delayed ACK (~40 ms), a stall of this lab, not the path
                    src.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
                    data = src.recv(self.chunk)
                    if not data:
                        break
                    with cond:
                        queue.append((max(time.monotonic(), ready) + self.delay, data))
                        cond.notify()
            except OSError:
                pass
            with cond:
                queue.append((0.0, b""))
                cond.notify()

        def send() -> None:
            try:
                while True:
                    with cond:
                        while not queue:
                            cond.wait()
                        due, data = queue.popleft()
                    if not data:
                        break
                    wait = due - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    dst.sendall(data)
            except OSError:
                pass
            for s in (dst, src):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        threading.Thread(target=recv, daemon=True).start()
        threading.Thread(target=send, daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="delay relay (one client namespace's round-trip time)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    rel = sub.add_parser("relay")
    rel.add_argument("--target", required=True)
    rel.add_argument("--delay-ms", type=float, required=True)
    rel.add_argument("--rtt-ms", type=float, required=True)
    rel.add_argument("--port-file", required=True)
    args = parser.parse_args(argv)
    host, port = args.target.rsplit(":", 1)
    relay = DelayRelay((host, int(port)), args.delay_ms / 1000, args.rtt_ms / 1000)
    tmp = args.port_file + ".tmp"
    Path(tmp).write_text(f'{{"port": {relay.port}}}')
    os.replace(tmp, args.port_file)
    relay.serve()


if __name__ == "__main__":
    main()
