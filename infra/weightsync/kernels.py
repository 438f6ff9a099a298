"""The hot loops of the sparse codec, run by numba kernels or by their numpy reference twins.

:mod:`infra.weightsync.codec` and :mod:`infra.weightsync.hotwords` call the functions here; each
runs the numba kernel (:mod:`infra.weightsync.numba_kernels`) or the numpy reference
(:mod:`infra.weightsync.reference`), which write and read the same bytes. numba is optional: without
it, or with ``DELTALOOP_NO_NUMBA=1``, the numpy reference runs (about half the speed), and
:func:`set_implementation` switches between the two at run time (tests and benchmarks compare them).
:func:`encode_sparse_update` and :func:`apply_sparse_digest` are the one-call paths of the publisher
and the reader; they return None where numba or the native C functions are missing, and the caller
then runs the steps one by one.

This module decides whether numba is used, so it is also where numba's on-disk cache is pointed at
``<repo>/.state/numba`` in a source checkout (before numba is imported, which reads it once).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

import infra.weightsync.reference as reference
from infra.weightsync.sparse_format import POS_SPLIT, SPLIT_HDR, HotSource, magnitude_mask, word_consts

__all__ = [
    "HAVE_NUMBA", "HotSource", "apply_sparse_digest", "apply_values", "changed_positions",
    "decode_positions_ctx", "encode_sparse_update", "hot_filter", "hot_update", "hot_words",
    "implementation", "magnitude_mask", "set_implementation", "sparse_parts",
]


def _set_cache_dir() -> None:
    """Point numba's on-disk cache at ``<repo>/.state/numba-<numba version>`` in a source checkout
    (unless set). One folder per numba version: the trainer's environment and vLLM's (which pins an
    older numba) share the checkout, and a cache index written by another version is discarded and
    rewritten, so one folder would make each environment recompile (~50 s) after the other ran."""
    if "NUMBA_CACHE_DIR" in os.environ:
        return
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").exists():
        from importlib.metadata import PackageNotFoundError, version

        try:
            d = root / ".state" / f"numba-{version('numba')}"
        except PackageNotFoundError:
            return
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            return
        if os.access(d, os.W_OK):
            os.environ["NUMBA_CACHE_DIR"] = str(d)


HAVE_NUMBA = False
if not os.environ.get("DELTALOOP_NO_NUMBA"):
    _set_cache_dir()
    try:
        import numba  # noqa: F401  (is it installed?)

        HAVE_NUMBA = True
    except ImportError:  # optional accelerator
        pass
if HAVE_NUMBA:
    import infra.weightsync.numba_kernels as nk

_impl = "numba" if HAVE_NUMBA else "numpy"


def implementation() -> str:
    """``"numba"`` or ``"numpy"``: which twin runs."""
    return _impl


def set_implementation(name: str) -> str:
    """Select the twin (tests and benchmarks compare them); returns the previous one."""
    global _impl
    if name not in ("numba", "numpy"):
        raise ValueError(f"unknown implementation {name!r}; known: numba, numpy")
    if name == "numba" and not HAVE_NUMBA:
        raise ValueError("numba is not installed")
    prev, _impl = _impl, name
    return prev


def _full(w: int) -> Any:
    """All bits of a ``w``-byte word, as the uint64 the kernels mask their arithmetic with."""
    return np.uint64((1 << (8 * w)) - 1)


_HIGH = {w: np.uint64(int.from_bytes(((1 << (8 * w - 1)).to_bytes(w, "little")) * (8 // w), "little"))
         for w in (1, 2, 4)}  # the top bit of every ``w``-byte lane of a uint64 (SWAR compare)


def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Sorted indices (int64) of the words where ``old`` and ``new`` differ."""
    if _impl == "numpy":
        return reference.changed_words(old, new)
    n, w = len(new), new.dtype.itemsize
    out = np.empty(n + 8, np.int64)  # only the pages written are touched; slack for branch-free stores
    per = 8 // w
    if w < 8 and n % per == 0 and old.flags.c_contiguous and new.flags.c_contiguous:
        k = nk.changed64(old.view(np.uint64), new.view(np.uint64), per, _HIGH[w], out)
    else:
        k = nk.changed_plain(old, new, out)
    return out[:k].copy()


