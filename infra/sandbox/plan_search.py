"""Plan a sandbox fleet: the smallest warm buffer that keeps p99 queue wait under a target.

``deltaloop plan sandboxes`` calls :func:`plan`. For one load (``concurrency`` rollouts, each
generating for ``think_ms`` then scoring one job) it searches the buffer with the pool model of
:mod:`infra.sandbox.plan` (exponential steps, then bisection; one seed for every candidate, so
the p99 curve is compared on the same random numbers) and reports the buffer, its queue waits and
the cost per hour of the sandboxes that sit idle under that policy.

**Method at scale.** Simulating every sandbox costs time in proportion to concurrency × jobs: a
million rollouts over ten minutes are ~10^8 jobs. The planner simulates a fleet scaled down by
``k = concurrency / n`` (``n`` = at most ``exact_max`` clients, default 1,000) with every
*extensive* quantity divided by ``k`` — clients, buffer, creation rate and burst — and every
*intensive* one kept: start latency, service time, think time, failure probabilities, recycle
limit. Why this holds: the pool's state is counts (idle, starting, busy, creation tokens) whose
rates are all proportional to fleet size (retirements ∝ clients, refills ∝ rate), so dividing
every count and every rate by ``k`` leaves the fluid (mean-field) trajectory of the *fractions*
— and so the time a job waits — unchanged; the buffer and idle sandbox-seconds scale back by
``k``. What does not scale is noise: fluctuations of a count grow like √n, so relative to its
mean they are √k larger in the small fleet, which makes the scaled answer conservative (a larger
buffer than the big fleet needs) when randomness, not a sustained deficit, drives the wait. The
buffer is found in steps of ``k`` sandboxes. Below ``exact_max`` the simulation is exact (k = 1).
``tests/unit/test_sandbox_plan.py`` checks the scaled answer against the exact one at a size
where both run.

The load is steady: the pool starts filled (``concurrency + buffer`` warm sandboxes; filling
them takes ``fill_seconds`` at the creation limit, reported), clients start at random points of
their think time, and waits are measured over ``horizon_s``. When sandboxes are retired faster
than the provider creates them (``replacement_per_s`` > ``create_rate``), no buffer keeps up for
ever: the deficit grows by the difference every second and the buffer found is the one that lasts
the horizon (``steady_state: false``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.sandbox.plan import Distributions, PlanError, PoolModel, SimResult, simulate

DEFAULT_BENCH = Path(__file__).with_name("plan_bwrap.json")


def load_distributions(path: str | Path | None = None, runtime: str = "bwrap") -> Distributions:
    """Start-latency and service-time samples and failure rates from ``deltaloop bench sandbox``
    JSON (its ``runtime`` record; default: a measured bwrap run shipped with the package)."""
    path = Path(path) if path is not None else DEFAULT_BENCH
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read sandbox bench results {path}: {exc}") from None
    records = records if isinstance(records, list) else [records]
    for rec in records:
        if isinstance(rec, dict) and rec.get("runtime") == runtime and "error" not in rec:
            if not rec.get("start_ms_samples") or not rec.get("service_ms_samples"):
                raise PlanError(f"{path}: the {runtime} record has no start_ms_samples/service_ms_samples "
                                "(written by `deltaloop bench sandbox` since the planner exists): run it again")
            return Distributions(tuple(float(x) for x in rec["start_ms_samples"]),
                                 tuple(float(x) for x in rec["service_ms_samples"]),
                                 retire_prob=float(rec.get("retire_prob", 0.0)),
                                 start_fail_prob=float(rec.get("start_fail_prob", 0.0)),
                                 source=f"{path} ({runtime})")
    raise PlanError(f"{path}: no usable {runtime!r} record (found {[r.get('runtime') for r in records]})")


@dataclass(frozen=True)
class Load:
    """The fleet to plan: sizes, provider limits, the policy's recycle limit, the horizon."""

    concurrency: int
    think_ms: float = 5000.0
    create_rate: float | None = None
    burst: float | None = None
    max_jobs_per_sandbox: int = 200
    horizon_s: float = 600.0
    price_per_hour: float = 0.05

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.horizon_s <= 0 or self.price_per_hour < 0:
            raise PlanError("concurrency >= 1, horizon_s > 0 and price >= 0 are needed")


def _small(load: Load, exact_max: int) -> tuple[int, float]:
    n = min(load.concurrency, exact_max)
    return n, load.concurrency / n


def _model(load: Load, dists: Distributions, n: int, k: float, buffer_small: int) -> PoolModel:
    rate = load.create_rate / k if load.create_rate is not None else None
    burst = (load.burst if load.burst is not None else max(1.0, load.create_rate or 1.0)) / k
    return PoolModel(n, buffer_small, dists, max_jobs_per_sandbox=load.max_jobs_per_sandbox,
                     think_ms=load.think_ms, create_rate=rate, burst=burst)


