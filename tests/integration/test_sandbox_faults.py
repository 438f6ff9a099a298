"""Infrastructure failure versus the job's own failure, in real sandboxes (issue #16).

A sandbox killed from outside while a job runs (``kill -9`` of the bwrap process group, ``docker
kill`` of the container: the test does it, as a preemption or an operator would) is not the job's
doing: the pool retries the job on a fresh sandbox, and when every attempt fails the result says
``infra=True`` (reason ``infra``) instead of a fake score of 0. A job that kills or exhausts its own
sandbox keeps reward 0 with its own reason and is not retried. Both runtimes; docker cases need the
daemon and image from scripts/setup_sandbox.sh (on CI a missing runtime is a failure).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from infra.sandbox import SandboxPool, TestCase, VerifyRequest, VerifyResult
from tests.sandbox_helpers import RUNTIMES, kill_sandbox, own_sandboxes, running_pool

# Slow but correct: the import takes SLOW_S, then every test passes. Long enough for the test to
# see the job running and kill its sandbox; far inside the pool's 20 s job timeout.
SLOW_S = 2.5
SLOW = f"import time\ntime.sleep({SLOW_S})\ndef f(x):\n    return 2*x+3\n"
TESTS = [TestCase([i], 2 * i + 3) for i in range(3)]
FAST_BACKOFF = {"infra_backoff_s": 0.2}


class SandboxKiller(threading.Thread):
    """Kills sandboxes of this process from outside while a job runs.

    ``limit`` kills at most; each sandbox once it has been busy ``after_s`` (so the job has surely
    started in it). ``everything=True`` kills every sandbox of the pool, idle ones too, at the first
    kill (a host losing all its sandboxes at once)."""

    def __init__(self, runtime: str, limit: int, after_s: float = 0.5, everything: bool = False) -> None:
        super().__init__(daemon=True)
        self.runtime, self.limit, self.after_s, self.everything = runtime, limit, after_s, everything
        self.kills: list[str] = []
        self._busy_since: dict[str, float] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set() and len(self.kills) < self.limit:
            now = time.monotonic()
            boxes = own_sandboxes(self.runtime)
            for box in boxes:
                if not box.busy or box.target in self.kills:
                    continue
                if now - self._busy_since.setdefault(box.target, now) < self.after_s:
                    continue
                victims = [b for b in boxes if b.target not in self.kills] if self.everything else [box]
                for victim in victims:
                    kill_sandbox(victim)
                    self.kills.append(victim.target)
                break
            self._halt.wait(0.05)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)


def _verify(pool: SandboxPool, req: VerifyRequest, timeout_s: float = 180.0) -> VerifyResult:
    """One verification that must come back within ``timeout_s`` (a hang is a failure, not a wait)."""
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(pool.verify, req).result(timeout=timeout_s)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_sandbox_killed_from_outside_is_retried_with_the_same_reward(runtime: str) -> None:
    """Replays issue #16, fault "a sandbox killed from outside during a job" (spot preemption, host
    OOM killer, an operator's kill): the job used to be scored as ``killed`` with reward 0. It must be
    retried on a fresh sandbox and get the reward of an undisturbed run, with ``infra=False`` and one
    retry counted."""
    req = VerifyRequest(SLOW, "f", TESTS)
    with running_pool(runtime, concurrency=1, min_warm=1, max_warm=2, **FAST_BACKOFF) as pool:
        undisturbed = _verify(pool, req)
        assert (undisturbed.reason, undisturbed.reward) == ("ok", 1.0), undisturbed
        before = pool.metrics(reset=True)
        killer = SandboxKiller(runtime, limit=1)
        killer.start()
        res = _verify(pool, req)
        killer.stop()
        m = pool.metrics()
    assert len(killer.kills) == 1, "the test must have killed the job's sandbox once"
    assert (res.reason, res.reward, res.passed, res.infra) == ("ok", undisturbed.reward, undisturbed.passed, False)
    assert before["infra_retries"] == 0 and m["infra_retries"] == 1 and m["infra_failures"] == 1, m
    assert m["jobs"] == 1, m


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_every_sandbox_killed_at_once_costs_one_retry(runtime: str) -> None:
    """Replays issue #16, fault "every sandbox of a host killed at once" (a node preempted): the
    warm sandboxes died too, so the retry must not be handed a dead one (that would burn the
    attempts on sandboxes that never ran the job). One retry, then the undisturbed reward."""
    req = VerifyRequest(SLOW, "f", TESTS)
    with running_pool(runtime, concurrency=1, min_warm=2, max_warm=3, infra_retries=1, **FAST_BACKOFF) as pool:
        pool.verify(VerifyRequest("def f(x):\n    return 2*x+3\n", "f", TESTS))  # the warm buffer is up
        pool.metrics(reset=True)
        killer = SandboxKiller(runtime, limit=1, everything=True)
        killer.start()
        res = _verify(pool, req)
        killer.stop()
        m = pool.metrics()
    assert len(killer.kills) >= 2, f"the test must have killed the busy and the idle sandboxes: {killer.kills}"
    assert (res.reason, res.reward, res.infra) == ("ok", 1.0, False), res
    assert m["infra_retries"] == 1 and m["infra_failures"] == 1, m


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_every_attempt_killed_gives_an_infra_result(runtime: str) -> None:
    """Replays issue #16, fault "the infrastructure keeps failing a job": every sandbox that runs it
    is killed from outside. After ``infra_retries + 1`` attempts the result is ``infra=True``,
    reason ``infra``, reward 0 (to be masked, never trained on as a score), and the pool still
    serves the next job."""
    req = VerifyRequest(SLOW, "f", TESTS)
    with running_pool(runtime, concurrency=1, min_warm=1, max_warm=2, infra_retries=2, **FAST_BACKOFF) as pool:
        pool.metrics(reset=True)
        killer = SandboxKiller(runtime, limit=3, after_s=0.3)
        killer.start()
        res = _verify(pool, req)
        killer.stop()
        m = pool.metrics(reset=True)
        after = _verify(pool, VerifyRequest("def f(x):\n    return 2*x+3\n", "f", TESTS))
    assert len(killer.kills) == 3, killer.kills
    assert (res.reason, res.reward, res.passed, res.infra) == ("infra", 0.0, [False] * 3, True), res
    assert "3 attempt" in res.stderr_tail, res.stderr_tail
    assert m["infra_failures"] == 3 and m["infra_retries"] == 2 and m["infra_unscored"] == 1 and m["jobs"] == 1, m
    assert (after.reason, after.reward, after.infra) == ("ok", 1.0, False), after


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_runtime_that_cannot_start_gives_an_infra_result(runtime: str) -> None:
    """Replays issue #16, fault "no sandbox can be started while a job waits" (daemon refusing
    containers, an interpreter that exits at once): the job used to raise out of ``verify_many``,
    losing the whole batch's results. It must get an ``infra=True`` result after ``infra_retries + 1``
    attempts, like any other job the infrastructure failed.

    bwrap: the sandbox's interpreter is ``/usr/bin/false`` (bwrap starts, the runner never says
    ready). docker: the daemon refuses every container (``cpus`` above what the host has)."""
    broken = {"python": "/usr/bin/false"} if runtime == "bwrap" else {"cpus": 256.0}
    with running_pool(runtime, concurrency=1, min_warm=0, max_warm=1, infra_retries=2, **broken,
                      **FAST_BACKOFF) as pool:
        res = _verify(pool, VerifyRequest("def f(x):\n    return 2*x+3\n", "f", TESTS))
        m = pool.metrics()
    assert (res.reason, res.reward, res.infra) == ("infra", 0.0, True), res
    assert "3 attempt" in res.stderr_tail and "start" in res.stderr_tail, res.stderr_tail
    assert m["infra_failures"] == 3 and m["infra_retries"] == 2 and m["infra_unscored"] == 1, m


# A job that kills or exhausts its own sandbox: (program, its reason, job timeout).
OWN_FAULTS = {
    "kills_its_zygote": ("import os, time\nos.kill(os.getppid(), 9)\ntime.sleep(1)\ndef f(x):\n    return 2*x+3\n",
                         "killed", None),
    "kills_everything_it_can": ("import os\nos.kill(-1, 9)\ndef f(x):\n    return 2*x+3\n", "killed", None),
    "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                  "timeout", 1.0),
    "memory_bomb": ("a = []\nwhile True:\n    a.append(bytearray(16 * 1024**2))\n", "memory", None),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_job_that_kills_or_exhausts_its_own_sandbox_is_its_own_failure(runtime: str) -> None:
    """Replays issue #16, the other side of the fault line: a job that kills its own zygote, kills
    every process it can, fork-bombs or memory-bombs is scored 0 with its own
    reason, ``infra=False``, and is NOT retried (a retry would let a policy turn its own failures
    into masked samples)."""
    with running_pool(runtime, concurrency=2, min_warm=2, max_warm=4, infra_retries=2, **FAST_BACKOFF) as pool:
        pool.metrics(reset=True)
        reqs = [VerifyRequest(prog, "f", TESTS, timeout_s=t) for prog, _, t in OWN_FAULTS.values()]
        with ThreadPoolExecutor(1) as ex:
            results = ex.submit(pool.verify_many, reqs).result(timeout=240)
        m = pool.metrics()
        healthy = pool.verify(VerifyRequest("def f(x):\n    return 2*x+3\n", "f", TESTS))
    got = {name: (r.reason, r.reward, r.infra) for name, r in zip(OWN_FAULTS, results)}
    want = {name: (reason, 0.0, False) for name, (_, reason, _) in OWN_FAULTS.items()}
    assert got == want, {n: (r.reason, r.stderr_tail[-300:]) for n, r in zip(OWN_FAULTS, results)}
    assert m["infra_retries"] == 0 and m["infra_failures"] == 0 and m["jobs"] == len(OWN_FAULTS), m
    assert (healthy.reason, healthy.reward) == ("ok", 1.0), healthy
