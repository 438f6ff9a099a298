"""Hot-word lists kept across versions, so the publisher does not scan its whole base for them.

The sparse codec's split position code conditions on the *hot class* of the base: the words whose
magnitude is below a threshold ``thr`` that the encoder picks per chunk and writes in the frame
(:mod:`infra.weightsync.kernels`). Finding that class is a scan of every base word — at lr 1e-6 on
SmolLM2-135M ~25 ms of one core per version (memory speed), a fifth of the encoder's time, for a
class of ~0.5% of the words.

The publisher knows exactly which words each version changed in its private base, so it keeps the
list instead of rebuilding it: :class:`HotWords` stores, per chunk, the sorted positions of the
words below a *cap* (``thr`` plus ``MARGIN`` exponent steps, so the ±1-2 step drift of ``thr``
between versions stays inside it; on SmolLM2 the class grows only ~6-8% per step there) and after
each change merges in the changed words (``O(hot + changed)``). A request for ``thr <= cap``
filters the list; a larger ``thr``, or a chunk without a list, scans once and keeps the result.
Frames are byte-identical with and without the lists (tests compare them).

On a 2-core VM (SmolLM2-135M, lr 1e-6, one thread, all 285 chunks) the kept lists make a
version's encode 111 ms instead of 128 ms, ~10 ms of a ~200 ms publish-then-fetch (paired runs).
The decoder accepts the same source (``codec.decode_into(..., hot=)``), but
:class:`~infra.weightsync.reader.VersionReader` keeps no lists: there the scan also brings each
chunk into cache for the digest that follows, and a reader with lists is no faster (the filter's
gathers and the digest then wait on memory).

Validity: a list describes the *content* of a chunk at one moment. The owner must call
:meth:`ChunkHot.changed` after every change it makes through the codec, and :meth:`HotWords.clear`
when the content may have changed any other way (a keyframe, a failed publish). A stale list cannot
produce a wrong chunk at a reader: the reader scans its own words, and every decoded chunk is
verified by its full digest.
"""

from __future__ import annotations

from typing import Hashable

import numpy as np

from infra.weightsync.kernels import hot_filter, hot_update, hot_words, magnitude_mask

MARGIN = 2  # exponent steps of headroom above the requested threshold (x4 in magnitude)


class ChunkHot:
    """The hot-word source of one chunk for one encode or decode (a :data:`~infra.weightsync.sparse_format.HotSource`)."""

    __slots__ = ("cache", "key", "words")

    def __init__(self, cache: "HotWords", key: Hashable, words: np.ndarray) -> None:
        self.cache, self.key, self.words = cache, key, words

    def __call__(self, thr: int) -> np.ndarray:
        """Sorted positions of this chunk's words with magnitude below ``thr``."""
        w = self.words.dtype.itemsize
        mm = magnitude_mask(w)
        thr = min(int(thr), mm + 1)
        ent = self.cache._lists.get(self.key)
        if ent is None or thr > ent[0]:
            shift = 8 * w - 9 if w > 1 else 0
            cap = min(thr + (MARGIN << shift), mm + 1)
            ent = (cap, hot_words(self.words, cap))
            self.cache._lists[self.key] = ent
            self.cache.scans += 1
        else:
            self.cache.hits += 1
        cap, hot = ent
        if thr >= cap:
            return hot
        return hot_filter(hot, self.words, thr)

    def entry(self) -> tuple[int, np.ndarray] | None:
        """The kept ``(cap, list)`` of this chunk, or None (for the native encoder)."""
        return self.cache._lists.get(self.key)

    def replace(self, entry: tuple[int, np.ndarray] | None, looked: int) -> None:
        """Store what the native encoder left: the list after the chunk's change (None: drop it);
        ``looked`` 1 counts a hit, 2 a scan, as :meth:`__call__` does."""
        if entry is None:
            self.cache._lists.pop(self.key, None)
        else:
            self.cache._lists[self.key] = entry
        if looked == 2:
            self.cache.scans += 1
        elif looked == 1:
            self.cache.hits += 1

    def changed(self, idx: np.ndarray | None) -> None:
        """The words at ``idx`` (sorted) now hold new values; None: any word may have changed."""
        ent = self.cache._lists.get(self.key)
        if ent is None:
            return
        if idx is None:
            self.cache._lists.pop(self.key, None)
            return
        if len(idx):
            self.cache._lists[self.key] = (ent[0], hot_update(ent[1], idx, self.words, ent[0]))


class HotWords:
    """Per-chunk hot lists of one set of tensors (keys are the owner's, e.g. ``(tensor, chunk)``).

    Thread-safe for distinct keys (each chunk is coded by one thread at a time)."""

    def __init__(self) -> None:
        self._lists: dict[Hashable, tuple[int, np.ndarray]] = {}
        self.hits = 0
        self.scans = 0

    def chunk(self, key: Hashable, words: np.ndarray) -> ChunkHot:
        """The source for chunk ``key`` whose current words are ``words``."""
        return ChunkHot(self, key, words)

    def clear(self) -> None:
        """Forget every list (the content changed outside the codec, or is unknown)."""
        self._lists.clear()

    def __len__(self) -> int:
        return len(self._lists)
