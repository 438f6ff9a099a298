"""Test helper: fake "hosts" made of Linux network namespaces on this machine, each running sshd.

Layout (root needed; ``ip`` from iproute2, ``sshd`` from openssh-server, ``unshare`` from util-linux)::

    ns <tag>-sw   : bridge "br0"           <- one veth pair per host ->   ns <tag>-h<i> : "eth0" ADDR_i/24

The test subnet exists only inside these namespaces; the root namespace gets no address and no
route to it. ssh from here reaches a host through ``ProxyCommand`` = this module's ``relay``
subcommand run inside the host's namespace (``ip netns exec NS python -m tests.integration.netns relay
%h %p``), which pipes stdio to ADDR:22 there.

Each sshd runs in its own UTS and mount namespace too, so a host has its own hostname (what health
checks report), an ``/etc/hosts`` naming every fake host (so gloo resolves peers), and optionally a
tiny tmpfs over a folder (a host whose disk check fails). Key auth only, with keys generated in a
temporary folder. :meth:`NetnsCluster.down` kills the sshds and every process left in the
namespaces (all started by us), then deletes the namespaces.

CLI: ``python -m tests.integration.netns up --dir D [--hosts 2]`` prints a ``cluster:`` YAML snippet;
``python -m tests.integration.netns down --dir D``. See ``scripts/setup_netns_hosts.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.wan_link import delete_namespaces

REPO_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass
class NetnsHost:
    """One fake host."""

    netns: str
    hostname: str
    addr: str
    sshd_pid: int = 0
    tiny_disk: str | None = None

    def proxy_command(self) -> str:
        """ssh ProxyCommand reaching this host's sshd from the root namespace."""
        return (f"ip netns exec {self.netns} env PYTHONPATH={shlex.quote(REPO_ROOT)} "
                f"{shlex.quote(sys.executable)} -m tests.integration.netns relay %h %p")


