"""The numpy reference coder of sparse frames: the twin of :mod:`infra.weightsync.numba_kernels`.

Every function here writes or reads exactly the bytes its numba twin does (the format is in
:mod:`infra.weightsync.sparse_format`), makes the same encoder decisions (Rice parameter,
magnitude-class threshold, complement flag) with integer arithmetic, and raises ``ValueError`` on
the same malformed streams; tests compare the two byte for byte. It is the definition the kernels
are checked against, and the coder that runs without numba (``DELTALOOP_NO_NUMBA=1``, or numba not
installed) at about half the speed: each step is a few whole-array numpy calls with full-size
temporaries (~150 calls per 4 MiB chunk), where a kernel makes one pass.
"""

from __future__ import annotations

import numpy as np

from infra.weightsync.bitpack import decode_positions, encode_positions, positions_size
from infra.weightsync.sparse_format import (
    MIN_SPLIT,
    POS_PLAIN,
    POS_SPLIT,
    SPLIT_HDR,
    HotSource,
    word_consts,
)

SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}  # signed view of each word width


def exponent_keys(words: np.ndarray) -> np.ndarray:
    """Exponent-ish byte of each word (uint8): bits (8w-2)..(8w-9); the 7 low bits for w=1."""
    sh, km, _ = word_consts(words.dtype.itemsize)
    return ((words >> sh) & km).astype(np.uint8)


