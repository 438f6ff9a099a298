"""A discrete-event model (SimPy) of the warm sandbox pool, to size its buffer before buying it.

The model follows :class:`infra.sandbox.pool.SandboxPool` with ``min_warm = max_warm =
concurrency + buffer`` (the sizing rule's target pinned, as a planned fleet is):

* ``concurrency`` clients, each a closed loop: think (rollout generation; exponential with mean
  ``think_ms``, 0 = none), submit one scoring job, wait for its result, repeat;
* a submitted job reaches the pool after a ``handoff_ms`` sample (the executor's thread hand-off;
  a job woken for a sandbox that just became idle takes another such sample to wake up, while the
  sandbox counts as idle), then takes the oldest idle sandbox; with none idle it waits for one being started when there
  are at least as many starts in flight as waiting jobs, else it starts its own (the pool's
  ``_take_idle``/``_cold_start``); the time from submit to holding a sandbox is its **queue wait**;
* it holds the sandbox for a service time (then the client spends a ``post_ms`` sample — result
  decoding, thread hand-off — before its next think or submit), then the sandbox is retired when the job broke it
  (``retire_prob``, the measured rate of anomalies and deaths) or reached
  ``max_jobs_per_sandbox`` (recycling), else it goes back to the idle buffer;
* a warmer starts sandboxes whenever fewer than ``concurrency + buffer`` are live, at most
  ``max(2, concurrency)`` starts at once (the pool's ``_warm_loop``, reacting at once instead of
  within its 0.1 s poll); a start fails with ``start_fail_prob`` and is then started again;
* every start, the warmer's or a job's own, first takes a token from the provider's creation
  limit: a token bucket of rate ``create_rate`` per second and depth ``burst`` (FIFO when empty);
* **idle sandbox-seconds** are the time sandboxes spend in the idle buffer, as the pool's
  ``idle_sandbox_seconds`` metric counts them.

Start latency, service time and post time are drawn from empirical samples (``deltaloop bench sandbox``
records them: :func:`infra.sandbox.plan_search.load_distributions`), so the model needs no
assumed shape. Not modelled: the pool's 3-failure start back-off, infrastructure retries of a job
(a lost sandbox is a retirement here), the idle timeout that shrinks a quiet pool, and executor
queueing beyond ``concurrency`` jobs.

Every sandbox and client is simulated, so the cost grows with concurrency × jobs;
:mod:`infra.sandbox.plan_search` plans fleets of millions by simulating a scaled-down fleet.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Generator

from infra.errors import DeltaloopError


class PlanError(DeltaloopError, ValueError):
    """Bad input to the sandbox planner (empty samples, impossible sizes); not retryable."""


@dataclass(frozen=True)
class Distributions:
    """What one sandbox costs in time: empirical samples (ms) and failure probabilities."""

    start_ms: tuple[float, ...]
    service_ms: tuple[float, ...]
    post_ms: tuple[float, ...] = (0.0,)
    handoff_ms: tuple[float, ...] = (0.0,)
    retire_prob: float = 0.0
    start_fail_prob: float = 0.0
    source: str = "given"

    def __post_init__(self) -> None:
        if not self.start_ms or not self.service_ms or not self.post_ms or not self.handoff_ms:
            raise PlanError("the pool model needs at least one start-latency and one service-time sample")
        if min(self.start_ms) < 0 or min(self.service_ms) < 0 or min(self.post_ms) < 0 or min(self.handoff_ms) < 0:
            raise PlanError("latency samples must be >= 0 ms")
        if not (0.0 <= self.retire_prob < 1.0 and 0.0 <= self.start_fail_prob < 1.0):
            raise PlanError("retire_prob and start_fail_prob must be in [0, 1)")


@dataclass(frozen=True)
class PoolModel:
    """One pool under one load; rates per second, times in ms."""

    concurrency: int
    buffer: int
    dists: Distributions
    max_jobs_per_sandbox: int = 200
    think_ms: float = 0.0
    create_rate: float | None = None
    burst: float = 1.0
    start_parallel: int | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.buffer < 0 or self.max_jobs_per_sandbox < 1 or self.think_ms < 0:
            raise PlanError("concurrency >= 1, buffer >= 0, max_jobs_per_sandbox >= 1 and think_ms >= 0 are needed")
        if self.create_rate is not None and (self.create_rate <= 0 or self.burst < 1e-9):
            raise PlanError("create_rate must be > 0 and burst > 0")

    @property
    def warm(self) -> int:
        """Sandboxes the warmer keeps live."""
        return self.concurrency + self.buffer


@dataclass
class SimResult:
    """Measured in the simulation: queue waits (ms) of every job, idle sandbox-seconds, counts."""

    waits_ms: list[float]
    idle_seconds: float
    duration_s: float
    jobs: int
    started: int
    retired: int
    censored: int = 0  # jobs still waiting when a horizon ended (their wait so far is counted)

    def wait_pct(self, q: float) -> float:
        """Queue-wait percentile ``q`` in [0, 1] (ms), nearest-rank as the pool's metrics compute it."""
        return percentile(self.waits_ms, q)

    @property
    def mean_idle(self) -> float:
        """Idle sandboxes on average over the run."""
        return self.idle_seconds / self.duration_s if self.duration_s > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, the same rule as ``infra.sandbox.pool._pct`` (0.0 when empty)."""
    if not values:
        return 0.0
    data = sorted(values)
    return data[min(len(data) - 1, max(0, int(round(q * (len(data) - 1)))))]


@dataclass
class _Sandbox:
    jobs: int = 0


@dataclass
class _State:
    live: int = 0
    starting: int = 0
    idle: deque[tuple[_Sandbox, float]] = field(default_factory=deque)
    waiters: deque = field(default_factory=deque)  # simpy events of jobs waiting for a warm start
    idle_s: float = 0.0
    started: int = 0
    retired: int = 0
    tokens: float = 0.0
    token_t: float = 0.0


class _PoolSim:
    """The SimPy processes of one run (times in seconds inside)."""

    def __init__(self, model: PoolModel, seed: int) -> None:
        import simpy

        self.simpy = simpy
        self.m = model
        self.env = simpy.Environment()
        self.rng = random.Random(seed)
        self.s = _State(tokens=float(model.burst))
        self.start_s = [x / 1000 for x in model.dists.start_ms]
        self.service_s = [x / 1000 for x in model.dists.service_ms]
        self.post_s = [x / 1000 for x in model.dists.post_ms]
        self.handoff_s = [x / 1000 for x in model.dists.handoff_ms]
        self.parallel = model.start_parallel or max(2, model.concurrency)
        self.waits: list[float] = []
        self.pending: dict[int, float] = {}  # client -> submit time of a job still waiting

    # ---------------------------------------------------------------------- sandboxes
    def _token_delay(self) -> float:
        """Reserve one creation token; seconds until it is ours (0 without a limit)."""
        if self.m.create_rate is None:
            return 0.0
        s, now = self.s, self.env.now
        s.tokens = min(float(self.m.burst), s.tokens + (now - s.token_t) * self.m.create_rate)
        s.token_t = now
        s.tokens -= 1.0
        return max(0.0, -s.tokens / self.m.create_rate)

    def _spawn(self, owner: object | None) -> Generator:
        """Start one sandbox: into the idle buffer (warmer) or straight to ``owner`` (a job's event)."""
        yield self.env.timeout(self._token_delay() + self.rng.choice(self.start_s))
        s = self.s
        s.starting -= 1
        if self.m.dists.start_fail_prob and self.rng.random() < self.m.dists.start_fail_prob:
            s.live -= 1
            if owner is not None:
                owner.succeed(None)  # type: ignore[attr-defined]
            self._kick()
            return
        s.started += 1
        if owner is not None:
            owner.succeed(_Sandbox())  # type: ignore[attr-defined]
        else:
            self._put_idle(_Sandbox())
        self._kick()

    def _put_idle(self, sb: _Sandbox) -> None:
        self.s.idle.append((sb, self.env.now))
        if self.s.waiters:
            self.env.process(self._wake(self.s.waiters.popleft()))

    def _wake(self, waiter: object) -> Generator:
        """A waiting job wakes up after a hand-off and looks at the idle buffer again."""
        delay = self.rng.choice(self.handoff_s)
        if delay:
            yield self.env.timeout(delay)
        waiter.succeed(None)  # type: ignore[attr-defined]

    def _kick(self) -> None:
        """The warmer: start sandboxes up to the target, ``parallel`` at a time."""
        s = self.s
        n = min(self.m.warm - s.live, self.parallel - s.starting)
        for _ in range(max(0, n)):
            s.live += 1
            s.starting += 1
            self.env.process(self._spawn(None))

    def _acquire(self) -> Generator:
        s = self.s
        delay = self.rng.choice(self.handoff_s)
        if delay:
            yield self.env.timeout(delay)
        while True:
            if s.idle:
                sb, since = s.idle.popleft()
                s.idle_s += self.env.now - since
                return sb
            ev = self.env.event()
            if s.starting >= len(s.waiters) + 1:
                s.waiters.append(ev)
            else:
                s.live += 1
                s.starting += 1
                self.env.process(self._spawn(ev))
            sb = yield ev
            if sb is not None:
                return sb

    def _release(self, sb: _Sandbox) -> None:
        sb.jobs += 1
        retire = sb.jobs >= self.m.max_jobs_per_sandbox or (
            self.m.dists.retire_prob > 0 and self.rng.random() < self.m.dists.retire_prob)
        if retire:
            self.s.live -= 1
            self.s.retired += 1
            self._kick()
        else:
            self._put_idle(sb)

    # ------------------------------------------------------------------------ clients
    def _client(self, cid: int, budget: list[int] | None, horizon: float | None) -> Generator:
        env, think = self.env, self.m.think_ms / 1000
        if think:
            yield env.timeout(self.rng.expovariate(1 / think))
        while True:
            if budget is not None:
                if budget[0] <= 0:
                    return
                budget[0] -= 1
            elif horizon is not None and env.now >= horizon:
                return
            t0 = env.now
            self.pending[cid] = t0
            sb = yield from self._acquire()
            del self.pending[cid]
            self.waits.append((env.now - t0) * 1000)
            yield env.timeout(self.rng.choice(self.service_s))
            self._release(sb)
            post = self.rng.choice(self.post_s)
            if post:
                yield env.timeout(post)
            if think:
                yield env.timeout(self.rng.expovariate(1 / think))

    def run(self, jobs: int | None, horizon_s: float | None, prewarm: bool) -> SimResult:
        env, s = self.env, self.s
        if prewarm:
            s.live = s.started = self.m.warm
            s.idle.extend((_Sandbox(), 0.0) for _ in range(self.m.warm))
        else:
            self._kick()
        budget = [jobs] if jobs is not None else None
        clients = [env.process(self._client(i, budget, horizon_s)) for i in range(self.m.concurrency)]
        if horizon_s is not None:
            env.run(until=horizon_s)
        else:
            env.run(until=env.all_of(clients))
        end = env.now
        censored = [(end - t0) * 1000 for t0 in self.pending.values()]
        idle = s.idle_s + sum(end - since for _, since in s.idle)
        return SimResult(self.waits + censored, idle, end, len(self.waits), s.started, s.retired, len(censored))


def simulate(model: PoolModel, *, jobs: int | None = None, horizon_s: float | None = None, seed: int = 0,
             prewarm: bool = True) -> SimResult:
    """Run the pool model until ``jobs`` jobs have been submitted and finished (as a benchmark
    drives the pool) or for ``horizon_s`` simulated seconds (jobs still waiting then count with
    their wait so far). ``prewarm``: the ``concurrency + buffer`` sandboxes are idle at t = 0 (a
    pool after ``start()``); else the warmer starts them as the clients begin. Deterministic per
    ``seed``."""
    if (jobs is None) == (horizon_s is None):
        raise PlanError("give exactly one of jobs and horizon_s")
    if (jobs is not None and jobs < 1) or (horizon_s is not None and not math.isfinite(horizon_s)) or (
            horizon_s is not None and horizon_s <= 0):
        raise PlanError("jobs must be >= 1 and horizon_s a positive number")
    return _PoolSim(model, seed).run(jobs, horizon_s, prewarm)
