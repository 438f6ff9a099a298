"""``deltaloop bench sandbox``: warm pool versus a fresh sandbox per job, for each runtime.

Workload: realistic scoring jobs of the funcfit verifier — a one-line function of ``x`` checked on
6 hidden points; 80% correct, 15% wrong, 5% raise. Both arms use the same in-sandbox harness and
the same concurrency (``CONCURRENCY`` client threads, one job each at a time):

* **pool** — ``SandboxPool.verify_many([job])`` against warm sandboxes (started before timing,
  as in the pipeline where the pool is a long-lived service);
* **naive** — a brand-new sandbox per job (``docker run --rm`` / one ``bwrap`` invocation), torn
  down after it.

Per runtime it records jobs/s, p50/p99 per-job latency, the pool's own overhead per job (host-side
latency minus the program's run time measured inside the sandbox) and ``lost`` (jobs without a
valid result, or whose reward differs from the expected one). For the fleet planner
(``deltaloop plan sandboxes``, :mod:`infra.sandbox.plan`) it also keeps the raw samples of the pool
arm: every sandbox start (``start_ms_samples``), every job's time holding its sandbox
(``service_ms_samples``), and the fractions of jobs that retired their sandbox for a fault
(``retire_prob``) and of starts that failed (``start_fail_prob``).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from infra.atomicio import write_json_atomic
from infra.config import SandboxConfig
from infra.sandbox import REASONS, SandboxError, SandboxPool, TestCase, VerifyRequest, create_runtime
from infra.sandbox import protocol
from infra.sandbox.handle import RunnerHandle
from infra.sandbox.pool import Runtime

CONCURRENCY = 4
FAMILIES: list[tuple[str, Callable[[int, int, int], int]]] = [
    ("{a}*x+{b}", lambda a, b, x: a * x + b),
    ("{a}*x*x+{b}", lambda a, b, x: a * x * x + b),
    ("x*x+{a}*x+{b}", lambda a, b, x: x * x + a * x + b),
    ("(x+{a})*{b}", lambda a, b, x: (x + a) * b),
    ("x%{a}+{b}", lambda a, b, x: x % a + b),
]


def workload(n: int, seed: int = 0) -> list[tuple[VerifyRequest, float]]:
    """``n`` (request, expected reward) pairs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        template, fn = rng.choice(FAMILIES)
        a, b = rng.randint(1, 9), rng.randint(0, 9)
        xs = [rng.randint(6, 40) for _ in range(6)]
        tests = [TestCase([x], fn(a, b, x)) for x in xs]
        roll = rng.random()
        if roll < 0.80:
            body, reward = template.format(a=a, b=b), 1.0
        elif roll < 0.95:
            body, reward = template.format(a=a, b=b) + "+1", 0.0
        else:
            body, reward = "x/0", 0.0
        out.append((VerifyRequest(f"def f(x):\n    return {body}\n", "f", tests, timeout_s=2.0), reward))
    return out


class TimedRuntime:
    """A runtime whose sandbox starts and job calls are timed: the planner's distributions, measured
    on the real pool without changing it (the pool sees the same runtime and handles)."""

    def __init__(self, inner: Runtime) -> None:
        self.inner = inner
        self.name = inner.name
        self.start_ms: list[float] = []
        self.service_ms: list[float] = []
        self.calls: dict[str, tuple[float, float, float]] = {}  # program -> (ready, start, end) of its job's call
        self.start_failures = 0
        self._lock = threading.Lock()

    def spawn(self) -> RunnerHandle:
        t0 = time.perf_counter()
        try:
            handle = self.inner.spawn()
        except SandboxError:
            with self._lock:
                self.start_failures += 1
            raise
        with self._lock:
            self.start_ms.append((time.perf_counter() - t0) * 1000)
        return _TimedHandle(handle, self, time.perf_counter())  # type: ignore[return-value]

    def naive(self, job: dict[str, Any]) -> dict[str, Any]:
        return self.inner.naive(job)

    def close(self) -> None:
        self.inner.close()

    def reset(self) -> None:
        """Forget the samples so far (the warm-up's)."""
        with self._lock:
            self.start_ms.clear()
            self.service_ms.clear()
            self.calls.clear()
            self.start_failures = 0


