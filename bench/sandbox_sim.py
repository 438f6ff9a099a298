"""``deltaloop bench sandbox-sim``: does the pool model predict the real warm pool?

For concurrency 2, 4 and 8 it runs the real :class:`~infra.sandbox.pool.SandboxPool` on the bwrap
runtime under the same closed loop as ``bench sandbox`` (``concurrency`` client threads, one
funcfit verification job each at a time, ``JOBS_PER_CLIENT`` jobs each) and a pinned warm target
(``min_warm = max_warm = concurrency + buffer``). Sandboxes are recycled every ``RECYCLE`` jobs, so
the pool keeps replacing them and queue waits are dominated by sandbox starts, as in a fleet whose
policy or failure rate consumes sandboxes — the case the planner exists for (with no recycling,
every wait is the ~0.05 ms thread hand-off and there is nothing to predict).

From the run it takes the measured distributions (every sandbox start, every job's time holding
its sandbox, fault rates: :class:`bench.sandbox.TimedRuntime`), feeds them to the simulator
(:func:`infra.sandbox.plan.simulate`, the same policy and job count, median of ``SEEDS`` seeds)
and records predicted against measured queue-wait p50/p99 and idle sandbox-seconds.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from bench.sandbox import TimedRuntime, planner_samples, workload
from infra.atomicio import write_json_atomic
from infra.config import SandboxConfig
from infra.sandbox import SandboxPool, create_runtime
from infra.sandbox.plan import Distributions, PoolModel, simulate

CONCURRENCIES = (2, 4, 8)
RECYCLE = 4
SEEDS = 5


def buffer_for(concurrency: int) -> int:
    """The warm buffer beyond one sandbox per client: half the concurrency."""
    return max(1, concurrency // 2)


def measure(concurrency: int, jobs_per_client: int) -> tuple[dict[str, float], TimedRuntime, list[float], list[float]]:
    """Run the real pool: its metrics window over the jobs, the timed runtime, every job's post
    time (from its sandbox's release to its client's next submit) and the hand-off times."""
    warm = concurrency + buffer_for(concurrency)
    cfg = SandboxConfig(runtime="bwrap", concurrency=concurrency, min_warm=warm, max_warm=warm,
                        max_jobs_per_sandbox=RECYCLE, timeout_s=2.0, idle_timeout_s=600.0)
    timed = TimedRuntime(create_runtime(cfg))
    jobs = [dataclasses.replace(r, program=f"{r.program}# job {i}\n")  # unique: its call is found by program
            for i, (r, _) in enumerate(workload(concurrency * jobs_per_client, seed=concurrency))]
    post: list[float] = []
    handoff: list[float] = []  # submit -> holding a sandbox, of jobs whose sandbox was already free
    with SandboxPool(cfg, timed) as pool:
        timed.reset()  # the initial fill ran with nothing else on the CPUs: not the load's starts
        pool.metrics(reset=True)
        lock = threading.Lock()
        nxt = [0]

        def client() -> None:
            last_end: float | None = None
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= len(jobs):
                    return
                t_submit = time.perf_counter()
                if last_end is not None:  # this client's time from its last job's release to this submit
                    with lock:
                        post.append((t_submit - last_end) * 1000)
                pool.verify_many([jobs[i]])
                ready, t_call, last_end = timed.calls[jobs[i].program]
                if ready < t_submit:  # its sandbox was free before the job came: the wait was the hand-off
                    with lock:
                        handoff.append((t_call - t_submit) * 1000)

        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        m = pool.metrics()
    return m, timed, post, handoff or [0.0]


def predict(concurrency: int, jobs: int, dists: Distributions) -> dict[str, float]:
    """The model's numbers for the same pool and load: median over ``SEEDS`` seeds."""
    model = PoolModel(concurrency, buffer_for(concurrency), dists, max_jobs_per_sandbox=RECYCLE)
    runs = [simulate(model, jobs=jobs, seed=s) for s in range(SEEDS)]
    return {"p50": statistics.median(r.wait_pct(0.5) for r in runs),
            "p99": statistics.median(r.wait_pct(0.99) for r in runs),
            "idle": statistics.median(r.idle_seconds for r in runs)}


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("inf") if pred else 0.0


def run(json_path: Path, quick: bool) -> list[dict[str, Any]]:
    """Measure and predict at each concurrency; print the table, write the records."""
    per_client = 60 if quick else 300
    records: list[dict[str, Any]] = []
    for c in CONCURRENCIES:
        t0 = time.perf_counter()
        m, timed, post, handoff = measure(c, per_client)
        samples = planner_samples(timed, m)
        dists = Distributions(tuple(samples["start_ms_samples"]) or (m["start_p50_ms"],),
                              tuple(samples["service_ms_samples"]), post_ms=tuple(post) or (0.0,),
                              handoff_ms=tuple(handoff),
                              retire_prob=samples["retire_prob"],
                              start_fail_prob=samples["start_fail_prob"], source="measured")
        p = predict(c, c * per_client, dists)
        rec = {
            "concurrency": c, "buffer": buffer_for(c), "max_jobs_per_sandbox": RECYCLE, "jobs": int(m["jobs"]),
            "predicted_wait_p50_ms": p["p50"], "measured_wait_p50_ms": m["queue_wait_p50_ms"],
            "predicted_wait_p99_ms": p["p99"], "measured_wait_p99_ms": m["queue_wait_p99_ms"],
            "predicted_idle_seconds": p["idle"], "measured_idle_seconds": m["idle_sandbox_seconds"],
            "sandboxes_started": int(m["sandboxes_started"]), "start_p50_ms": m["start_p50_ms"],
            "start_p99_ms": m["start_p99_ms"], "service_p50_ms": statistics.median(samples["service_ms_samples"]),
            "post_p50_ms": statistics.median(post) if post else 0.0,
            "handoff_p50_ms": statistics.median(handoff),
            "window_s": m["window_s"], "wall_s": time.perf_counter() - t0,
        }
        for key in ("wait_p50", "wait_p99", "idle"):
            suffix = "_seconds" if key == "idle" else "_ms"
            rec[f"{key}_error"] = _err(rec[f"predicted_{key}{suffix}"], rec[f"measured_{key}{suffix}"])
        records.append(rec)
    write_json_atomic(json_path, records, indent=2)
    cols = ["concurrency", "jobs", "predicted_wait_p50_ms", "measured_wait_p50_ms", "predicted_wait_p99_ms",
            "measured_wait_p99_ms", "predicted_idle_seconds", "measured_idle_seconds"]
    heads = ["conc", "jobs", "p50 pred", "p50 meas", "p99 pred", "p99 meas", "idle pred", "idle meas"]
    print("  ".join(f"{h:>10}" for h in heads) + "   errors p50/p99/idle")
    for r in records:
        print("  ".join(f"{r[c]:>10.2f}" if isinstance(r[c], float) else f"{r[c]:>10}" for c in cols)
              + f"   {r['wait_p50_error']:+.0%} / {r['wait_p99_error']:+.0%} / {r['idle_error']:+.0%}")
    return records