def sparse_parts(old: np.ndarray, new: np.ndarray, idx: np.ndarray,
                 hot: HotSource | None = None) -> tuple[np.ndarray, bytes | np.ndarray]:
    """(value planes to compress, position stream) of a sparse frame; ``idx`` = changed positions.

    ``hot``: where the hot-class list of ``old`` comes from (a cache kept across versions, see
    :mod:`infra.weightsync.hotwords`); None scans ``old``. The bytes are the same either way."""
    if _impl == "numpy":
        planes, base, zz = reference.sparse_values(old, new, idx)
        return planes, reference.encode_position_stream(old, idx, base, zz, hot)
    w = new.dtype.itemsize
    sh, km, mm = word_consts(w)
    idx = np.ascontiguousarray(idx, np.int64)
    planes, zz, keys = nk.values(old, new, idx, w, sh, km, _full(w))
    t = nk.split_threshold(zz, keys)
    if t == 0:
        return planes, nk.positions_plain(idx)
    thr = t << sh
    hw = hot(thr) if hot is not None else hot_words(old, thr)
    return planes, nk.positions_hot(idx, hw, np.uint64(thr), len(old))


def decode_positions_ctx(body: np.ndarray, buf: np.ndarray, hot: HotSource | None = None) -> tuple[np.ndarray, int]:
    """Changed positions from a position stream (``body``: uint8, from its mode byte), bytes used.

    ``hot`` as in :func:`sparse_parts` (the hot list of ``buf``'s current words)."""
    if _impl == "numpy":
        return reference.decode_position_stream(body, buf, hot)
    if hot is not None and len(body) >= 1 + SPLIT_HDR.size and body[0] == POS_SPLIT:
        thr = int(SPLIT_HDR.unpack_from(body, 1)[0])
        idx, used = nk.decode_split(body, np.ascontiguousarray(hot(thr), np.int64), len(buf))
    else:
        idx, used = nk.decode_positions(body, buf, np.uint64(word_consts(buf.dtype.itemsize)[2]))
    return idx, int(used)


def hot_words(words: np.ndarray, thr: int) -> np.ndarray:
    """Sorted positions (int64) of the words whose magnitude (``word & magnitude_mask``) is below
    ``thr``: the "hot" class the split position code conditions on (a scan of every word)."""
    mm = magnitude_mask(words.dtype.itemsize)
    if _impl == "numpy":
        return np.flatnonzero((words & words.dtype.type(mm)) < min(thr, mm + 1))
    return nk.hot_words(words, np.uint64(mm), np.uint64(min(thr, mm + 1)))


def hot_filter(hot: np.ndarray, words: np.ndarray, thr: int) -> np.ndarray:
    """The positions in ``hot`` whose word's magnitude is below ``thr`` (a sub-list, order kept)."""
    mm = magnitude_mask(words.dtype.itemsize)
    if _impl == "numpy":
        return hot[(words[hot] & words.dtype.type(mm)) < thr]
    return nk.hot_filter(hot, words, np.uint64(mm), np.uint64(thr))


def hot_update(hot: np.ndarray, idx: np.ndarray, words: np.ndarray, cap: int) -> np.ndarray:
    """The hot list (threshold ``cap``) of ``words`` after the words at ``idx`` (sorted) changed:
    ``hot`` without ``idx``, plus the changed words now below ``cap``. O(len(hot) + len(idx))."""
    mm = magnitude_mask(words.dtype.itemsize)
    if _impl == "numpy":
        keep = hot[~np.isin(hot, idx, assume_unique=True)]
        now = idx[(words[idx] & words.dtype.type(mm)) < cap]
        return np.union1d(keep, now).astype(np.int64)
    return nk.hot_update(hot, np.ascontiguousarray(idx, np.int64), words, np.uint64(mm), np.uint64(cap))


