"""The champion served under load while the alias moves (issue #19).

Two tiny policies are registered (nothing trained), ``champion`` points at the first, and the
champion server (``python -m infra.ops.champion_server``, the process ``deltaloop serve --champion``
starts) serves it. Eight client threads send ``/v1/chat/completions`` without pause while the test
promotes the second version and later rolls back, both with the ``deltaloop`` CLI, with a few
seconds of load before, between and after the moves (``deltaloop bench champion`` runs the long,
20-client version). Every request must be answered (200), each answer's version (header and ``weight_version``) must be the alias's
version at some moment between the request's start minus the server's reaction time (poll interval
plus the swap it recorded) and its end, both moves must be followed, and the server's pid must not
change. Latency and swap times are printed (``-s``), not asserted.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bench.champion import POLL_S, client, get, latency, register_policies, start_server
from infra.config import load_config
from infra.proc import wait_until

ROOT = Path(__file__).resolve().parents[2]
CLIENTS, SETTLE_S = 8, 5.0  # clients; seconds of load before, between and after the two moves


def _cli(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "deltaloop.cli", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.slow
def test_served_champion_follows_promote_and_rollback_without_dropping_a_request(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    cfg = load_config(ROOT / "configs/demo.yaml", [f"run_root={root}"])
    uri = cfg.resolved_tracking_uri()
    v1, v2 = register_policies(uri, root, cfg.tracking.registered_model, experiment=cfg.tracking.experiment)
    _cli("promote", v1, "--set", f"run_root={root}")
    proc, base = start_server(uri, cfg.tracking.registered_model, tmp_path)
    try:
        pid = get(f"{base}/health")["pid"]
        assert get(f"{base}/v1/models")["data"][0]["version"] == v1
        records: list[dict[str, Any]] = []
        stop = threading.Event()
        threads = [threading.Thread(target=client, args=(base, stop, records, k, "deltaloop-policy"))
                   for k in range(CLIENTS)]
        began = time.time()
        for t in threads:
            t.start()
        moves = [(0.0, 0.0, v1)]  # (before the command, after it, version): the alias moves in between
        time.sleep(SETTLE_S)
        t0 = time.time()
        _cli("promote", v2, "--reason", "champion swap test", "--set", f"run_root={root}")
        moves.append((t0, time.time(), v2))
        wait_until(lambda: get(f"{base}/health")["version"] == v2, 60, proc.dead_reason, "swap to v2")
        time.sleep(SETTLE_S)
        t0 = time.time()
        _cli("rollback", "--set", f"run_root={root}")
        moves.append((t0, time.time(), v1))
        wait_until(lambda: get(f"{base}/health")["version"] == v1, 60, proc.dead_reason, "swap back to v1")
        time.sleep(SETTLE_S)
        stop.set()
        seconds = time.time() - began
        for t in threads:
            t.join(90)
        health = get(f"{base}/health")
    finally:
        proc.terminate(timeout=20)
    _check(records, moves, health, pid, v1, v2, tmp_path, seconds)


def _check(records: list[dict[str, Any]], moves: list[tuple[float, float, str]], health: dict[str, Any], pid: int,
           v1: str, v2: str, tmp_path: Path, seconds: float) -> None:
    failed = [r for r in records if r.get("status") != 200]
    assert not failed, (len(failed), failed[:3], (tmp_path / "champion.log").read_text()[-3000:])
    assert health["pid"] == pid  # no restart
    swaps = [s for s in health["swaps"] if s["from"] is not None]
    assert [(s["from"], s["to"]) for s in swaps] == [(v1, v2), (v2, v1)]
    lag = POLL_S + max(s["seconds"] for s in swaps) + 1.0

    # the alias held moves[i]'s version at most from moves[i]'s command start to moves[i+1]'s end
    spans = [(m[0], moves[i + 1][1] if i + 1 < len(moves) else float("inf"), m[2]) for i, m in enumerate(moves)]
    for r in records:
        assert r["header"] == r["body_version"], r
        allowed = {v for lo, hi, v in spans if lo <= r["end"] and hi >= r["start"] - lag}
        assert r["header"] in allowed, (r, moves, lag)
    served = [r["header"] for r in sorted(records, key=lambda r: r["start"])]
    assert served[0] == v1 and v2 in served and served[-1] == v1
    stats = latency(records, moves, lag)
    print(f"\nrequests {len(records)} in {seconds:.0f}s by {CLIENTS} clients, failed 0; swaps "
          f"{[s['seconds'] for s in swaps]} s; {stats}")