class _TimedHandle:
    """A sandbox handle whose ``call`` (one job holding the sandbox) is timed; all else delegates."""

    def __init__(self, inner: RunnerHandle, owner: TimedRuntime, ready: float) -> None:
        self._inner = inner
        self._owner = owner
        self._ready = ready  # when it last became free: started, or its last job ended

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def call(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            return self._inner.call(job, timeout)
        finally:
            t1 = time.perf_counter()
            with self._owner._lock:
                self._owner.service_ms.append((t1 - t0) * 1000)
                self._owner.calls[str(job.get("program"))] = (self._ready, t0, t1)
            self._ready = t1


def planner_samples(timed: TimedRuntime, m: dict[str, float]) -> dict[str, Any]:
    """The planner's fields of a record: raw samples and fault rates of a pool's metrics window."""
    starts = len(timed.start_ms) + timed.start_failures
    return {
        "start_ms_samples": [round(x, 3) for x in timed.start_ms],
        "service_ms_samples": [round(x, 3) for x in timed.service_ms],
        "retire_prob": (m["anomalies"] + m["infra_failures"]) / max(1.0, m["jobs"]),
        "start_fail_prob": timed.start_failures / starts if starts else 0.0,
    }


def _pct(values: list[float], q: float) -> float:
    data = sorted(values)
    return data[min(len(data) - 1, int(round(q * (len(data) - 1))))] if data else 0.0


def _drive(fn: Callable[[Any], Any], items: list[Any]) -> tuple[list[Any], list[float], float]:
    """Run ``fn`` over items with CONCURRENCY threads; results, per-item latency (ms), wall seconds."""

    def timed(item: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        try:
            res = fn(item)
        except Exception as exc:  # a lost job is counted, not raised
            res = exc
        return res, (time.perf_counter() - t0) * 1000

    t0 = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as ex:
        pairs = list(ex.map(timed, items))
    wall = time.perf_counter() - t0
    return [p[0] for p in pairs], [p[1] for p in pairs], wall


def bench_runtime(runtime: str, n_pool: int, n_naive: int) -> dict[str, Any]:
    """Measure one runtime; returns the JSON record."""
    cfg = SandboxConfig(runtime=runtime, concurrency=CONCURRENCY, min_warm=CONCURRENCY, max_warm=2 * CONCURRENCY,
                        timeout_s=2.0)
    jobs = workload(n_pool)
    timed = TimedRuntime(create_runtime(cfg))
    with SandboxPool(cfg, timed) as pool:
        pool.verify_many([r for r, _ in jobs[: 2 * CONCURRENCY]])  # touch every warm sandbox once
        pool.metrics(reset=True)
        warm_starts = list(timed.start_ms)
        timed.reset()
        results, lat, wall = _drive(lambda pair: pool.verify_many([pair[0]])[0], jobs)
        m = pool.metrics()
    samples = planner_samples(timed, m)
    samples["start_ms_samples"] = [round(x, 3) for x in warm_starts] + samples["start_ms_samples"]
    lost = sum(
        1 for (_, want), r in zip(jobs, results)
        if isinstance(r, Exception) or r.reason not in REASONS or abs(r.reward - want) > 1e-9
    )
    runtime_obj = create_runtime(cfg)
    try:
        naive_jobs = workload(n_naive, seed=1)
        naive_results, naive_lat, naive_wall = _drive(
            lambda pair: runtime_obj.naive(protocol.verify_job(pair[0], 2.0)), naive_jobs)
        naive_lost = sum(
            1 for (req, want), r in zip(naive_jobs, naive_results)
            if isinstance(r, Exception) or abs(protocol.to_verify_result(req, r).reward - want) > 1e-9
        )
    finally:
        runtime_obj.close()
    return {
        "runtime": runtime,
        "jobs": n_pool,
        "naive_jobs": n_naive,
        "concurrency": CONCURRENCY,
        "lost": lost,
        "naive_lost": naive_lost,
        "pool_jobs_per_s": n_pool / wall,
        "naive_jobs_per_s": n_naive / naive_wall,
        "speedup": (n_pool / wall) / max(1e-9, n_naive / naive_wall),
        "pool_p50_ms": _pct(lat, 0.5),
        "pool_p99_ms": _pct(lat, 0.99),
        "naive_p50_ms": _pct(naive_lat, 0.5),
        "naive_p99_ms": _pct(naive_lat, 0.99),
        "pool_overhead_p50_ms": m["overhead_p50_ms"],
        "pool_overhead_p99_ms": m["overhead_p99_ms"],
        "pool_run_p50_ms": m["run_p50_ms"],
        "pool_queue_wait_p50_ms": m["queue_wait_p50_ms"],
        "pool_sandboxes_started": m["sandboxes_started"],
        "pool_mean_ms": statistics.fmean(lat) if lat else 0.0,
        **samples,
    }


def run(json_path: Path, quick: bool) -> list[dict[str, Any]]:
    """Benchmark bwrap and docker (each skipped with an ``error`` record if unavailable)."""
    n_pool, n_naive = (150, 40) if quick else (1000, 1000)
    records: list[dict[str, Any]] = []
    for runtime in ("bwrap", "docker"):
        try:
            records.append(bench_runtime(runtime, n_pool, n_naive))
        except SandboxError as exc:
            records.append({"runtime": runtime, "error": str(exc)})
    write_json_atomic(json_path, records, indent=2)
    cols = ["runtime", "jobs", "lost", "pool_jobs_per_s", "naive_jobs_per_s", "speedup", "pool_p50_ms",
            "pool_p99_ms", "naive_p50_ms", "naive_p99_ms", "pool_overhead_p50_ms"]
    print("  ".join(f"{c:>14}" for c in cols))
    for rec in records:
        if "error" in rec:
            print(f"{rec['runtime']:>14}  unavailable: {rec['error']}")
            continue
        print("  ".join(f"{rec[c]:>14.1f}" if isinstance(rec[c], float) else f"{rec[c]:>14}" for c in cols))
    return records


if __name__ == "__main__":  # pragma: no cover
    run(Path("bench-sandbox.json"), quick=True)
