"""Thread pools kept by a publisher or reader across calls, and a safe way to abandon work on them.

Pools opened and shut down by every publish or fetch (encode, upload, download, decode) would
cost up to ~16 thread starts and joins per sync. Each ``Thread.start`` waits until the new thread
runs, so on a busy 2-core machine that costs the caller's thread milliseconds exactly where
latency matters (when the manifest arrives, the reader starts its download and decode pools).
:class:`Pools` makes each pool once, on first use, and shuts them down when :meth:`Pools.close` is
called or its owner is garbage-collected.

Work left on a shared pool after a failure must not outlive the call that started it (a decode
still writing into buffers the caller gets back, an encode still updating the base):
:func:`settle` cancels what has not started and waits for what has.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Iterable


class Pools:
    """Named thread pools made lazily and reused; thread-safe."""

    def __init__(self, owner: object) -> None:
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()
        # shut the threads down when the owner goes away without close()
        self._finalizer = weakref.finalize(owner, _shutdown, self._pools)

    def get(self, name: str, workers: int) -> ThreadPoolExecutor:
        """The pool ``name`` with ``workers`` threads (made on first use)."""
        with self._lock:
            if os.getpid() != self._pid:  # a forked child: the parent's threads do not exist here
                self._pools.clear()
                self._pid = os.getpid()
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = ThreadPoolExecutor(max(1, workers), f"ws-{name}")
            return pool

    def close(self) -> None:
        """Stop every pool's threads (after the work already submitted); later use makes new ones."""
        with self._lock:
            _shutdown(self._pools)


def _shutdown(pools: dict[str, ThreadPoolExecutor]) -> None:
    for pool in list(pools.values()):
        pool.shutdown(wait=False, cancel_futures=False)
    pools.clear()


def settle(futures: Iterable[Future]) -> None:
    """Cancel the futures that have not started and wait for the running ones to finish."""
    running = [f for f in futures if not f.cancel()]
    if running:
        wait(running)