def replacement_per_s(load: Load, dists: Distributions) -> float:
    """Sandboxes retired per second in steady state (recycling plus failures), the rate the provider
    must create them at: jobs per second × retirements per job."""
    cycle_s = (load.think_ms + sum(dists.service_ms) / len(dists.service_ms)) / 1000
    per_job = min(1.0, 1.0 / load.max_jobs_per_sandbox + dists.retire_prob)
    return load.concurrency / max(cycle_s, 1e-9) * per_job


def evaluate(load: Load, dists: Distributions, buffer: int, *, seed: int = 0, exact_max: int = 1000) -> dict[str, Any]:
    """Queue waits and idle cost of one buffer (rounded to the scaled fleet's step of ``k``)."""
    n, k = _small(load, exact_max)
    b = max(0, round(buffer / k))
    return _point(load, k, b, simulate(_model(load, dists, n, k, b), horizon_s=load.horizon_s, seed=seed))


def _point(load: Load, k: float, b_small: int, res: SimResult) -> dict[str, Any]:
    idle = res.mean_idle * k
    return {"buffer": int(round(b_small * k)), "p50_wait_ms": res.wait_pct(0.5), "p99_wait_ms": res.wait_pct(0.99),
            "mean_idle_sandboxes": idle, "idle_cost_per_hour": idle * load.price_per_hour,
            "censored_jobs": res.censored * k}


def plan(load: Load, dists: Distributions, target_p99_ms: float = 100.0, *, seed: int = 0,
         exact_max: int = 1000, curve: list[int] | None = None) -> dict[str, Any]:
    """The smallest buffer whose simulated p99 queue wait is <= ``target_p99_ms`` (None when even
    the search's cap misses it), with its numbers, every point evaluated (``curve``, sorted by
    buffer; ``curve`` adds buffers to evaluate) and how the answer was computed."""
    if target_p99_ms < 0:
        raise PlanError("target_p99_ms must be >= 0")
    n, k = _small(load, exact_max)
    points: dict[int, dict[str, Any]] = {}

    def at(b: int) -> dict[str, Any]:
        if b not in points:
            points[b] = _point(load, k, b, simulate(_model(load, dists, n, k, b), horizon_s=load.horizon_s, seed=seed))
        return points[b]

    demand = replacement_per_s(load, dists)
    deficit = max(0.0, demand - (load.create_rate or math.inf)) * load.horizon_s
    cap = int(math.ceil((deficit + 4 * load.concurrency) / k)) + 16
    found: int | None = None
    if at(0)["p99_wait_ms"] <= target_p99_ms:
        found = 0
    else:
        lo, hi = 0, 1
        while hi < cap and at(hi)["p99_wait_ms"] > target_p99_ms:
            lo, hi = hi, min(cap, hi * 2)
        if at(hi)["p99_wait_ms"] <= target_p99_ms:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if at(mid)["p99_wait_ms"] <= target_p99_ms else (mid, hi)
            found = hi
    for b in curve or []:
        at(max(0, round(b / k)))
    best = points[found] if found is not None else None
    warm = load.concurrency + (best["buffer"] if best else 0)
    burst = load.burst if load.burst is not None else max(1.0, load.create_rate or 1.0)
    return {
        "concurrency": load.concurrency,
        "target_p99_ms": target_p99_ms,
        "buffer": best["buffer"] if best else None,
        "p99_wait_ms": best["p99_wait_ms"] if best else None,
        "p50_wait_ms": best["p50_wait_ms"] if best else None,
        "idle_cost_per_hour": best["idle_cost_per_hour"] if best else None,
        "mean_idle_sandboxes": best["mean_idle_sandboxes"] if best else None,
        "buffer_cost_per_hour": best["buffer"] * load.price_per_hour if best else None,
        "price_per_sandbox_hour": load.price_per_hour,
        "create_rate": load.create_rate,
        "burst": burst if load.create_rate is not None else None,
        "replacement_per_s": demand,
        "steady_state": load.create_rate is None or demand <= load.create_rate,
        "fill_seconds": (max(0.0, warm - burst) / load.create_rate) if load.create_rate else 0.0,
        "think_ms": load.think_ms,
        "max_jobs_per_sandbox": load.max_jobs_per_sandbox,
        "horizon_s": load.horizon_s,
        "method": "exact" if k == 1 else f"scaled: {n} simulated clients, every count and rate / {k:g}",
        "scale": k,
        "search_cap_buffer": int(round(cap * k)),
        "distributions": dists.source,
        "seed": seed,
        "curve": [points[b] for b in sorted(points)],
    }
