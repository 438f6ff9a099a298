"""The sandbox pool: a warm buffer of sandboxes in front of a runtime, and job scheduling.

Sizing rule (DESIGN.md): keep at least one sandbox per in-flight job plus the rate at which jobs
consume sandboxes (retirements), so a scoring batch never waits for a cold start:

    target = clamp(ceil(demand × (1 + retire_rate)), min_warm, max_warm)
    demand = min(concurrency, jobs submitted and not finished)

``retire_rate`` is an exponential average of "this job retired its sandbox" (anomaly, death, recycle
limit). A background *warmer* thread starts sandboxes up to the target; sandboxes above it are
retired only after ``idle_timeout_s`` of quiet, so the buffer survives the gaps between RL steps.
A job that finds no idle sandbox starts one itself (counted as queue wait).

Every job gets exactly one result, and the result says whose failure it is (docs/sandbox.md, "Faults"):

* the job's own — its program timed out, ran out of memory or output, crashed, or killed or
  exhausted its own sandbox (the runner replied, or the host's backstop timed out, or the runtime
  says the sandbox was OOM-killed): reward 0 with that reason, never retried;
* the infrastructure's — the sandbox vanished while the job ran or before it (end of the runner's
  stream, a broken connection, a container removed, a daemon error), the runner could not start the
  job, or no sandbox could be started. The job cannot cause these: the runner is PID 1 of its
  namespace and ignores signals, and the job holds none of its fds. Such a job is retried on a fresh
  sandbox up to ``sandbox.infra_retries`` times (waits ``infra_backoff_s``, doubling); if every
  attempt fails so, its result has ``infra=True`` and reason ``infra`` (no score: mask it).

An idle sandbox is checked before it is handed a job (a killed one has an ended stream), so a host
that lost all its sandboxes costs one retry, not one per dead sandbox. Only ``start()`` raises
:class:`~infra.sandbox.types.SandboxError` (retryable), when not one of ``min_warm`` can start.
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol, TypeVar

from infra.config import SandboxConfig
from infra.sandbox import protocol
from infra.sandbox.faults import Failure, death_reason
from infra.sandbox.handle import RunnerHandle
from infra.sandbox.types import (
    ExecResult,
    SandboxDied,
    SandboxError,
    SandboxUnusable,
    TestsRequest,
    TestsResult,
    VerifyRequest,
    VerifyResult,
)

T = TypeVar("T")
Q = TypeVar("Q", VerifyRequest, TestsRequest)
R = TypeVar("R", VerifyResult, TestsResult)
_SAMPLES = 20000
_EWMA = 0.05
MAX_BACKOFF_S = 30.0  # longest wait before one infrastructure retry (the doubling stops there)


class Runtime(Protocol):
    """What a runtime module provides to the pool."""

    name: str

    def spawn(self) -> RunnerHandle:
        """Start one sandbox and return it ready (raises SandboxError)."""

    def naive(self, job: dict[str, Any]) -> dict[str, Any]:
        """Run one job in a brand-new sandbox (benchmark baseline)."""

    def close(self) -> None:
        """Release shared resources (sweep leftover containers)."""


def _pct(values: "deque[float] | list[float]", q: float) -> float:
    if not values:
        return 0.0
    data = sorted(values)
    k = min(len(data) - 1, max(0, int(round(q * (len(data) - 1)))))
    return data[k]


def _request_key(req: VerifyRequest | TestsRequest) -> str:
    """Identity of a request: two requests with equal keys run the same job."""
    if isinstance(req, TestsRequest):
        return json.dumps(["tests", req.program, req.tests, req.context, req.entry, req.timeout_s])
    tests = [[t.args, t.expected] for t in req.tests]
    return json.dumps([req.program, req.entry, tests, req.timeout_s], sort_keys=True, default=repr)


def _run_deduped(reqs: list[Q], run: Callable[[list[Q]], list[R]]) -> list[R]:
    """``run`` on the distinct requests only; every copy gets its own copy of its result."""
    first: dict[str, int] = {}
    unique: list[Q] = []
    slot: list[int] = []
    for r in reqs:
        k = first.setdefault(_request_key(r), len(unique))  # type: ignore[arg-type]
        if k == len(unique):
            unique.append(r)
        slot.append(k)
    results = run(unique)
    return [copy.deepcopy(results[k]) for k in slot]


class SandboxPool:
    """Warm sandboxes + a bounded job executor. Thread-safe; use :func:`infra.sandbox.create_pool`."""

    def __init__(self, cfg: SandboxConfig, runtime: Runtime) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self._cond = threading.Condition()
        self._idle: deque[tuple[RunnerHandle, float]] = deque()
        self._handles: set[RunnerHandle] = set()
        self._live = 0  # idle + busy + starting
        self._starting = 0
        self._waiters = 0
        self._inflight = 0
        self._retire_rate = 0.0
        self._last_activity = time.monotonic()
        self._spawn_failures = 0
        self._last_spawn_error = ""
        self._started = False
        self._closed = False
        self._closing = threading.Event()  # set by close(): ends a retry's backoff at once
        self._executor = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="sandbox-job")
        self._wake = threading.Event()
        self._warmer: threading.Thread | None = None
        # metrics
        self._m_lock = threading.Lock()
        self._reset_metrics()

    # ------------------------------------------------------------------------- lifecycle
    def start(self) -> "SandboxPool":
        """Start ``min_warm`` sandboxes (in parallel) and the warmer thread. Idempotent."""
        with self._cond:
            if self._closed:
                raise SandboxUnusable("pool is closed")
            if self._started:
                return self
            self._started = True
        n = self.cfg.min_warm
        threads = [threading.Thread(target=self._spawn_one, daemon=True) for _ in range(n)]
        with self._cond:
            self._live += n
            self._starting += n
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if n and not self._idle and self._spawn_failures:
            self.close()
            raise SandboxError(f"no sandbox could be started: {self._last_spawn_error}")
        self._warmer = threading.Thread(target=self._warm_loop, name="sandbox-warmer", daemon=True)
        self._warmer.start()
        return self

    def close(self) -> None:
        """Kill every sandbox (busy ones too: their jobs end with ``infra=True``). Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._closing.set()
            handles = list(self._handles)
            self._idle.clear()
            self._cond.notify_all()
        self._wake.set()
        for h in handles:
            h.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._warmer is not None:
            self._warmer.join(timeout=5)
        # Sandboxes still starting register themselves and see _closed: close once more after them.
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while self._starting and time.monotonic() < deadline:
            time.sleep(0.01)
        for h in list(self._handles):
            h.close()
        self.runtime.close()

    def __enter__(self) -> "SandboxPool":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ jobs
    def verify_many(self, reqs: list[VerifyRequest], dedupe: bool = False) -> list[VerifyResult]:
        """Score every request; one result per request, in order. Never raises for a job's failure.

        ``dedupe=True`` runs each distinct request (same program, entry, tests and timeout) once and
        gives every copy its own copy of that result. RL batches repeat themselves — G samples of
        one prompt from a sharpening policy are often the same text — so this saves most sandbox
        jobs late in a run. Only for deterministic verifiers: a program whose result depends on
        time or randomness is then judged by one run instead of one per copy."""
        if dedupe:
            return _run_deduped(reqs, self.verify_many)
        futures = [self._submit(self._verify_one, r) for r in reqs]
        return [f.result() for f in futures]

    def run_tests_many(self, reqs: list[TestsRequest], dedupe: bool = False) -> list[TestsResult]:
        """Score every program against its trusted tests; one result per request, in order. Never
        raises for a job's failure. The verdict is the in-sandbox trusted tester's (see runner.py:
        the program runs in a separate process and only literal values cross to the tests), read
        by this trusted process. ``dedupe`` as in :meth:`verify_many`."""
        if dedupe:
            return _run_deduped(reqs, self.run_tests_many)
        futures = [self._submit(self._tests_one, r) for r in reqs]
        return [f.result() for f in futures]

    def run_tests(self, req: TestsRequest) -> TestsResult:
        """Score one program against its tests."""
        return self.run_tests_many([req])[0]

    def verify(self, req: VerifyRequest) -> VerifyResult:
        """Score one request."""
        return self.verify_many([req])[0]

    def exec(self, program: str, timeout_s: float | None = None) -> ExecResult:
        """Run ``program`` as ``__main__`` in a sandbox."""
        return self._submit(self._exec_one, program, timeout_s).result()

    def _submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        if not self._started:
            self.start()
        with self._cond:
            if self._closed:
                raise SandboxUnusable("pool is closed")
            self._inflight += 1
            self._last_activity = time.monotonic()
        self._wake.set()
        return self._executor.submit(self._tracked, fn, time.monotonic(), *args)

    def _tracked(self, fn: Callable[..., T], t_submit: float, *args: Any) -> T:
        try:
            return fn(t_submit, *args)
        finally:
            with self._cond:
                self._inflight -= 1
                self._last_activity = time.monotonic()

    def _verify_one(self, t_submit: float, req: VerifyRequest) -> VerifyResult:
        timeout = req.timeout_s or self.cfg.timeout_s
        job = protocol.verify_job(req, timeout)
        outcome = self._run(job, t_submit)
        if isinstance(outcome, Failure):
            return protocol.failure_verify(req, outcome.reason, outcome.message, outcome.wall, outcome.infra)
        return protocol.to_verify_result(req, outcome)

    def _tests_one(self, t_submit: float, req: TestsRequest) -> TestsResult:
        job = protocol.run_tests_job(req, req.timeout_s or self.cfg.timeout_s)
        outcome = self._run(job, t_submit)
        if isinstance(outcome, Failure):
            return protocol.failure_tests(outcome.reason, outcome.message, outcome.wall, outcome.infra)
        return protocol.to_tests_result(outcome)

    def _exec_one(self, t_submit: float, program: str, timeout_s: float | None) -> ExecResult:
        job = protocol.exec_job(program, timeout_s or self.cfg.timeout_s)
        outcome = self._run(job, t_submit)
        if isinstance(outcome, Failure):
            return protocol.failure_exec(outcome.reason, outcome.message, outcome.wall, outcome.infra)
        return protocol.to_exec_result(outcome)

    def _run(self, job: dict[str, Any], t_submit: float) -> "dict[str, Any] | Failure":
        """Run a job: the runner's reply, or a :class:`Failure`. An attempt the infrastructure failed
        is retried on a fresh sandbox, ``infra_retries`` times at most, after a backoff that doubles
        from ``infra_backoff_s`` (up to ``MAX_BACKOFF_S``); when every attempt failed so, an ``infra``
        failure."""
        failure = Failure("infra", "pool closed", infra=True)
        made = 0
        for attempt in range(self.cfg.infra_retries + 1):
            if attempt:
                if self._closing.wait(min(MAX_BACKOFF_S, self.cfg.infra_backoff_s * 2 ** (attempt - 1))):
                    break  # closed while waiting: no sandbox will come
                with self._m_lock:
                    self._infra_retries += 1
            made += 1
            outcome = self._attempt(job, t_submit)
            if not isinstance(outcome, Failure) or not outcome.infra:
                return outcome
            failure = outcome
            if outcome.final:
                break
        now = time.monotonic()
        with self._m_lock:
            self._infra_unscored += 1
        self._record_job(t_submit, now - failure.wall, failure.wall, failure.wall, retired=True)
        return Failure("infra", f"infrastructure failure on {made} attempt(s), last: {failure.message}",
                        failure.wall, infra=True)

    def _attempt(self, job: dict[str, Any], t_submit: float) -> "dict[str, Any] | Failure":
        """One attempt on one sandbox: the reply, or a failure saying whose it is."""
        t_req = time.monotonic()
        try:
            handle = self._acquire()
        except SandboxError as exc:
            self._record_infra()
            return Failure("infra", f"no sandbox could be started: {exc}", infra=True,
                            final=isinstance(exc, SandboxUnusable))
        t_acq = time.monotonic()
        with self._m_lock:
            self._acquire_s += t_acq - t_req  # a job slot held, waiting for a sandbox (utilisation accounting)
        try:
            reply = handle.call(job, float(job["timeout"]) + self.cfg.kill_grace_s)
        except SandboxDied as exc:
            wall = time.monotonic() - t_acq
            reason = death_reason(exc, handle)
            self._release(handle, retire=True)
            if reason == "infra":
                self._record_infra()
                return Failure("infra", f"sandbox lost: {exc}", wall, infra=True)
            self._record_error()
            self._record_job(t_submit, t_acq, wall, wall, retired=True)
            return Failure(reason, f"sandbox failure: {exc}", wall)
        latency = time.monotonic() - t_acq
        if reply.get("infra"):  # the runner could not start the job (it never ran)
            self._release(handle, retire=True)
            self._record_infra()
            return Failure("infra", f"sandbox could not run the job: {reply.get('fatal')}", latency, infra=True)
        # A cgroup OOM kill leaves the container flagged OOMKilled for good: retire it, so that a later
        # death of this sandbox is never read as the next job's memory failure.
        retire = bool(reply.get("anomaly") or reply.get("fatal") or reply.get("oom"))
        recycle = handle.jobs >= self.cfg.max_jobs_per_sandbox
        if retire:
            self._record_error(anomaly=True)
        self._release(handle, retire=retire or recycle)
        self._record_job(t_submit, t_acq, latency, float(reply.get("run_s", 0.0)), retired=retire or recycle)
        return reply

    # ------------------------------------------------------------------------ sandboxes
    def _acquire(self) -> RunnerHandle:
        """An idle sandbox that still looks alive, else one started in this job's thread (counted as
        queue wait). Raises SandboxError when that start fails, SandboxUnusable when the pool closed."""
        while True:
            handle = self._take_idle()
            if handle is None:
                return self._cold_start()
            if handle.idle_ok():
                return handle
            self._release(handle, retire=True)  # died while idle (killed from outside): no job lost in it
            self._record_error()

    def _take_idle(self) -> RunnerHandle | None:
        """Pop an idle sandbox, waiting for one a warmer is starting; None (with a start pre-counted
        in ``_live``/``_starting``) when this job must start its own."""
        with self._cond:
            self._waiters += 1
            try:
                while True:
                    if self._closed:
                        raise SandboxUnusable("pool is closed")
                    if self._idle:
                        handle, since = self._idle.popleft()
                        self._add_idle_time(time.monotonic() - since)
                        return handle
                    if self._starting >= self._waiters:
                        self._cond.wait(0.05)  # a warm one is on its way
                        continue
                    self._live += 1
                    self._starting += 1
                    return None
            finally:
                self._waiters -= 1

    def _cold_start(self) -> RunnerHandle:
        """Start one sandbox for the calling job (``_live``/``_starting`` pre-counted)."""
        try:
            handle = self._timed_spawn()
        except SandboxError:
            with self._cond:
                self._starting -= 1
                self._live -= 1
            raise
        with self._cond:
            self._starting -= 1
            if self._closed:
                self._live -= 1
                handle.close()
                raise SandboxUnusable("pool is closed")
            self._handles.add(handle)
        return handle

    def _timed_spawn(self) -> RunnerHandle:
        t0 = time.monotonic()
        handle = self.runtime.spawn()
        with self._m_lock:
            self._start_s += time.monotonic() - t0
            self._start_ms.append((time.monotonic() - t0) * 1000)
            self._started_count += 1
        return handle

    def _spawn_one(self) -> None:
        """Warmer/start helper: start one sandbox into the idle buffer (``_live``/``_starting`` pre-counted)."""
        try:
            handle = self._timed_spawn()
        except SandboxError as exc:
            with self._cond:
                self._starting -= 1
                self._live -= 1
                self._spawn_failures += 1
                self._last_spawn_error = str(exc)
            self._record_error()
            return
        with self._cond:
            self._starting -= 1
            self._spawn_failures = 0
            if self._closed:
                self._live -= 1
                handle.close()
                return
            self._handles.add(handle)
            self._idle.append((handle, time.monotonic()))
            self._cond.notify_all()

    def _release(self, handle: RunnerHandle, retire: bool) -> None:
        with self._cond:
            if retire or self._closed:
                self._handles.discard(handle)
                self._live -= 1
            else:
                self._idle.append((handle, time.monotonic()))
                self._cond.notify_all()
            self._retire_rate += _EWMA * ((1.0 if retire else 0.0) - self._retire_rate)
        if retire or self._closed:
            # Docker removal takes tens of ms: do not make the job wait for it.
            threading.Thread(target=handle.close, daemon=True).start()
            with self._m_lock:
                self._retired += 1
            self._wake.set()

    def target(self) -> int:
        """The warm buffer size the sizing rule asks for right now."""
        with self._cond:
            demand = min(self.cfg.concurrency, self._inflight)
            rate = self._retire_rate
        want = math.ceil(demand * (1.0 + rate)) if demand else 0
        return max(self.cfg.min_warm, min(self.cfg.max_warm, want))

    def _warm_loop(self) -> None:
        while True:
            self._wake.wait(0.1)
            self._wake.clear()
            with self._cond:
                if self._closed:
                    return
            target = self.target()
            victims: list[RunnerHandle] = []
            spawn = 0
            with self._cond:
                if self._spawn_failures < 3:
                    spawn = max(0, target - self._live)
                    spawn = min(spawn, max(2, self.cfg.concurrency) - self._starting)
                    spawn = max(0, spawn)
                    self._live += spawn
                    self._starting += spawn
                quiet = time.monotonic() - self._last_activity > self.cfg.idle_timeout_s
                while quiet and self._idle and self._live > target:
                    handle, since = self._idle.popleft()
                    self._add_idle_time(time.monotonic() - since)
                    self._handles.discard(handle)
                    self._live -= 1
                    victims.append(handle)
            for _ in range(spawn):
                threading.Thread(target=self._spawn_one, daemon=True).start()
            for handle in victims:
                handle.close()
            if self._spawn_failures >= 3:
                time.sleep(1.0)  # back off; a job's own cold start will retry
                with self._cond:
                    self._spawn_failures = 2

    # -------------------------------------------------------------------------- metrics
    def _reset_metrics(self) -> None:
        self._queue_ms: deque[float] = deque(maxlen=_SAMPLES)
        self._start_ms: deque[float] = deque(maxlen=_SAMPLES)
        self._run_ms: deque[float] = deque(maxlen=_SAMPLES)
        self._overhead_ms: deque[float] = deque(maxlen=_SAMPLES)
        self._jobs = 0
        self._errors = 0
        self._infra_failures = 0
        self._infra_retries = 0
        self._infra_unscored = 0
        self._anomalies = 0
        self._retired = 0
        self._started_count = 0
        self._busy_s = 0.0
        self._idle_s = 0.0
        self._start_s = 0.0
        self._acquire_s = 0.0
        self._t_metrics = time.monotonic()

    def _add_idle_time(self, seconds: float) -> None:
        with self._m_lock:
            self._idle_s += seconds

    def _record_infra(self) -> None:
        with self._m_lock:
            self._errors += 1
            self._infra_failures += 1

    def _record_error(self, anomaly: bool = False) -> None:
        with self._m_lock:
            self._errors += 1
            self._anomalies += int(anomaly)

    def _record_job(self, t_submit: float, t_acq: float, latency: float, run_s: float, retired: bool) -> None:
        with self._m_lock:
            self._jobs += 1
            self._queue_ms.append((t_acq - t_submit) * 1000)
            self._run_ms.append(run_s * 1000)
            self._overhead_ms.append(max(0.0, latency - run_s) * 1000)
            self._busy_s += latency

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Latency percentiles (ms), utilisation, idle sandbox-seconds, counters, warm size.

        Fault counters: ``infra_failures`` (attempts the infrastructure failed: sandbox lost, none
        could start), ``infra_retries`` (fresh attempts made after one), ``infra_unscored`` (jobs whose
        every attempt failed so: results with ``infra=True``); ``errors`` counts every failed attempt
        and retired-on-anomaly job, ``anomalies`` the jobs that left a sandbox dirty.

        ``reset=True`` starts a new window (call it once per RL step and log the dict to MLflow).
        """
        now = time.monotonic()
        with self._cond:
            idle_now = sum(now - since for _, since in self._idle)
            live, idle_count, target_inflight = self._live, len(self._idle), self._inflight
            rate = self._retire_rate
        with self._m_lock:
            window = max(1e-9, now - self._t_metrics)
            idle_s = self._idle_s + idle_now
            out = {
                "jobs": float(self._jobs),
                "errors": float(self._errors),
                "anomalies": float(self._anomalies),
                "infra_failures": float(self._infra_failures),
                "infra_retries": float(self._infra_retries),
                "infra_unscored": float(self._infra_unscored),
                "retired": float(self._retired),
                "sandboxes_started": float(self._started_count),
                "warm_size": float(live),
                "idle_now": float(idle_count),
                "inflight": float(target_inflight),
                "target_warm": float(self.target()),
                "retire_rate": rate,
                "queue_wait_p50_ms": _pct(self._queue_ms, 0.5),
                "queue_wait_p99_ms": _pct(self._queue_ms, 0.99),
                "start_p50_ms": _pct(self._start_ms, 0.5),
                "start_p99_ms": _pct(self._start_ms, 0.99),
                "run_p50_ms": _pct(self._run_ms, 0.5),
                "run_p99_ms": _pct(self._run_ms, 0.99),
                "overhead_p50_ms": _pct(self._overhead_ms, 0.5),
                "overhead_p99_ms": _pct(self._overhead_ms, 0.99),
                "idle_sandbox_seconds": idle_s,
                # sandbox-seconds running a job / starting, and slot-seconds jobs waited for a sandbox
                "busy_sandbox_seconds": self._busy_s,
                "start_sandbox_seconds": self._start_s,
                "acquire_wait_seconds": self._acquire_s,
                "utilisation": self._busy_s / max(1e-9, self._busy_s + idle_s),
                "window_s": window,
            }
            if reset:
                self._reset_metrics()
        if reset:
            # Idle time already counted for sandboxes still idle must not be counted twice.
            with self._cond:
                self._idle = deque((h, max(since, now)) for h, since in self._idle)
        return out
