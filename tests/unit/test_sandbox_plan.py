"""The sandbox pool model and the fleet planner, on crafted distributions (no sandboxes started)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infra.sandbox.plan import Distributions, PlanError, PoolModel, simulate
from infra.sandbox.plan_search import Load, load_distributions, plan, replacement_per_s

ROOT = Path(__file__).resolve().parents[2]
FAST = Distributions(start_ms=(0.0,), service_ms=(10.0,))


def test_zero_start_latency_no_failures_and_no_buffer_never_waits() -> None:
    res = simulate(PoolModel(8, 0, FAST, max_jobs_per_sandbox=3), jobs=400)
    assert res.jobs == 400 and res.wait_pct(1.0) == 0.0
    assert res.retired >= 120  # recycling every 3 jobs: ~133 sandboxes replaced, none waited for


def test_a_warm_buffer_hides_start_latency() -> None:
    slow = Distributions(start_ms=(200.0,), service_ms=(10.0,))
    no_buffer = simulate(PoolModel(4, 0, slow, max_jobs_per_sandbox=5), jobs=400)
    buffered = simulate(PoolModel(4, 8, slow, max_jobs_per_sandbox=5), jobs=400)
    assert no_buffer.wait_pct(0.99) >= 150.0  # a recycled sandbox's client waits for its replacement
    assert buffered.wait_pct(0.99) < no_buffer.wait_pct(0.99)
    assert buffered.idle_seconds > no_buffer.idle_seconds  # the buffer's price


def test_creation_rate_limit_makes_waits_grow_as_the_deficit() -> None:
    """One sandbox per job, 1 job/s per client, 10 clients: 10 retirements/s against 2 creations/s.
    After the burst the deficit grows by 8/s, so the job started at t waits about (8t - buffer)/2 s
    for its sandbox: the longest wait grows with the horizon, and it is bounded by the token rate."""
    d = Distributions(start_ms=(0.0,), service_ms=(1000.0,))
    m = PoolModel(10, 0, d, max_jobs_per_sandbox=1, create_rate=2.0, burst=1.0)
    short, long = simulate(m, horizon_s=20, seed=1), simulate(m, horizon_s=40, seed=1)
    assert long.wait_pct(1.0) > 1.8 * short.wait_pct(1.0) > 0
    assert long.started <= 1 + 2.0 * 40 + 10  # the bucket: burst + rate × time (+ the prewarmed 10)
    unlimited = simulate(PoolModel(10, 0, d, max_jobs_per_sandbox=1), horizon_s=20, seed=1)
    assert unlimited.wait_pct(1.0) == 0.0


def test_deterministic_per_seed() -> None:
    d = Distributions(start_ms=(50.0, 80.0, 300.0), service_ms=(5.0, 9.0, 30.0), retire_prob=0.05,
                      start_fail_prob=0.1)
    m = PoolModel(6, 2, d, max_jobs_per_sandbox=4, think_ms=20.0, create_rate=40.0, burst=5)
    a, b, c = simulate(m, jobs=500, seed=7), simulate(m, jobs=500, seed=7), simulate(m, jobs=500, seed=8)
    assert (a.waits_ms, a.idle_seconds, a.started) == (b.waits_ms, b.idle_seconds, b.started)
    assert a.waits_ms != c.waits_ms


def test_bad_inputs_raise_plan_error() -> None:
    with pytest.raises(PlanError):
        Distributions(start_ms=(), service_ms=(1.0,))
    with pytest.raises(PlanError):
        PoolModel(0, 0, FAST)
    with pytest.raises(PlanError):
        simulate(PoolModel(1, 0, FAST), jobs=10, horizon_s=5)


def test_plan_finds_the_smallest_buffer_and_is_exact_below_exact_max() -> None:
    slow = Distributions(start_ms=(300.0,), service_ms=(20.0,))
    load = Load(50, think_ms=200.0, max_jobs_per_sandbox=2, horizon_s=30)
    out = plan(load, slow, target_p99_ms=1.0)
    assert out["method"] == "exact" and out["buffer"] is not None and out["p99_wait_ms"] <= 1.0
    below = [p for p in out["curve"] if p["buffer"] == out["buffer"] - 1]
    assert below and below[0]["p99_wait_ms"] > 1.0  # one fewer misses the target
    assert out["idle_cost_per_hour"] == pytest.approx(out["mean_idle_sandboxes"] * 0.05)


def test_scaled_plan_agrees_with_the_exact_one() -> None:
    """The scaling argument, checked where both run: 1,000 clients simulated whole and as 100."""
    d = Distributions(start_ms=(100.0, 200.0, 400.0), service_ms=(20.0, 50.0), retire_prob=0.01)
    load = Load(1000, think_ms=1000.0, max_jobs_per_sandbox=20, create_rate=30.0, burst=50, horizon_s=40)
    exact = plan(load, d, target_p99_ms=50.0, exact_max=1000)
    scaled = plan(load, d, target_p99_ms=50.0, exact_max=100)
    assert exact["method"] == "exact" and scaled["scale"] == 10
    assert exact["buffer"] is not None and scaled["buffer"] is not None
    assert abs(scaled["buffer"] - exact["buffer"]) <= 0.25 * exact["buffer"] + 10  # one scaled step
    assert scaled["idle_cost_per_hour"] == pytest.approx(exact["idle_cost_per_hour"], rel=0.1)


def test_replacement_rate_and_unsustainable_load() -> None:
    d = Distributions(start_ms=(100.0,), service_ms=(0.0,), retire_prob=0.0)
    load = Load(1000, think_ms=1000.0, max_jobs_per_sandbox=10, create_rate=30.0, burst=50, horizon_s=20)
    assert replacement_per_s(load, d) == pytest.approx(100.0)
    out = plan(load, d, target_p99_ms=10.0)
    assert out["steady_state"] is False and out["buffer"] is not None
    assert out["buffer"] >= (100 - 30) * 20 * 0.5  # the deficit over the horizon, roughly


def test_load_distributions_reads_bench_records(tmp_path: Path) -> None:
    shipped = load_distributions()
    assert shipped.start_ms and shipped.service_ms
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"runtime": "bwrap", "jobs": 10}]))
    with pytest.raises(PlanError, match="run it again"):
        load_distributions(old)
    with pytest.raises(PlanError, match="no usable 'docker'"):
        load_distributions(old, runtime="docker")


def test_cli_plan_sandboxes_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "deltaloop.cli", "plan", "sandboxes", "--concurrency", "20000",
                        "--create-rate", "30", "--burst", "2000", "--horizon-s", "120", "--exact-max", "200",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert {"buffer", "p99_wait_ms", "idle_cost_per_hour"} <= set(data)
    assert data["scale"] == 100 and data["buffer"] % 100 == 0
    assert "buffer" in r.stdout and "idle cost" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "deltaloop.cli", "plan", "sandboxes", "--concurrency", "10",
                          "--bench", str(tmp_path / "missing.json")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 1 and "cannot read sandbox bench results" in bad.stderr
