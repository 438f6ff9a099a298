"""``deltaloop bench champion``: the served champion under load while the alias moves.

Registers two policies (nothing trained: the model of the config, the second a copy of the first
under another version; the demo's tiny model gets a second seed instead) in a fresh sqlite MLflow
store, points ``champion`` at the first, starts the champion server (``python -m
infra.ops.champion_server``, as ``deltaloop serve --champion`` does) and runs ``clients`` threads
sending ``/v1/chat/completions`` (8 tokens) for ``duration_s`` while the alias is promoted to the
second version at 25% of the time and rolled back at 58%. Records per model: requests, failed
requests (the claim: 0), each swap's seconds (alias seen -> new version serving, from the
server's ``/health``), latency p50/p99 over the run and over requests started in a swap window
(from the alias move to poll + swap + 1 s after it), and whether the server pid stayed the same.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from infra.atomicio import write_json_atomic
from infra.config import load_config
from infra.model import load_policy, save_hf
from infra.proc import ServiceProcess, ServiceSpec, spawn, wait_until
from infra.registry import Registry, save_mlflow_model
from infra.tracking import Tracker

VERSION_HEADER = "x-deltaloop-model-version"
POLL_S = 1.0


def register_policies(uri: str, root: Path, name: str = "deltaloop-policy", seeds: tuple[int, ...] = (0, 1),
                      experiment: str = "deltaloop", config: str = "configs/demo.yaml") -> list[str]:
    """Register the config's model once per seed (exported, MLflow transformers flavour, as
    *promote* logs it); the tiny demo model differs per seed, others are the same weights."""
    cfg = load_config(config, [])
    tracker = Tracker(uri, experiment, artifact_root=f"file://{root}/mlartifacts")
    reg = Registry(uri, name)
    versions = []
    for seed in seeds:
        model, tok = load_policy(cfg.model, seed=seed)
        hf = save_hf(model.float(), tok, root / f"export-{seed}")
        del model
        tracker.start(f"policy-seed-{seed}")
        tracker.log_artifacts(save_mlflow_model(hf, root / f"mlflow-{seed}", f"seed {seed}"), "model")
        versions.append(reg.register(tracker.run_id or "", "model", {"seed": seed}).version)
        tracker.end()
    return versions


def start_server(uri: str, name: str, work: Path, threads: int = 1) -> tuple[ServiceProcess, str]:
    """The champion server on a free loopback port; returns it and its base URL once it listens."""
    state = work / "champion.json"
    proc = spawn(ServiceSpec.python("champion", "infra.ops.champion_server", [
        "--tracking-uri", uri, "--model", name, "--port", "0", "--poll", str(POLL_S), "--threads", str(threads),
        "--workdir", str(work / "served"), "--state-file", str(state)], log=str(work / "champion.log")))
    wait_until(lambda: state.exists(), 300, proc.dead_reason, "champion server")
    return proc, f"http://127.0.0.1:{json.loads(state.read_text())['port']}"


def get(url: str) -> dict[str, Any]:
    """GET a JSON document."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def client(base: str, stop: threading.Event, out: list[dict[str, Any]], k: int, model: str) -> None:
    """Send chat requests until ``stop``; append one record per request (start, end, status, versions)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": f"client {k}"}],
                       "max_tokens": 8, "temperature": 1.0}).encode()
    while not stop.is_set():
        rec: dict[str, Any] = {"start": time.time()}
        try:
            req = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                doc = json.loads(resp.read())
                rec.update(status=resp.status, header=resp.headers.get(VERSION_HEADER),
                           body_version=str(doc.get("weight_version")))
        except Exception as exc:  # recorded: a failed request is what this measures
            rec.update(status=getattr(exc, "code", None), error=f"{type(exc).__name__}: {exc}")
        rec["end"] = time.time()
        out.append(rec)


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``xs``."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def latency(records: list[dict[str, Any]], moves: list[tuple[float, float, str]], lag: float) -> dict[str, Any]:
    """p50/p99 ms over all requests and over those started within ``lag`` after an alias move."""
    lat = [r["end"] - r["start"] for r in records]
    near = [r["end"] - r["start"] for r in records for t0, _, _ in moves[1:] if t0 <= r["start"] <= t0 + lag]
    return {"p50_ms": statistics.median(lat) * 1e3, "p99_ms": percentile(lat, 0.99) * 1e3,
            "swap_window_requests": len(near),
            "swap_window_p50_ms": statistics.median(near) * 1e3 if near else None,
            "swap_window_p99_ms": percentile(near, 0.99) * 1e3 if near else None}


def measure(config: str, clients: int, duration_s: float, threads: int = 1) -> dict[str, Any]:
    """One load run (see the module docstring) on the model of ``config``."""
    with tempfile.TemporaryDirectory(prefix="bench-champion-") as tmp:
        work = Path(tmp)
        uri = f"sqlite:///{work / 'mlflow.db'}"
        v1, v2 = register_policies(uri, work, config=config)
        reg = Registry(uri, "deltaloop-policy")
        reg.point("champion", v1)
        proc, base = start_server(uri, "deltaloop-policy", work, threads)
        try:
            pid = get(f"{base}/health")["pid"]
            records: list[dict[str, Any]] = []
            stop = threading.Event()
            pool = [threading.Thread(target=client, args=(base, stop, records, k, "deltaloop-policy"))
                    for k in range(clients)]
            began = time.time()
            for t in pool:
                t.start()
            moves = [(0.0, 0.0, v1)]
            for frac, target, move in ((0.25, v2, lambda: reg.point("champion", v2)),
                                       (0.58, v1, lambda: reg.rollback("champion"))):
                time.sleep(max(0.0, began + frac * duration_s - time.time()))
                t0 = time.time()
                move()
                moves.append((t0, time.time(), target))
                wait_until(lambda: get(f"{base}/health")["version"] == target, 300, proc.dead_reason, "swap")
            time.sleep(max(0.0, began + duration_s - time.time()))
            stop.set()
            for t in pool:
                t.join(180)
            health = get(f"{base}/health")
        finally:
            proc.terminate(timeout=20)
    swaps = [s["seconds"] for s in health["swaps"] if s["from"] is not None]
    return {"config": config, "clients": clients, "duration_s": duration_s, "requests": len(records),
            "failed": sum(r.get("status") != 200 for r in records), "swap_seconds": swaps,
            "same_pid": health["pid"] == pid, **latency(records, moves, POLL_S + max(swaps) + 1.0)}


def run(json_path: Path, quick: bool) -> list[dict[str, Any]]:
    """The demo model with 20 clients (and SmolLM2 with 8 unless ``quick``); table + JSON."""
    import os

    from bench.machine import cpu_model, load_avg

    hardware = f"{cpu_model()}, {os.cpu_count()} cores, load avg {load_avg():.1f} at start"
    runs = [("configs/demo.yaml", 20, 20.0 if quick else 60.0)]
    if not quick:
        runs.append(("configs/smollm2.yaml", 8, 50.0))
    records = [{**measure(c, n, d), "hardware": hardware} for c, n, d in runs]
    write_json_atomic(json_path, records, indent=2)
    for r in records:
        print(f"{r['config']}: {r['requests']} requests by {r['clients']} clients in {r['duration_s']:.0f}s, "
              f"failed {r['failed']}, swaps {r['swap_seconds']} s, same pid {r['same_pid']}; latency p50/p99 "
              f"{r['p50_ms']:.0f}/{r['p99_ms']:.0f} ms, in swap windows ({r['swap_window_requests']}) "
              f"{r['swap_window_p50_ms']:.0f}/{r['swap_window_p99_ms']:.0f} ms")
    return records
