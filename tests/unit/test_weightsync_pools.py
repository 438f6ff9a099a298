"""Pools kept across publishes and fetches: reused, safe to abandon, and gone with their owner."""

from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import Future

import pytest

from infra.weightsync.pools import Pools, settle


class _Owner:
    pass


def test_pool_is_made_once_and_reused() -> None:
    owner = _Owner()
    pools = Pools(owner)
    a = pools.get("dec", 2)
    assert pools.get("dec", 2) is a
    assert pools.get("get", 3) is not a
    assert a.submit(lambda: 41 + 1).result() == 42
    pools.close()
    b = pools.get("dec", 2)  # after close, a new pool
    assert b is not a and b.submit(lambda: "ok").result() == "ok"
    pools.close()


def test_settle_waits_for_running_work_and_cancels_the_rest() -> None:
    owner = _Owner()
    pool = Pools(owner).get("one", 1)
    gate = threading.Event()
    done: list[int] = []

    def slow(i: int) -> None:
        gate.wait(5)
        time.sleep(0.05)
        done.append(i)

    running = pool.submit(slow, 0)
    queued = [pool.submit(slow, i) for i in range(1, 4)]
    while not running.running():
        time.sleep(0.001)
    threading.Timer(0.05, gate.set).start()
    settle([running, *queued])
    assert running.done() and done == [0]  # the running one finished before settle returned
    assert all(f.cancelled() for f in queued)


def test_settle_accepts_finished_futures() -> None:
    f: Future = Future()
    f.set_result(1)
    settle([f])
    assert f.result() == 1


def test_threads_stop_when_the_owner_is_collected() -> None:
    owner = _Owner()
    pools = Pools(owner)
    pool = pools.get("enc", 2)
    pool.submit(lambda: None).result()
    threads = list(pool._threads)
    assert threads and all(t.is_alive() for t in threads)
    del owner
    gc.collect()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)
