"""Keep Python's cyclic garbage collector out of latency-critical sections.

Why: in a process that has imported torch, a full (generation-2) collection walks every object
the libraries created at import — on a 2-core VM 112 ms after ``import torch`` alone, 150-240 ms
in a rollout worker or the weight-sync benchmark (~300k objects). CPython starts one whenever
enough container objects were allocated since the last, so it lands at random inside whatever
runs: inside a weight sync it holds the GIL for ~160 ms while the ranged downloads and the decode
threads wait (without this module one sync in seven took 0.33-0.50 s instead of ~0.2 s).

:func:`deferred_gc` turns the collector off for the duration of a weight publish or fetch (a
bounded section that makes no reference cycles worth collecting; reference counting still frees
everything) and back on when the last concurrent section ends, so the collection that was due runs
right after instead of in the middle. The switch is process-wide: for as long as a sync runs
(seconds for a keyframe of a large model over a slow link) other threads' reference cycles wait
for collection too. :func:`freeze_startup_objects` is for long-lived processes
(rollout worker, trainer ranks): after start-up it moves every object into the permanent
generation (``gc.freeze``), so later full collections walk only what was allocated since.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def deferred_gc() -> Iterator[None]:
    """No cyclic collection inside the block (nesting and threads allowed; re-enabled after the last)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def freeze_startup_objects() -> None:
    """Collect once, then exempt every surviving object from future collections (``gc.freeze``).

    Call once a long-lived process has finished loading (libraries, model, engine): its later
    collections then cost what the process allocates afterwards, not what torch & co. built."""
    gc.collect()
    gc.freeze()