def apply_values(buf: np.ndarray, idx: np.ndarray, planes: np.ndarray) -> None:
    """Add the zigzag differences in ``planes`` to ``buf`` at ``idx`` (in place)."""
    if _impl == "numpy":
        reference.apply_values(buf, idx, planes)
        return
    w = buf.dtype.itemsize
    sh, km, _ = word_consts(w)
    nk.apply(buf, idx, planes, w, sh, km, _full(w))


# the one-call kernels, when numba and the native C functions are there (:mod:`native`)
_FUSED_ENCODE = getattr(nk, "encode_sparse", None) if HAVE_NUMBA else None
_FUSED_DECODE = getattr(nk, "apply_sparse", None) if HAVE_NUMBA else None
_NO_HOT = np.zeros(0, np.int64)
_NO_WORDS = np.zeros(0, np.uint64)


def encode_sparse_update(old: np.ndarray, new: np.ndarray, hot: tuple[int, np.ndarray] | None,
                         margin: int, dense_max: int) -> tuple | None:
    """The publisher's sparse encode of one chunk in one native call (:func:`numba_kernels.encode_sparse`):
    changed words, value planes, position stream (with the kept hot list ``hot`` = ``(cap, list)``
    of ``old``, rebuilt with ``margin`` headroom when it does not cover the threshold), XXH3-128 of
    ``new``, ``old`` made equal to ``new`` and the hot list updated.

    Returns ``(status, changed, planes, positions, (cap, list) or None, looked, hexdigest)``, or
    None when the native path is not available. ``status`` 0: unchanged, 1: encoded, 2: over
    ``dense_max`` changes (0 and 2 touch nothing); ``looked`` 0: the hot list was not needed, 1: the
    kept one served, 2: it was scanned. The bytes are those of :func:`sparse_parts`."""
    fused = _FUSED_ENCODE
    if (fused is None or _impl != "numba" or old.dtype != new.dtype or len(old) != len(new)
            or not (old.flags.c_contiguous and new.flags.c_contiguous and old.flags.writeable)):
        return None
    n, w = len(new), new.dtype.itemsize
    per = 8 // w
    if w < 8 and n % per == 0:
        o64, n64, high = old.view(np.uint64), new.view(np.uint64), _HIGH[w]
    else:
        o64, n64, per, high = _NO_WORDS, _NO_WORDS, 0, np.uint64(0)
    sh, km, mm = word_consts(w)
    cap, lst = hot if hot is not None else (0, _NO_HOT)
    status, m, planes, positions, lst, cap, looked, lo, hi = fused(
        old, new, o64, n64, per, high, w, sh, km, np.uint64(mm), _full(w), dense_max,
        lst, np.uint64(cap), np.uint64(margin << sh))
    kept = (int(cap), lst) if int(cap) else None
    return int(status), int(m), planes, positions, kept, int(looked), f"{int(hi):016x}{int(lo):016x}"


def apply_sparse_digest(body: np.ndarray, buf: np.ndarray) -> str | None:
    """Apply a sparse frame body (``body``: uint8, from its position mode byte) to ``buf`` in place
    and return the xxh3-128 hex digest of the result, in one native call (:mod:`native`).

    None when that path is not available (numpy twins, no native symbols, a non-contiguous
    ``buf``): the caller then runs the steps one by one, with the same result and errors."""
    fused = _FUSED_DECODE
    if fused is None or _impl != "numba" or not buf.flags.c_contiguous:
        return None
    w = buf.dtype.itemsize
    sh, km, mm = word_consts(w)
    _m, lo, hi = fused(body, buf, np.uint64(mm), w, sh, km, _full(w))
    return f"{int(hi):016x}{int(lo):016x}"
