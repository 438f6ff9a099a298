"""Provision-time health checks: find a broken or slow node *before* the trainer spends time on it.

:func:`check_health` launches ``python -m infra.cluster.health`` on every rank through the cluster
provider (the same launch path as the trainer, so rendezvous, ssh and networking are exercised too).
On every rank :func:`probe` records the hostname, the device, free memory (GPU memory on CUDA, else
host memory within the cgroup limit) and free disk; rank 0 then measures, with each other rank in
turn, the round-trip latency of a tiny message and the one-way bandwidth of a ``probe_mb`` tensor,
and all ranks time an all-reduce of that tensor (latency and bus bandwidth, as nccl-tests report it).
Rank 0 writes the gathered :class:`HealthReport` as JSON to ``--out`` and prints it on one line
prefixed with ``DELTALOOP_HEALTH`` (so it reaches the launcher through the rank logs when the out
path is on another machine).

:func:`evaluate` compares a report with the thresholds in ``cluster.health``; every violation names
the node by hostname (and the configured host). :func:`check_health` raises :class:`ClusterError`
listing them, or naming the hosts whose ranks could not even start. :func:`provision` runs the check
and, when the provider can (``hosts`` with spare hosts), replaces the failing hosts and checks again.

A trainer that already has a process group can call :func:`probe` itself and skip the extra launch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra.atomicio import write_atomic
from infra.cluster.base import ClusterError, ClusterProvider
from infra.config import ClusterConfig, HealthConfig

MARKER = "DELTALOOP_HEALTH "
REPO_ROOT = str(Path(__file__).resolve().parents[2])


class HealthCheckFailed(ClusterError):
    """A node failed its health check. ``bad_hosts``: configured host names to avoid (may be empty)."""

    retryable = False

    def __init__(self, message: str, report: "HealthReport | None" = None, bad_hosts: list[str] | None = None):
        super().__init__(message)
        self.report = report
        self.bad_hosts = bad_hosts or []


@dataclass
class RankHealth:
    """What one rank found about itself."""

    rank: int
    local_rank: int
    hostname: str
    node_host: str  # the host as configured (ssh destination), else the hostname
    device: str
    free_memory_gb: float
    free_disk_gb: float
    disk_path: str
    latency_ms: float | None = None  # median round trip to rank 0 (None on rank 0)
    bandwidth_gbps: float | None = None  # rank 0 -> this rank, GB/s (None on rank 0)


@dataclass
class HealthReport:
    """All ranks' findings plus the collective probe."""

    world_size: int
    ranks: list[RankHealth]
    allreduce_latency_ms: float
    allreduce_bandwidth_gbps: float
    probe_mb: float
    seconds: float
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "HealthReport":
        data = json.loads(text)
        data["ranks"] = [RankHealth(**r) for r in data["ranks"]]
        return cls(**data)

    def node(self, rank: int) -> str:
        """``hostname (host)`` of a rank, for messages."""
        r = self.ranks[rank]
        return r.hostname if r.node_host == r.hostname else f"{r.hostname} ({r.node_host})"


# ------------------------------------------------------------------------------- on each rank
def _free_memory_gb(device: Any) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 1e9
    avail = 0.0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    try:  # a container's own limit counts too (cgroup v2)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(avail, 0) / 1e9


def _device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"cpu ({os.cpu_count()} cores)"


