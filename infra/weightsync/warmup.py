"""Compile (or load from numba's on-disk cache) every codec kernel before the first timed sync.

A numba kernel compiles on its first call with each new signature (word width, writable or
read-only arrays): ~30-50 s for all of them on a fresh machine, about a second to load them from the
cache. :class:`~infra.weightsync.publisher.VersionPublisher` and
:class:`~infra.weightsync.reader.VersionReader` call :func:`warm_up` in their constructors, so no
publish or fetch pays it; ``scripts/setup.sh`` calls it once so the cache is filled at install time.
It runs the codec itself on small inputs, so it lives above :mod:`infra.weightsync.codec`.
"""

from __future__ import annotations

import numpy as np

from infra.weightsync.codec import decode_digest, decode_into, encode_delta
from infra.weightsync.kernels import (
    HAVE_NUMBA,
    encode_sparse_update,
    hot_filter,
    hot_update,
    hot_words,
    implementation,
)

_warm = False


def warm_up() -> None:
    """Compile or load every kernel signature the codec uses, once per process (a no-op without
    numba): every word width, writable and read-only inputs (safetensors maps and ``np.frombuffer``
    give read-only arrays), the step-by-step and the one-call paths."""
    global _warm
    if _warm or not HAVE_NUMBA or implementation() != "numba":
        return
    import infra.weightsync.numba_kernels as nk

    rng = np.random.default_rng(0)
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        old = rng.integers(0, 1 << 8, 4096).astype(dt)
        new = old.copy()
        new[::3] += 1
        new[:80] = 0
        for ro in (False, True):
            o, n = old.copy(), new.copy()
            o.flags.writeable = n.flags.writeable = not ro
            frame, _idx = encode_delta(o, n, "sparse")
            if frame is not None:
                decode_into(frame, old.copy())
                decode_into(bytearray(frame), old.copy())
                decode_digest(frame, old.copy())  # the reader's one-call path
                decode_digest(bytearray(frame), old.copy())
            b = o.copy()  # the publisher's one-call path (writable base, new words either way)
            encode_sparse_update(b, n, None, 2, len(n))
            encode_sparse_update(b, o, (1 << 4, hot_words(b, 1 << 4)), 2, len(n))
            # the publisher's kept hot lists (scan, filter, update) and the split position code
            hot = hot_words(o, 1 << 4)
            hot_filter(hot, o, 1 << 3)
            hot_update(hot, np.arange(0, 4096, 7, dtype=np.int64), o, 1 << 4)
    idx = np.arange(0, 4096, 5, dtype=np.int64)
    nk.positions_hot(idx, idx[::3].copy(), np.uint64(1 << 7), 4096)
    nk.positions_plain(idx)
    nk.split_threshold(np.arange(len(idx), dtype=np.uint64), np.zeros(len(idx), np.int64))
    _warm = True