def changed_words(old: np.ndarray, new: np.ndarray, block: int = 1 << 15) -> np.ndarray:
    """Indices (int64) of words that differ, via a cache-blocked compare of 8-byte words."""
    n, w = len(new), new.dtype.itemsize
    per = 8 // w if w < 8 else 1
    if n % per or n < per * 64:
        return np.flatnonzero(old != new)
    o64, n64 = old.view(np.uint64), new.view(np.uint64)
    mask = np.empty(min(block, len(n64)), np.bool_)
    parts: list[np.ndarray] = []
    for s in range(0, len(n64), block):
        e = min(s + block, len(n64))
        m = mask[: e - s]
        np.not_equal(o64[s:e], n64[s:e], out=m)
        hit = m.nonzero()[0]
        if len(hit):
            parts.append(hit + s)
    if not parts:
        return np.zeros(0, np.int64)
    wi = np.concatenate(parts)
    if per == 1:
        return wi
    lanes = np.flatnonzero((o64[wi] ^ n64[wi]).view(new.dtype))
    return wi[lanes // per] * per + lanes % per


def sparse_values(old: np.ndarray, new: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(byte planes of the ordered zigzag differences, base words, zigzag values) of the changed
    words ``idx``: the value stream of a sparse frame before zstd, and what the position coder needs."""
    w = new.dtype.itemsize
    base = old[idx]
    diff = (new[idx] - base).view(SIGNED[w])  # wraps modulo 2**(8w): exact for any bits
    zz = ((diff << 1) ^ (diff >> (8 * w - 1))).view(new.dtype)
    ordered = zz[np.argsort(exponent_keys(base), kind="stable")]
    planes = ordered.view(np.uint8).reshape(-1, w).T.reshape(-1) if w > 1 else ordered
    return np.ascontiguousarray(planes), base, zz


def encode_position_stream(old: np.ndarray, idx: np.ndarray, base: np.ndarray, zz: np.ndarray,
                           hot: HotSource | None = None) -> bytes:
    """Position stream (mode byte first): plain, or split by the base word's magnitude class.

    Weights much smaller than the update size (tiny magnitude, tiny ulp) change almost surely;
    ordinary weights rarely. When >= 2% of the changed words moved 4+ ulps, the words whose
    exponent byte is below ``t`` (one above the 90th percentile exponent of those big movers) form a
    "hot" class the decoder can list from its base; positions are then coded as ranks within each
    class: hot changes (or the hot words that did *not* change, if fewer) and ordinary changes.
    This conditions the position code on the base (~20% fewer position bits on real AdamW deltas).
    Used only when smaller than the plain code.
    """
    m = len(idx)

    def plain() -> bytes:
        return bytes([POS_PLAIN]) + encode_positions(idx)

    if m < MIN_SPLIT:
        return plain()
    w = old.dtype.itemsize
    keys = exponent_keys(base)
    big = keys[(zz >> 1) >= 4]
    if 50 * len(big) < m:
        return plain()
    t = int(np.sort(big)[(9 * (len(big) - 1)) // 10]) + 1
    if 10 * int(np.count_nonzero(keys < t)) < m:
        return plain()
    sh, _km, mm = word_consts(w)
    thr = t << sh
    mask = old.dtype.type(mm)
    hot_words = hot(thr) if hot is not None else np.flatnonzero((old & mask) < thr)
    if len(hot_words) == 0 or len(hot_words) > len(old) // 4:
        return plain()
    in_hot = (base & mask) < thr
    ranks = np.searchsorted(hot_words, idx[in_hot])
    comp = 2 * len(ranks) > len(hot_words)
    if comp:
        keep = np.ones(len(hot_words), np.bool_)
        keep[ranks] = False
        ranks = np.flatnonzero(keep)
    normal = idx[~in_hot]
    normal_ranks = normal - np.searchsorted(hot_words, normal)
    if positions_size(ranks) + positions_size(normal_ranks) + SPLIT_HDR.size >= positions_size(idx):
        return plain()
    return b"".join((
        bytes([POS_SPLIT]), SPLIT_HDR.pack(thr, comp), encode_positions(ranks), encode_positions(normal_ranks)
    ))


def decode_position_stream(body: np.ndarray, buf: np.ndarray,
                           hot: HotSource | None = None) -> tuple[np.ndarray, int]:
    """Inverse of :func:`encode_position_stream`: (sorted changed positions, bytes consumed).

    ``buf`` holds the base words (the split mode lists its hot class from them, or asks ``hot``)."""
    n = len(buf)
    if len(body) < 1:
        raise ValueError("position stream truncated")
    mode = int(body[0])
    if mode == POS_PLAIN:
        idx, used = decode_positions(memoryview(body)[1:], n)
        return idx, used + 1
    if mode != POS_SPLIT:
        raise ValueError(f"unknown position mode {mode}")
    if len(body) < 1 + SPLIT_HDR.size:
        raise ValueError("position stream truncated")
    thr, comp = SPLIT_HDR.unpack_from(memoryview(body), 1)
    off = 1 + SPLIT_HDR.size
    mask = buf.dtype.type(word_consts(buf.dtype.itemsize)[2])
    hot_words = hot(thr) if hot is not None else np.flatnonzero((buf & mask) < thr)
    ranks, used = decode_positions(memoryview(body)[off:], len(hot_words))
    off += used
    if comp:
        keep = np.ones(len(hot_words), np.bool_)
        keep[ranks] = False
        hot_pos = hot_words[keep]
    else:
        hot_pos = hot_words[ranks]
    normal_ranks, used = decode_positions(memoryview(body)[off:], n - len(hot_words))
    off += used
    gaps = hot_words - np.arange(len(hot_words))  # ordinary words before each hot word
    normal = normal_ranks + np.searchsorted(gaps, normal_ranks, side="right")
    idx = np.concatenate((hot_pos, normal))
    idx.sort(kind="stable")
    return idx, off


def apply_values(buf: np.ndarray, idx: np.ndarray, planes: np.ndarray) -> None:
    """``buf[idx] += unzigzag(values)`` (modulo 2**(8w)), values un-ordered from ``planes``."""
    w, m = buf.dtype.itemsize, len(idx)
    base = buf[idx]
    zz = np.empty(m, buf.dtype)
    if w > 1:
        vals = np.empty(m, buf.dtype)
        vals.view(np.uint8).reshape(m, w)[:] = planes.reshape(w, m).T
    else:
        vals = planes.view(buf.dtype)
    zz[np.argsort(exponent_keys(base), kind="stable")] = vals
    diff = (zz >> 1) ^ (-(zz & 1).view(SIGNED[w])).view(buf.dtype)
    buf[idx] = base + diff