def probe(disk_path: str, probe_mb: float = 4.0, iters: int = 5) -> HealthReport | None:
    """Run the checks in an initialised process group; returns the report on rank 0, None elsewhere."""
    import torch
    import torch.distributed as dist

    t0 = time.monotonic()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    me = RankHealth(
        rank=rank, local_rank=local_rank, hostname=socket.gethostname(),
        node_host=os.environ.get("DELTALOOP_NODE_HOST", socket.gethostname()),
        device=_device_name(device), free_memory_gb=round(_free_memory_gb(device), 3),
        free_disk_gb=round(shutil.disk_usage(disk_path).free / 1e9, 3), disk_path=disk_path,
    )
    tiny = torch.zeros(1, device=device)
    big = torch.ones(max(1, int(probe_mb * 1e6 / 4)), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    # rank 0 <-> each rank in turn: latency (tiny round trip) and bandwidth (big one way, tiny ack)
    peer: dict[str, float | None] = {"latency_ms": None, "bandwidth_gbps": None}
    for other in range(1, world):
        if rank not in (0, other):
            continue
        lat, bw = [], []
        def exchange(out: "torch.Tensor") -> float:
            """Rank 0 sends ``out`` to ``other`` and waits for a tiny ack; seconds taken."""
            start = time.perf_counter()
            if rank == 0:
                dist.send(out, other)
                dist.recv(tiny, other)
            else:
                dist.recv(out, 0)
                dist.send(tiny, 0)
            sync()
            return time.perf_counter() - start

        for _ in range(iters + 1):  # first round warms up the connection
            lat.append(exchange(tiny))
            bw.append(big.numel() * 4 / exchange(big) / 1e9)
        if rank == other:
            peer = {"latency_ms": statistics.median(lat[1:]) * 1e3, "bandwidth_gbps": statistics.median(bw[1:])}
    me.latency_ms = peer["latency_ms"]
    me.bandwidth_gbps = peer["bandwidth_gbps"]

    # collective: all ranks together
    ar_lat, ar_bw = [], []
    for _ in range(iters + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tiny)
        sync()
        ar_lat.append(time.perf_counter() - start)
        start = time.perf_counter()
        dist.all_reduce(big)
        sync()
        seconds = time.perf_counter() - start
        ar_bw.append(big.numel() * 4 / seconds * (2 * (world - 1) / world if world > 1 else 1) / 1e9)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, asdict(me))
    if rank != 0:
        return None
    return HealthReport(
        world_size=world, ranks=[RankHealth(**g) for g in gathered],
        allreduce_latency_ms=round(statistics.median(ar_lat[1:]) * 1e3, 4),
        allreduce_bandwidth_gbps=round(statistics.median(ar_bw[1:]), 4), probe_mb=probe_mb,
        seconds=round(time.monotonic() - t0, 3),
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point on every rank (under torchrun): probe, and on rank 0 write/print the report."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description="deltaloop provision-time health probe (one rank)")
    parser.add_argument("--out", required=True, help="JSON report path (written by rank 0)")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--disk-path", default=".")
    parser.add_argument("--probe-mb", type=float, default=4.0)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    dist.init_process_group(args.backend)
    try:
        report = probe(args.disk_path, args.probe_mb, args.iters)
        if report is not None:
            text = report.to_json()
            try:
                write_atomic(args.out, text)
            except OSError as exc:  # the launcher still gets the report from the log line
                print(f"health: cannot write {args.out}: {exc}", flush=True)
            print(MARKER + text, flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------- on the launcher
def evaluate(report: HealthReport, th: HealthConfig) -> list[str]:
    """Threshold violations, one line each, naming the node (hostname and configured host)."""
    return [msg for _, msg in violations(report, th)]


def violations(report: HealthReport, th: HealthConfig) -> list[tuple[int | None, str]]:
    """(rank or None for the whole group, message) for each threshold violation."""
    problems: list[tuple[int | None, str]] = []
    for r in report.ranks:
        who = f"node {report.node(r.rank)} rank {r.rank}"
        if r.free_memory_gb < th.min_free_memory_gb:
            problems.append((r.rank, f"{who}: free memory {r.free_memory_gb:.3f} GB on {r.device} < {th.min_free_memory_gb} GB"))
        if r.free_disk_gb < th.min_free_disk_gb:
            problems.append((r.rank, f"{who}: free disk {r.free_disk_gb:.3f} GB at {r.disk_path} < {th.min_free_disk_gb} GB"))
        if r.latency_ms is not None and r.latency_ms > th.max_latency_ms:
            problems.append((r.rank, f"{who}: latency to rank 0 {r.latency_ms:.2f} ms > {th.max_latency_ms} ms"))
        if th.min_bandwidth_gbps and r.bandwidth_gbps is not None and r.bandwidth_gbps < th.min_bandwidth_gbps:
            problems.append((r.rank, f"{who}: bandwidth from rank 0 {r.bandwidth_gbps:.3f} GB/s < {th.min_bandwidth_gbps} GB/s"))
    if th.min_bandwidth_gbps and report.world_size > 1 and report.allreduce_bandwidth_gbps < th.min_bandwidth_gbps:
        slowest = min((r for r in report.ranks if r.bandwidth_gbps is not None), key=lambda r: r.bandwidth_gbps or 0)
        problems.append((None,
            f"all-reduce bus bandwidth {report.allreduce_bandwidth_gbps:.3f} GB/s < {th.min_bandwidth_gbps} GB/s "
            f"(slowest link: rank 0 -> node {report.node(slowest.rank)})"
        ))
    return problems


def _read_report(out: Path, logs: list[str]) -> HealthReport | None:
    if out.is_file():
        return HealthReport.from_json(out.read_text())
    for log in logs:
        try:
            lines = Path(log).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if MARKER in line:
                return HealthReport.from_json(line.split(MARKER, 1)[1])
    return None


def _tail(path: str, n: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def check_health(
    provider: ClusterProvider,
    cfg: ClusterConfig,
    thresholds: HealthConfig | None = None,
    *,
    log_dir: str,
    env: dict[str, str] | None = None,
) -> HealthReport:
    """Probe every rank through ``provider``; raise :class:`HealthCheckFailed` naming failing nodes."""
    th = thresholds or cfg.health
    out = Path(log_dir) / f"health-{int(time.time() * 1000)}.json"
    disk_path = th.disk_path or cfg.workdir or REPO_ROOT
    args = ["--out", str(out.resolve()), "--backend", cfg.backend, "--disk-path", disk_path,
            "--probe-mb", str(th.probe_mb), "--iters", str(th.iters)]
    handle = provider.launch("infra.cluster.health", args, {"PYTHONUNBUFFERED": "1", **(env or {})}, log_dir)
    deadline = time.monotonic() + th.timeout_s
    try:
        while handle.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        code = handle.poll()
        failed = list(getattr(handle, "failed_hosts", lambda: [])())  # before terminate() stops the rest
    finally:
        handle.terminate()
    logs = list(getattr(handle, "logs", []))
    if code != 0:
        why = f"timed out after {th.timeout_s:.0f}s" if code is None else f"exited with code {code}"
        named = f" on host(s) {', '.join(failed)}" if failed else ""
        tails = "\n".join(f"--- {log}\n{_tail(log)}" for log in logs)
        raise HealthCheckFailed(
            f"health check could not run{named}: group {why} ({handle.describe()})\n{tails}", bad_hosts=failed
        )
    report = _read_report(out, logs)
    if report is None:
        raise HealthCheckFailed(f"health check finished but wrote no report ({handle.describe()})")
    found = violations(report, th)
    report.problems = [msg for _, msg in found]
    if report.problems:
        bad = sorted({report.ranks[i].node_host for i, _ in found if i is not None})
        raise HealthCheckFailed(
            f"health check failed on {', '.join(bad) or 'the cluster'} before training:\n  - "
            + "\n  - ".join(report.problems), report=report, bad_hosts=bad,
        )
    return report


def provision(cfg: ClusterConfig, log_dir: str, env: dict[str, str] | None = None) -> tuple[ClusterProvider, HealthReport | None]:
    """Create the provider and, if ``cluster.health.enabled``, check it; replace failing hosts if possible."""
    from infra.cluster import create_provider

    provider = create_provider(cfg)
    if not cfg.health.enabled:
        return provider, None
    while True:
        try:
            return provider, check_health(provider, cfg, log_dir=log_dir, env=env)
        except HealthCheckFailed as exc:
            replace = getattr(provider, "replace", None)
            if replace is None or not exc.bad_hosts:
                raise
            try:
                swaps = replace(exc.bad_hosts)
            except ClusterError as no_spare:
                raise HealthCheckFailed(f"{exc}\n{no_spare}", exc.report, exc.bad_hosts) from None
            print(f"health: replaced {', '.join(f'{a} -> {b}' for a, b in swaps)}; checking again", flush=True)


if __name__ == "__main__":
    main()
