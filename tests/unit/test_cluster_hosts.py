"""hosts provider pieces that need no ssh: hostfile, command lines, spares, and the remote agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.cluster import create_provider
from infra.cluster.base import ClusterError
from infra.cluster.hosts import REPO_ROOT, HostfileError, parse_hostfile, rank0_addr, ssh_argv, torchrun_argv
from infra.config import ClusterConfig


def _cfg(**kw: object) -> ClusterConfig:
    base: dict = {"type": "hosts", "ranks": 2, "hosts": [{"host": "n1", "addr": "10.0.0.9"}, {"host": "n2", "addr": "10.0.0.10"}]}
    base.update(kw)
    return ClusterConfig.model_validate(base)


def test_parse_hostfile(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("# cluster\nnode-a slots=2 port=2222 user=ml\n\nnode-b addr=10.1.0.2  # comment\n")
    hosts = parse_hostfile(str(f))
    assert [(h.host, h.slots, h.ssh_port, h.user) for h in hosts] == [("node-a", 2, 2222, "ml"), ("node-b", 1, 22, None)]
    assert hosts[1].node_addr == "10.1.0.2"


@pytest.mark.parametrize("text,match", [("a bogus=1\n", "bad option"), ("a slots=x\n", "hosts:1"), ("# none\n", "no hosts")])
def test_hostfile_errors(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "hosts"
    f.write_text(text)
    with pytest.raises(HostfileError, match=match):
        parse_hostfile(str(f))


def test_provider_from_hostfile_checks_slots(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("a slots=2\nb slots=2\n")
    with pytest.raises(HostfileError, match="must equal"):
        create_provider(ClusterConfig(type="hosts", ranks=3, hostfile=str(f)))
    assert create_provider(ClusterConfig(type="hosts", ranks=4, hostfile=str(f))).world_size == 4


def test_ssh_argv_options() -> None:
    cfg = _cfg(ssh_key="/k", ssh_options=["-F", "/dev/null"],
               hosts=[{"host": "n1", "user": "u", "ssh_port": 2200, "proxy_command": "nc %h %p"}, {"host": "n2"}])
    argv = ssh_argv(cfg, cfg.hosts[0], "echo hi")
    assert argv[0] == "ssh" and "BatchMode=yes" in argv and argv[-2:] == ["--", "echo hi"]
    assert argv[argv.index("-p") + 1] == "2200" and argv[argv.index("-l") + 1] == "u"
    assert "ProxyCommand=nc %h %p" in argv and argv[argv.index("-i") + 1] == "/k"
    assert argv.index("-F") < argv.index("n1")


def test_torchrun_c10d_and_static() -> None:
    cfg = _cfg()
    node1 = torchrun_argv(cfg, cfg.hosts, 1, "rid", "pkg.mod", ["--x", "1"])
    assert "--rdzv_endpoint=10.0.0.9:29400" in node1 and "--local_addr=10.0.0.10" in node1
    assert any(a.startswith("--rdzv_conf=is_host=0") for a in node1) and node1[-4:] == ["-m", "pkg.mod", "--x", "1"]
    # torch orders c10d nodes by address string: "10.0.0.10" < "10.0.0.9"
    assert rank0_addr(cfg, cfg.hosts) == "10.0.0.10"
    static = _cfg(rendezvous="static")
    node1 = torchrun_argv(static, static.hosts, 1, "rid", "m", [])
    assert "--node_rank=1" in node1 and "--master_addr=10.0.0.9" in node1
    assert rank0_addr(static, static.hosts) == "10.0.0.9"


def test_replace_uses_spares() -> None:
    prov = create_provider(_cfg(hosts=[{"host": "a"}, {"host": "b"}, {"host": "c"}, {"host": "d", "slots": 2}]))
    assert [h.host for h in prov.hosts] == ["a", "b"]
    assert prov.replace(["b"]) == [("b", "c")]
    assert [h.host for h in prov.hosts] == ["a", "c"]
    with pytest.raises(ClusterError, match="no spare host with 1 slot"):
        prov.replace(["a"])  # d has 2 slots: cannot stand in for a 1-slot host


def _agent(spec: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "infra.cluster.hosts", "agent"], cwd=REPO_ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec).encode() + b"\n")
    proc.stdin.flush()
    return proc


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_agent_passes_exit_code_and_env(tmp_path: Path) -> None:
    spec = {"cmd": [sys.executable, "-c", "import os,sys; sys.exit(int(os.environ['CODE']))"],
            "env": {"CODE": "7"}, "pidfile": str(tmp_path / "agent.pid")}
    proc = _agent(spec)
    assert proc.wait(timeout=30) == 7
    assert not (tmp_path / "agent.pid").exists()


@pytest.mark.parametrize("channel_gone", [False, True])
def test_agent_kills_whole_tree_on_stdin_eof(tmp_path: Path, channel_gone: bool) -> None:
    """The dead-man switch: when the launcher's pipe closes, every descendant dies (new sessions too),
    also when the agent's output channel is already broken (ssh connection lost)."""
    pids = tmp_path / "pids"
    child = ("import os,subprocess,sys,time;"
             "p=subprocess.Popen([sys.executable,'-c','import time; time.sleep(600)'],start_new_session=True);"
             f"open({str(pids)!r},'w').write(f'{{os.getpid()}} {{p.pid}}');time.sleep(600)")
    proc = _agent({"cmd": [sys.executable, "-c", child], "env": {}, "pidfile": str(tmp_path / "a.pid")})
    deadline = time.monotonic() + 30
    while not (pids.exists() and " " in pids.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    tree = [int(p) for p in pids.read_text().split()]
    assert all(_alive(p) for p in tree)
    assert proc.stdin is not None and proc.stdout is not None
    if channel_gone:
        proc.stdout.close()
    proc.stdin.close()
    assert proc.wait(timeout=30) != 0
    assert not any(_alive(p) for p in tree), "a process of the rank tree survived its agent"


def test_agent_rewrites_parent_pid(tmp_path: Path) -> None:
    out = tmp_path / "ppid"
    spec = {"cmd": [sys.executable, "-c", f"import os; open({str(out)!r},'w').write(os.environ['DELTALOOP_PARENT_PID'])"],
            "env": {"DELTALOOP_PARENT_PID": "1"}, "pidfile": str(tmp_path / "a.pid")}
    proc = _agent(spec)
    assert proc.wait(timeout=30) == 0
    assert int(out.read_text()) == proc.pid and proc.pid != os.getpid()