@dataclass
class NetnsCluster:
    """Namespaces, keys and sshds of a fake cluster; ``up()`` then ``down()`` (or use ``with``)."""

    workdir: str
    n_hosts: int = 2
    tag: str = field(default_factory=lambda: f"dl{os.getpid() % 100000}")
    subnet: str = "10.213.7"
    tiny_disks: dict[int, str] = field(default_factory=dict)  # host index -> folder to shadow with 1 MiB tmpfs
    hosts: list[NetnsHost] = field(default_factory=list)
    key: str = ""

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def up(self) -> "NetnsCluster":
        """Create everything; on any failure undo what was made and re-raise."""
        wd = Path(self.workdir)
        wd.mkdir(parents=True, exist_ok=True)
        try:
            self._keys(wd)
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            self.hosts = [
                NetnsHost(f"{self.tag}-h{i}", f"{self.tag}-host{i}", f"{self.subnet}.{i + 1}",
                          tiny_disk=self.tiny_disks.get(i))
                for i in range(self.n_hosts)
            ]
            etc_hosts = wd / "hosts"
            etc_hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.hostname}\n" for h in self.hosts))
            for i, h in enumerate(self.hosts):
                self._host(wd, i, h, etc_hosts)
            self._save(wd)
            for h in self.hosts:
                _wait_sshd(h)
        except BaseException:
            self.down()
            raise
        return self

    def _keys(self, wd: Path) -> None:
        for name in ("id_ed25519", "host_ed25519"):
            if not (wd / name).exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"deltaloop-{name}",
                                "-f", str(wd / name)], check=True)
        (wd / "authorized_keys").write_text((wd / "id_ed25519.pub").read_text())
        os.chmod(wd / "authorized_keys", 0o600)
        self.key = str(wd / "id_ed25519")

    def _host(self, wd: Path, i: int, h: NetnsHost, etc_hosts: Path) -> None:
        _ip("netns", "add", h.netns)
        inner, outer = f"{self.tag}h{i}", f"{self.tag}s{i}"
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        _ip("link", "set", inner, "netns", h.netns)
        _ip("link", "set", outer, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", outer, "master", "br0", "up")
        _ip("-n", h.netns, "link", "set", inner, "name", "eth0")
        _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
        _ip("-n", h.netns, "link", "set", "eth0", "up")
        _ip("-n", h.netns, "link", "set", "lo", "up")
        conf = wd / f"sshd_{i}.conf"
        conf.write_text("\n".join([
            f"ListenAddress {h.addr}", "Port 22", f"HostKey {wd / 'host_ed25519'}",
            f"AuthorizedKeysFile {wd / 'authorized_keys'}", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password", "StrictModes no",
            "UsePAM no", "PrintMotd no", f"PidFile {wd / f'sshd_{i}.pid'}", "MaxStartups 100", "",
        ]))
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder
        mounts = f"mount --bind {shlex.quote(str(etc_hosts))} /etc/hosts"
        if h.tiny_disk:
            Path(h.tiny_disk).mkdir(parents=True, exist_ok=True)
            mounts += f" && mount -t tmpfs -o size=1m deltaloop-tiny {shlex.quote(h.tiny_disk)}"
        script = f"hostname {h.hostname} && {mounts} && exec /usr/sbin/sshd -D -e -f {shlex.quote(str(conf))}"
        log = open(wd / f"sshd_{i}.log", "ab")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", h.netns, "unshare", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", script], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        h.sshd_pid = proc.pid  # every step execs, so this is sshd itself

    def _save(self, wd: Path) -> None:
        (wd / "netns.json").write_text(json.dumps(
            {"tag": self.tag, "key": self.key, "hosts": [asdict(h) for h in self.hosts]}, indent=1))

    def cluster_hosts(self) -> list[dict]:
        """``cluster.hosts`` entries for these fake hosts (one slot each)."""
        return [{"host": h.addr, "user": "root", "slots": 1, "proxy_command": h.proxy_command()} for h in self.hosts]

    def ssh_options(self) -> list[str]:
        """ssh options: the host keys are ours, kept out of the user's known_hosts."""
        return ["-F", "/dev/null", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR"]

    def down(self) -> None:
        """Kill our sshds and anything left in our namespaces, delete the namespaces. Idempotent."""
        names = [h.netns for h in self.hosts] + [self.switch]
        for h in self.hosts:
            if h.sshd_pid:
                _kill(h.sshd_pid, signal.SIGTERM)
        time.sleep(0.2)
        delete_namespaces(names)
        for h in self.hosts:
            h.sshd_pid = 0

    def __enter__(self) -> "NetnsCluster":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    @classmethod
    def load(cls, workdir: str) -> "NetnsCluster":
        """Rebuild the handle saved by ``up`` (for the ``down`` CLI)."""
        state = json.loads((Path(workdir) / "netns.json").read_text())
        return cls(workdir=workdir, n_hosts=len(state["hosts"]), tag=state["tag"], key=state["key"],
                   hosts=[NetnsHost(**h) for h in state["hosts"]])


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_sshd(h: NetnsHost, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = subprocess.run(["ip", "netns", "exec", h.netns, sys.executable, "-c",
                              f"import socket; socket.create_connection(('{h.addr}', 22), 1).close()"],
                             capture_output=True)
        if res.returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"sshd of fake host {h.hostname} ({h.addr}) did not start")


def relay(host: str, port: int) -> None:
    """Pipe stdin/stdout to ``host:port`` (ssh ProxyCommand); half-closes like ``nc -N``."""
    sock = socket.create_connection((host, port), timeout=10)
    sock.settimeout(None)

    def upstream() -> None:
        while data := os.read(0, 65536):
            sock.sendall(data)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    threading.Thread(target=upstream, daemon=True).start()
    while data := sock.recv(65536):
        os.write(1, data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up")
    up.add_argument("--dir", required=True)
    up.add_argument("--hosts", type=int, default=2)
    down = sub.add_parser("down")
    down.add_argument("--dir", required=True)
    rel = sub.add_parser("relay")
    rel.add_argument("host")
    rel.add_argument("port", type=int)
    args = parser.parse_args(argv)
    if args.cmd == "relay":
        relay(args.host, args.port)
    elif args.cmd == "up":
        cl = NetnsCluster(workdir=args.dir, n_hosts=args.hosts).up()
        import yaml

        snippet = {"cluster": {"type": "hosts", "ranks": args.hosts, "ssh_key": cl.key,
                               "ssh_options": cl.ssh_options(), "hosts": cl.cluster_hosts()}}
        print(yaml.safe_dump(snippet, sort_keys=False))
    else:
        NetnsCluster.load(args.dir).down()


if __name__ == "__main__":
    main()
