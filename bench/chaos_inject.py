"""The faults the chaos bench injects, each for real: SIGKILL of real processes, ``docker kill`` of a
real container, a restart of the real S3 server, flipped bytes in a real stored object.

Every target is found among the descendants of the flow process the bench itself started (by
command line and environment, under that pid), never by a name pattern across the machine; docker
containers by the owner label the pool puts on them (``<host>:<flow pid>``). Each injector returns
a one-line ``action`` saying what it did, for the bench's JSON.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from infra.proc import alive, descendants
from infra.storage import ObjectStore

DOCKER_OWNER_LABEL = "org.deltaloop.sandbox.owner"  # see infra/sandbox/docker_rt.py


@dataclass(frozen=True)
class Proc:
    """A process seen under the flow: pid, start time (to tell a reused pid), command line."""

    pid: int
    start: int
    cmdline: str


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().decode(errors="replace").rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def tree(root: int) -> list[Proc]:
    """Live descendants of ``root`` with their start times and command lines."""
    out = []
    for pid in descendants(root):
        start = _start_time(pid)
        if start is not None:
            out.append(Proc(pid, start, _cmdline(pid)))
    return out


def still_alive(p: Proc) -> bool:
    """True while the very process ``p`` (not a later one with its pid) runs."""
    return alive(p.pid) and _start_time(p.pid) == p.start


def kill_leftovers(seen: list[Proc]) -> int:
    """SIGKILL every process of ``seen`` that still runs (they were all started under our flow)."""
    n = 0
    for p in seen:
        if still_alive(p):
            try:
                os.kill(p.pid, signal.SIGKILL)
                n += 1
            except ProcessLookupError:
                pass
    return n


def _busy_first(pids: list[int], rng: random.Random) -> int:
    """One of ``pids``, preferring those that used CPU in the last 0.1 s (a sandbox running a job)."""
    before = {p: sum(_cpu_ticks(c) for c in [p, *descendants(p)]) for p in pids}
    time.sleep(0.1)
    busy = [p for p in pids if sum(_cpu_ticks(c) for c in [p, *descendants(p)]) > before[p]]
    return rng.choice(busy or pids)


def kill_bwrap_sandbox(flow_pid: int, rng: random.Random) -> str:
    """SIGKILL one bwrap sandbox of the flow: its process group and every process inside it."""
    boxes = [p.pid for p in tree(flow_pid) if os.path.basename(p.cmdline.split(" ", 1)[0]) == "bwrap"
             and _ppid(p.pid) == flow_pid]
    if not boxes:
        return "no bwrap sandbox running under the flow: nothing killed"
    pid = _busy_first(boxes, rng)
    inside = descendants(pid)
    try:
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in inside:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return f"kill -9 of bwrap sandbox pid {pid} (process group and {len(inside)} processes inside), 1 of {len(boxes)}"


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().decode(errors="replace").rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def docker_containers(flow_pids: list[int]) -> list[str]:
    """Ids of running sandbox containers owned by any of ``flow_pids`` on this host."""
    ids: list[str] = []
    for pid in flow_pids:
        out = subprocess.run(["docker", "ps", "-q", "--filter", f"label={DOCKER_OWNER_LABEL}={socket.gethostname()}:{pid}"],
                             capture_output=True, text=True, timeout=60)
        ids += out.stdout.split()
    return ids


def kill_docker_sandbox(flow_pid: int, rng: random.Random) -> str:
    """``docker kill`` (SIGKILL) one running sandbox container of the flow."""
    ids = docker_containers([flow_pid])
    if not ids:
        return "no docker sandbox running for the flow: nothing killed"
    cid = rng.choice(ids)
    done = subprocess.run(["docker", "kill", cid], capture_output=True, text=True, timeout=60)
    what = "killed" if done.returncode == 0 else f"docker kill failed: {done.stderr.strip()[:200]}"
    return f"docker kill of sandbox container {cid} ({what}), 1 of {len(ids)}"


def remove_containers(flow_pids: list[int]) -> int:
    """Force-remove every sandbox container still owned by one of ``flow_pids`` (cleanup)."""
    ids = []
    for pid in flow_pids:
        out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={DOCKER_OWNER_LABEL}={socket.gethostname()}:{pid}"],
                             capture_output=True, text=True, timeout=60)
        ids += out.stdout.split()
    if ids:
        subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, timeout=120)
    return len(ids)


def kill_rollout_worker(flow_pid: int) -> str:
    """SIGKILL the rollout worker process (and its process group)."""
    workers = [p.pid for p in tree(flow_pid) if "-m infra.rollout.server" in p.cmdline]
    if not workers:
        return "no rollout worker under the flow: nothing killed"
    pid = workers[0]
    try:
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    except ProcessLookupError:
        pass
    return f"kill -9 of rollout worker pid {pid}"


def kill_trainer_rank(flow_pid: int, rng: random.Random) -> str:
    """SIGKILL one trainer rank (chosen by the seed), only that process."""
    ranks = {}
    for p in tree(flow_pid):
        if "-m infra.train.worker" in p.cmdline:
            rank = _environ(p.pid).get("RANK")
            if rank is not None:
                ranks[int(rank)] = p.pid
    if not ranks:
        return "no trainer rank under the flow: nothing killed"
    rank = rng.choice(sorted(ranks))
    try:
        os.kill(ranks[rank], signal.SIGKILL)
    except ProcessLookupError:
        return f"trainer rank {rank} (pid {ranks[rank]}) exited before the kill"
    return f"kill -9 of trainer rank {rank} pid {ranks[rank]} (of {len(ranks)} ranks)"


def kill_flow(flow_pid: int) -> str:
    """SIGKILL the flow process alone (its services must notice by themselves)."""
    os.kill(flow_pid, signal.SIGKILL)
    return f"kill -9 of flow process pid {flow_pid}"


def corrupt_object(store: ObjectStore, key: str, rng: random.Random) -> str:
    """Flip every bit of one byte (chosen by the seed) of object ``key`` in place."""
    data = bytearray(store.get(key))
    if not data:
        return f"{key} is empty: nothing flipped"
    offset = rng.randrange(len(data))
    data[offset] ^= 0xFF
    store.put(key, bytes(data))
    return f"flipped byte {offset} of {len(data)} in {key}"


def weight_objects(store: ObjectStore, run_id: str, version: int) -> list[str]:
    """The stored objects of weight ``version`` (frames and manifest; not the keyframe marker)."""
    prefix = f"runs/{run_id}/weights/v{version:08d}/"
    return [k for k in store.list(prefix) if not k.endswith("/keyframe")]
