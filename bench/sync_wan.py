"""The ``object_store`` records of ``bench sync``: weight sync across regions through shaped links.

Set-up (:mod:`bench.wan_link`): the S3 server (moto) in its own network namespace; ``readers``
reader processes (:mod:`bench.sync_reader`), each in its own namespace behind a link of
``link_mbps`` MB/s each way and ``rtt_ms`` round trip (netem, or tbf + a delay relay where the
kernel has no netem: ``latency_method``); the publisher in this process, in the root namespace,
on an unshaped link to the store (the trainer's region).

Per learning rate: real AdamW steps on SmolLM2-135M (:func:`bench.weightsync.train_versions`), each
published as the next version by a :class:`VersionPublisher` with the shipped snapshot policy
(snapshots in the background lane, uploading while later deltas commit). Training is untimed and
runs between syncs. Per version, seconds from ``publish`` called ("the trainer has the new
weights") to the last reader's fetch returning (the version applied in place, every chunk's digest
verified), and the bytes each reader's link received; once every reader has answered, each
reader's whole-model digest is compared with the published one (outside the timed window, so no
reader's check competes with another's fetch for the shared cores). Version 1 is the full model
(zstd) through the same links: its time is ``full_seconds``, and ``full_floor_seconds`` is what
the links alone would allow for it (its measured time also pays the S3 server's and the readers'
CPU). ``floor_seconds`` (median over the delta versions) = 2 x RTT + the bytes a reader received
/ link rate + one pass over the model at this machine's memory copy bandwidth.

``amortized_fraction`` = bytes per version after the first (deltas and snapshots, manifests
included) / bf16 bytes, the larger of: what the publisher uploaded in the run, and the cadence's
steady state, mean delta x (1 + 1/f) (with ``snapshot_chain_fraction`` f a snapshot is taken once
the deltas since the last one add up to f snapshots; a short run may end before the first).

Late joiner: one more reader in its own shaped namespace, started idle, fetches version
``join_at`` from nothing after every reader has it: at most one start (full version or snapshot)
plus the deltas after it (``join_frame_bytes`` <= ``join_bound_bytes``).

All processes share this machine's CPUs (publisher, readers, relays, the S3 server): the
``*_cpu_seconds*`` fields say how much of a sync is CPU work, ``machine_cpu_seconds_p50`` that of
every process together and ``machine_busy_fraction_p50`` its share of what the cores could give
in the sync's wall time.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from bench.sync_reader import model_digest
from bench.wan_link import WanLinks

LRS = (1e-6, 3e-6, 1e-5)
JOIN_AT = 37


def memory_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Bytes/s of a large in-memory copy (best of ``reps``): the cost of one pass over the model."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


class Reader:
    """A :mod:`bench.sync_reader` process in a namespace, talked to over pipes."""

    def __init__(self, links: WanLinks, index: int, endpoint: str, bucket: str, prefix: str, log: str) -> None:
        argv = links.exec_argv(links.client_ns(index), [
            sys.executable, "-m", "bench.sync_reader", "--endpoint", endpoint, "--bucket", bucket,
            "--prefix", prefix, "--threads", "2"])
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True, start_new_session=True)
        self.log = log

    def _send(self, cmd: dict[str, int]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def ask(self, version: int) -> None:
        """Send the fetch command (the control plane's "version N is out")."""
        self._send({"fetch": version})

    def ask_digest(self) -> None:
        """Ask for the digest of the weights it holds (the bits check, after the timed fetch)."""
        self._send({"digest": 1})

    def answer(self) -> dict[str, Any]:
        """The next JSON line the reader prints; RuntimeError with its log if it died."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            tail = Path(self.log).read_text()[-3000:]
            raise RuntimeError(f"bench reader died (exit {self.proc.poll()}); log {self.log}:\n{tail}")
        return json.loads(line)

    def stop(self) -> None:
        """Close its stdin (it exits), kill it if it does not."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def machine_busy_seconds() -> float:
    """CPU-seconds this machine has spent busy since boot, over all its cores (``/proc/stat``: all
    but idle and iowait; 10 ms ticks), to say how much of a sync's wall time the cores were full."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _sync_version(pub: Any, state: dict[str, Any], readers: list[Reader]) -> dict[str, Any]:
    """Publish ``state``, have every reader fetch it; one row of timings and bytes (bits checked)."""
    expect = model_digest(state)
    busy0 = machine_busy_seconds()
    t0 = time.monotonic()
    info = pub.publish(state)
    t_pub = time.monotonic()
    for r in readers:
        r.ask(info.version)
    got = [r.answer() for r in readers]
    busy = machine_busy_seconds() - busy0
    for r in readers:  # the bits check, once every reader has answered: it is not part of the sync
        r.ask_digest()
    for g, r in zip(got, readers):
        g["digest"] = r.answer()["digest"]
    bad = [g for g in got if g["version"] != info.version or g["digest"] != expect]
    if bad:
        raise RuntimeError(f"version {info.version}: a reader serves other bits: {bad[0]}")
    return {
        "version": info.version, "kind": info.kind, "seconds": max(g["t1"] for g in got) - t0,
        "publish_seconds": t_pub - t0, "bytes_written": info.bytes_written, "raw_bytes": info.raw_bytes,
        "snapshot_started": info.snapshot_started, "snapshot_in_flight": pub.snapshot_in_flight is not None,
        "fetch_seconds": [g["t1"] - g["t0"] for g in got], "notify_seconds": [g["t0"] - t_pub for g in got],
        "wire_bytes": [g["wire_bytes"] for g in got], "frame_bytes": [g["frame_bytes"] for g in got],
        "cpu_seconds": [g["cpu_s"] for g in got], "machine_cpu_seconds": busy,
    }


def _join(joiner: Reader, version: int, rows: list[dict[str, Any]], state_digest: str) -> dict[str, Any]:
    """The late joiner fetches ``version`` from nothing; its bytes against one start + the deltas after."""
    joiner.ask(version)
    g = joiner.answer()
    joiner.ask_digest()
    g["digest"] = joiner.answer()["digest"]
    start = int(str(g["path"]).split()[-1])  # "keyframe K" / "snapshot K"
    start_bytes = rows[0]["bytes_written"]  # a start is the whole model, zstd (version 1's size)
    bound = start_bytes + sum(r["bytes_written"] for r in rows if start < r["version"] <= version)
    return {
        "join_version": version, "join_path": g["path"], "join_seconds": g["t1"] - g["t0"],
        "join_wire_bytes": g["wire_bytes"], "join_frame_bytes": g["frame_bytes"], "join_bound_bytes": bound,
        "join_bits_ok": g["digest"] == state_digest and g["version"] == version,
        "join_within_bound": g["frame_bytes"] <= bound,
    }


def run_lr(links: WanLinks, endpoints: list[str], pub_endpoint: str, model: tuple[dict, dict], lr: float,
           versions: int, join_at: int, workdir: str, shape: tuple[int, int],
           delta_shard_bytes: int) -> dict[str, Any]:
    """Publish ``versions`` AdamW versions at ``lr`` to the readers; the rows and the joiner's record."""
    from bench.weightsync import train_versions
    from infra.storage import S3Store
    from infra.weightsync import VersionPublisher

    bucket, prefix = f"wan-{int(time.time() * 1000) % 10**9}", "w"
    S3Store(f"s3://{bucket}", endpoint_url=pub_endpoint).ensure_bucket()
    n = len(endpoints) - 1  # the last namespace is the late joiner's
    readers = [Reader(links, i, endpoints[i], bucket, prefix, f"{workdir}/reader{i}.log") for i in range(n + 1)]
    pub = VersionPublisher(S3Store(f"s3://{bucket}", endpoint_url=pub_endpoint), prefix,
                           threads=os.cpu_count() or 2, delta_shard_bytes=delta_shard_bytes)
    rows: list[dict[str, Any]] = []
    joined: dict[str, Any] = {}
    try:
        for r in readers:
            assert r.answer().get("ready")
        gen = train_versions(model[0], model[1], lr, shape[0], shape[1], seed=11)
        train_s = []
        for v in range(1, versions + 1):
            t0 = time.perf_counter()
            state = next(gen)
            train_s.append(time.perf_counter() - t0)
            rows.append(_sync_version(pub, state, readers[:n]))
            if v == join_at:
                joined = _join(readers[n], v, rows, model_digest(state))
        snap = {"snapshot_bytes": pub.snapshot_bytes_written, "newest_start": pub.last_start,
                "snapshot_in_flight_at_end": pub.snapshot_in_flight}
    finally:
        pub.close()
        for r in readers:
            r.stop()
    return {"rows": rows, "join": joined, "train_step_seconds": statistics.median(train_s[1:]), **snap}


def summarize(out: dict[str, Any], lr: float, readers: int, rtt_ms: float, link_mbps: float,
              mem_bw: float) -> dict[str, Any]:
    """One record from :func:`run_lr`'s rows (see the module docstring for each field)."""
    from infra.weightsync.publisher import DEFAULT_CHAIN_FRACTION as F

    rows = out["rows"]
    full, deltas = rows[0], rows[1:]
    bf16 = full["raw_bytes"]
    secs = [r["seconds"] for r in deltas]
    rate = link_mbps * 1e6
    floors = [2 * rtt_ms / 1e3 + statistics.mean(r["wire_bytes"]) / rate + bf16 / mem_bw for r in deltas]
    delta_mean = statistics.mean(r["bytes_written"] for r in deltas)
    in_run = (sum(r["bytes_written"] for r in deltas) + out["snapshot_bytes"]) / len(deltas) / bf16
    steady = delta_mean * (1 + 1 / F) / bf16 if F > 0 else delta_mean / bf16
    p50 = float(np.percentile(secs, 50))
    med = lambda key: statistics.median(max(r[key]) for r in deltas)  # noqa: E731  (slowest reader)
    return {
        "placement": "object_store", "readers": readers, "rtt_ms": rtt_ms, "link_mbps": link_mbps, "lr": lr,
        "versions": len(rows), "p50_seconds": p50, "p99_seconds": float(np.percentile(secs, 99)),
        "max_seconds": max(secs), "amortized_fraction": max(in_run, steady),
        "amortized_fraction_in_run": in_run, "amortized_fraction_steady": steady,
        "delta_fraction_mean": delta_mean / bf16,
        "reader_fraction": statistics.mean(statistics.mean(r["wire_bytes"]) for r in deltas) / bf16,
        "snapshot_chain_fraction": F, "snapshot_bytes": out["snapshot_bytes"],
        "snapshots_committed": int(out["newest_start"] > 1), "newest_start": out["newest_start"],
        "versions_during_snapshot_upload": sum(r["snapshot_in_flight"] for r in deltas),
        "full_seconds": full["seconds"], "full_bytes": full["bytes_written"], "bf16_bytes": bf16,
        "floor_seconds": statistics.median(floors), "p50_minus_floor_seconds": p50 - statistics.median(floors),
        "speedup_vs_full": full["seconds"] / p50,
        # the full checkpoint at the links' own speed (its measured time also pays the S3 server's CPU)
        "full_floor_seconds": 2 * rtt_ms / 1e3 + statistics.mean(full["wire_bytes"]) / rate + bf16 / mem_bw,
        "speedup_vs_full_floor": (2 * rtt_ms / 1e3 + statistics.mean(full["wire_bytes"]) / rate + bf16 / mem_bw) / p50,
        "publish_seconds_p50": statistics.median(r["publish_seconds"] for r in deltas),
        "fetch_seconds_p50": med("fetch_seconds"), "reader_cpu_seconds_p50": med("cpu_seconds"),
        "notify_seconds_p50": med("notify_seconds"),
        # every process's CPU in a sync (publisher, readers, relays, S3 server), and its share of
        # what the cores could give in that wall time (1.0: every core busy throughout)
        "machine_cpu_seconds_p50": statistics.median(r["machine_cpu_seconds"] for r in deltas),
        "machine_busy_fraction_p50": statistics.median(r["machine_cpu_seconds"] / (r["seconds"] * (os.cpu_count() or 1))
                                                      for r in deltas),
        "cores": os.cpu_count(),
        "memory_gbps": mem_bw / 1e9, "train_step_seconds": out["train_step_seconds"],
        "per_version": [{k: r[k] for k in ("version", "kind", "seconds", "publish_seconds", "bytes_written",
                                           "wire_bytes", "fetch_seconds", "cpu_seconds", "machine_cpu_seconds",
                                           "snapshot_in_flight")}
                        for r in rows],
        **out["join"],
    }


@contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """SIGTERM raises SystemExit meanwhile, so the links and their processes are torn down."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def records(quick: bool, readers: int = 4, rtt_ms: float = 40.0, link_mbps: float = 50.0,
            versions: int | None = None, lrs: tuple[float, ...] | None = None,
            delta_shard_bytes: tuple[int, ...] | None = None,
            log: Any = print, done: Any = None) -> list[dict[str, Any]]:
    """The object_store WAN records (one per learning rate and delta shard size); see the module
    docstring. ``delta_shard_bytes`` compares publisher shard sizes side by side through the same
    links (None: the publisher's default). ``done``, when given, is called with the records so far
    after each record (a long run keeps them)."""
    from bench.s3local import moto_server
    from bench.weightsync import load_smollm2
    from infra.gcpause import freeze_startup_objects
    from infra.weightsync.publisher import DEFAULT_DELTA_SHARD_BYTES

    lrs = lrs or (LRS[:1] if quick else LRS)
    versions = versions or (12 if quick else 51)
    join_at = min(JOIN_AT, versions - 2) if quick else min(JOIN_AT, versions)
    shape = (1, 16) if quick else (2, 32)
    model = load_smollm2(2 if quick else None)
    mem_bw = memory_bandwidth()
    freeze_startup_objects()  # the trainer process does this too (infra.gcpause)
    out: list[dict[str, Any]] = []
    with _exit_on_sigterm(), tempfile.TemporaryDirectory(prefix="bench-sync-") as d, \
            WanLinks(clients=readers + 1, rtt_ms=rtt_ms, rate=link_mbps * 1e6) as links, \
            moto_server(netns=links.server_ns, keep_alive=True) as (_host, port):
        endpoints = links.start_relays(port, d)
        log(f"links up: {readers} readers + 1 joiner, RTT {rtt_ms:g} ms, {link_mbps:g} MB/s each way, "
            f"latency by {links.latency_method}")
        for lr, shard in [(lr, s) for lr in lrs for s in (delta_shard_bytes or (DEFAULT_DELTA_SHARD_BYTES,))]:
            t0 = time.perf_counter()
            res = run_lr(links, endpoints, f"http://{links.server_addr}:{port}", model, lr, versions, join_at, d, shape,
                         shard)
            rec = summarize(res, lr, readers, rtt_ms, link_mbps, mem_bw)
            rec.update({"delta_shard_bytes": shard, "latency_method": links.latency_method, "latency_note": links.latency_note,
                        "params": sum(p.numel() for p in model[0].values()), "layers": model[1]["layers"],
                        "quick": quick, "seconds_total": time.perf_counter() - t0,
                        "load_avg_1min": os.getloadavg()[0]})
            out.append(rec)
            if done is not None:
                done(out)
            log(f"object_store lr {lr:g}, delta shards {shard >> 10} KiB: p50 {rec['p50_seconds']:.3f}s "
                f"p99 {rec['p99_seconds']:.3f}s full {rec['full_seconds']:.2f}s ({rec['seconds_total']:.0f}s)")
    return out
