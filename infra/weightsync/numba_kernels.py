"""The numba kernels of the sparse codec: each step of a sparse frame in one pass, without the GIL.

Why: at lr 1e-6 a 4 MiB chunk has ~8,000 changed words out of 2M. The numpy formulation of the
sparse frame (:mod:`infra.weightsync.reference`) costs ~150 numpy calls per chunk (position coding,
byte-splitting, the base-magnitude class scan) plus full-size temporaries; that, not memory
bandwidth, caps it at ~1.4 GB/s encode and ~2.8 GB/s decode on one core. Each kernel here does its
step in one pass without temporaries (``nogil``, so a thread pool uses every core) and runs at
memory speed. The kernels write and read exactly the bytes of their numpy twins (format:
:mod:`infra.weightsync.sparse_format`) and raise ``ValueError`` on the same malformed streams;
:mod:`infra.weightsync.kernels` chooses between the two and is what the codec calls.

With the C functions of :mod:`infra.weightsync.native` (xxh3-128, zstd decompression),
:func:`encode_sparse` and :func:`apply_sparse` do the publisher's whole encode of a chunk and the
reader's whole decode of a frame in one call each, so a frame costs one GIL hand-off, not six.

Only :mod:`infra.weightsync.kernels` imports this module, once it knows numba is there and has
pointed numba's on-disk cache (``NUMBA_CACHE_DIR``, default ``<repo>/.state/numba`` in a checkout)
at a writable place: a process pays the ~30-50 s compile once per machine, not per start, and
loads the kernels in about a second (:func:`infra.weightsync.warmup.warm_up`).
numba keys that cache by the timestamp of the file that defines each kernel and bakes in what the
kernel calls and the globals it reads: that is why every kernel lives in this one file. After
editing :mod:`~infra.weightsync.sparse_format` or :mod:`~infra.weightsync.native`, whose constants
and functions are compiled in, delete the cache directory.

The file is longer than the project's 600-line guideline for the same reason (kernel code; no
function in it is over 80 lines). Sections: change detection, the hot class, values, the Rice
coder, position streams, the one-call encode and decode.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros

from infra.weightsync.native import AVAILABLE as NATIVE
from infra.weightsync.native import ZSTD_ERROR_MIN
from infra.weightsync.native import xxh3_128 as _xxh3
from infra.weightsync.native import zstd_decompress as _unzstd
from infra.weightsync.sparse_format import MIN_SPLIT, RICE_HDR


def _jit(fn: Any = None, **kw: Any) -> Any:
    """``numba.njit`` with the options every kernel uses: cached on disk, GIL released, no bounds checks."""
    opts = dict(cache=True, nogil=True, boundscheck=False, **kw)
    return numba.njit(**opts) if fn is None else numba.njit(**opts)(fn)


_U0, _U1, _U8, _UFF = np.uint64(0), np.uint64(1), np.uint64(8), np.uint64(0xFF)
_ZERR = np.uint64(ZSTD_ERROR_MIN)


# ----------------------------------------------------------------------------- change detection


@_jit(inline="always")
def _emit_lanes(msk: Any, a: int, per: int, lane_bits: int, out: Any, k: int) -> int:  # pragma: no cover
    """Write the lane index of every set top bit of ``msk`` (word ``a``, ``per`` lanes) to
    ``out`` from ``k``; returns the new count, or -1 if ``out`` is full. Inlined into callers."""
    while msk != _U0:
        if k >= out.shape[0]:
            return -1
        out[k] = a * per + trailing_zeros(msk) // lane_bits
        k += 1
        msk &= msk - _U1
    return k


@_jit
def changed64(o: Any, n: Any, per: int, high: Any, out: Any) -> int:  # pragma: no cover
    """Changed lanes of 8-byte words holding ``per`` lanes each; returns the count written to
    ``out``, or -1 when ``out`` may be too small (it needs ``4 * per`` slack past the count).

    One branch per 4 words; in a group that differs, a SWAR test marks the lanes that differ
    (their top bit in ``high``) and every lane index is stored, the count advancing by the
    lane's bit: no branch per changed lane. At a first AdamW step (~4.5% of bf16 words change)
    a group of 16 lanes differs about half the time, and branching per lane mispredicted on
    most of them: this store-always form is 2.9x faster there and 2x at 0.4% (SmolLM2 versions,
    one core, AMD EPYC). (Reducing 2 KiB pieces to a mask first, as the hot-class scan does,
    measured slower here: changes are too frequent.)
    """
    low = ~high
    lane_bits = 64 // per
    top = lane_bits - 1
    k = 0
    m = o.shape[0]
    lim = out.shape[0] - 4 * per
    i = 0
    while i + 4 <= m:
        if ((o[i] ^ n[i]) | (o[i + 1] ^ n[i + 1]) | (o[i + 2] ^ n[i + 2]) | (o[i + 3] ^ n[i + 3])) != _U0:
            if k > lim:
                return -1
            for a in range(i, i + 4):
                y = o[a] ^ n[a]
                msk = (((y & low) + low) | y) & high
                base = a * per
                if per == 4:  # 2-byte words (bf16, fp16), written out: 1.5x the loop below
                    out[k] = base
                    k += np.int64((msk >> np.uint64(15)) & _U1)
                    out[k] = base + 1
                    k += np.int64((msk >> np.uint64(31)) & _U1)
                    out[k] = base + 2
                    k += np.int64((msk >> np.uint64(47)) & _U1)
                    out[k] = base + 3
                    k += np.int64(msk >> np.uint64(63))
                    continue
                for j in range(per):
                    out[k] = base + j
                    k += np.int64((msk >> np.uint64(lane_bits * j + top)) & _U1)
        i += 4
    for a in range(i, m):
        y = o[a] ^ n[a]
        k = _emit_lanes((((y & low) + low) | y) & high, a, per, lane_bits, out, k)
        if k < 0:
            return -1
    return k


@_jit
def changed_plain(o: Any, n: Any, out: Any) -> int:  # pragma: no cover
    """Changed words, one word at a time (8-byte words, or lengths the SWAR compare cannot take);
    returns the count written to ``out``, or -1 if ``out`` is full."""
    k = 0
    for i in range(o.shape[0]):
        if o[i] != n[i]:
            if k >= out.shape[0]:
                return -1
            out[k] = i
            k += 1
    return k


# ------------------------------------------------ hot class (words below a magnitude threshold)


_BLOCK = 4  # uint64 words per mask bit (16 bf16 lanes); 64 blocks make a 2 KiB piece


@_jit(inline="always")
def _piece_hits(b64: Any, s: int, lmask: Any, high: Any, tb: Any) -> Any:  # pragma: no cover
    """Bit k set when block k (``_BLOCK`` uint64) of the 64 blocks from ``s`` holds a lane below
    the threshold. No stores: LLVM keeps it in vector registers (stores to an output array in
    the same loop would alias the input and stop vectorisation, halving the speed)."""
    msk = _U0
    for k in range(64):
        acc = _U0
        base = s + _BLOCK * k
        for j in range(_BLOCK):
            acc |= ~(((b64[base + j] & lmask) | high) - tb)
        if acc & high:
            msk |= _U1 << np.uint64(k)
    return msk


@_jit
def _hot_swar(b64: Any, per: int, lmask: Any, high: Any, tb: Any, hot: Any, h: int) -> int:  # pragma: no cover
    """Append to ``hot`` the lanes of ``b64`` (``per`` words per uint64) with magnitude below
    the threshold; returns the new count, or -1 when ``hot`` is full.

    SWAR: with ``lmask`` = the magnitude mask and ``high`` = the top bit in every lane, and
    ``tb`` = the threshold (<= top bit) in every lane, ``((x & lmask) | high) - tb`` borrows
    into no other lane and keeps a lane's top bit exactly when its magnitude >= threshold.
    2 KiB pieces are first reduced to a 64-bit mask of 32-byte blocks with a hit
    (:func:`_piece_hits`, vectorised); only those blocks are walked, with trailing-zero counts
    (written out: with :func:`_emit_lanes` inlined here the walk compiles ~3x slower on dense
    hot classes). Block size: at lr 1e-6 (~0.25% hot words, clustered) most 128-byte blocks hold
    a hit and the scalar walk dominates; 32-byte blocks halve the whole scan (SmolLM2, one core,
    cold caches, AMD EPYC: 36 ms vs 73 ms with 128-byte blocks).
    """
    lane_bits = 64 // per
    m = b64.shape[0]
    i = 0
    piece = 64 * _BLOCK
    while i + piece <= m:
        pm = _piece_hits(b64, i, lmask, high, tb)
        while pm != _U0:
            k = trailing_zeros(pm)
            pm &= pm - _U1
            for a in range(i + _BLOCK * k, i + _BLOCK * k + _BLOCK):
                msk = ~(((b64[a] & lmask) | high) - tb) & high
                while msk != _U0:
                    if h >= hot.shape[0]:
                        return -1
                    hot[h] = a * per + trailing_zeros(msk) // lane_bits
                    h += 1
                    msk &= msk - _U1
        i += piece
    for a in range(i, m):
        h = _emit_lanes(~(((b64[a] & lmask) | high) - tb) & high, a, per, lane_bits, hot, h)
        if h < 0:
            return -1
    return h


@_jit
def hot_words(buf: Any, magmask: Any, thr: Any) -> Any:  # pragma: no cover
    """Sorted positions of words with ``(word & magmask) < thr`` (``magmask``, ``thr``: uint64).

    The class is rare but clustered (~0.25% of words at lr 1e-6). ``magmask`` is always the
    word's bits below its top bit, so the test runs SWAR on 8-byte groups (:func:`_hot_swar`);
    a threshold above every magnitude is clamped to ``magmask + 1`` (selects the same words).
    """
    n = buf.shape[0]
    w = buf.itemsize
    per = 8 // w
    lane_bits = 8 * w
    t = thr if thr <= magmask else magmask + _U1
    lane_l = magmask
    lane_h = magmask + _U1
    lmask = _U0
    high = _U0
    tb = _U0
    for j in range(per):
        sh = np.uint64(j * lane_bits)
        lmask |= lane_l << sh
        high |= lane_h << sh
        tb |= t << sh
    cap = 64 + n // 64
    while True:
        hot = np.empty(cap, np.int64)
        m4 = (n // per) * per
        h = _hot_swar(buf[:m4].view(np.uint64), per, lmask, high, tb, hot, 0)
        if h >= 0:
            for i in range(m4, n):
                if (np.uint64(buf[i]) & magmask) < t:
                    if h >= cap:
                        h = -1
                        break
                    hot[h] = i
                    h += 1
        if h >= 0:
            return hot[:h]
        cap = n + 8


@_jit
def hot_filter(hot: Any, words: Any, magmask: Any, thr: Any) -> Any:  # pragma: no cover
    """The entries of ``hot`` whose word's magnitude is below ``thr`` (order kept)."""
    out = np.empty(hot.shape[0], np.int64)
    o = 0
    for i in range(hot.shape[0]):
        p = hot[i]
        if (np.uint64(words[p]) & magmask) < thr:
            out[o] = p
            o += 1
    return out[:o]


@_jit
def hot_update(hot: Any, idx: Any, words: Any, magmask: Any, cap: Any) -> Any:  # pragma: no cover
    """The hot list after the words at ``idx`` changed (``words`` holds the new values): the
    old list without ``idx``, plus the changed words now below ``cap``; sorted."""
    nh = hot.shape[0]
    m = idx.shape[0]
    out = np.empty(nh + m, np.int64)
    a = b = o = 0
    while a < nh or b < m:
        if b >= m or (a < nh and hot[a] < idx[b]):
            out[o] = hot[a]
            o += 1
            a += 1
        else:
            p = idx[b]
            if a < nh and hot[a] == p:
                a += 1
            if (np.uint64(words[p]) & magmask) < cap:
                out[o] = p
                o += 1
            b += 1
    return out[:o].copy()


# ----------------------------- values (zigzag differences ordered by exponent byte, byte-split)


@_jit
def _slots(keys: Any) -> Any:  # pragma: no cover
    """Slot of each element in the stable order by key (a counting sort)."""
    m = keys.shape[0]
    start = np.zeros(257, np.int64)
    for i in range(m):
        start[keys[i] + 1] += 1
    for b in range(256):
        start[b + 1] += start[b]
    slot = np.empty(m, np.int64)
    for i in range(m):
        kk = keys[i]
        slot[i] = start[kk]
        start[kk] += 1
    return slot


@_jit
def values(old: Any, new: Any, idx: Any, w: int, kshift: int, kmask: int, full: Any) -> Any:  # pragma: no cover
    """``(planes, zigzag values, exponent keys)`` of the changed words ``idx``: the
    value stream before zstd, ordered by key with a counting sort (the stable order of numpy's)."""
    m = idx.shape[0]
    bits = 8 * w
    sb = np.uint64(bits - 1)
    keys = np.empty(m, np.int64)
    zz = np.empty(m, np.uint64)
    for i in range(m):
        p = idx[i]
        b = np.uint64(old[p])
        u = (np.uint64(new[p]) - b) & full
        s = (u >> sb) & _U1
        z = ((u << _U1) & full) ^ (full if s else _U0)
        zz[i] = z
        keys[i] = np.int64((b >> np.uint64(kshift)) & np.uint64(kmask))
    slot = _slots(keys)
    planes = np.empty(m * w, np.uint8)
    for i in range(m):
        z = zz[i]
        s = slot[i]
        for j in range(w):
            planes[j * m + s] = np.uint8((z >> np.uint64(8 * j)) & _UFF)
    return planes, zz, keys


@_jit
def apply(buf: Any, idx: Any, planes: Any, w: int, kshift: int, kmask: int, full: Any) -> None:  # pragma: no cover
    """``buf[idx] += unzigzag(values)`` modulo 2**(8w), the values un-ordered from ``planes``."""
    m = idx.shape[0]
    keys = np.empty(m, np.int64)
    for i in range(m):
        keys[i] = np.int64((np.uint64(buf[idx[i]]) >> np.uint64(kshift)) & np.uint64(kmask))
    slot = _slots(keys)
    for i in range(m):
        s = slot[i]
        z = _U0
        for j in range(w):
            z |= np.uint64(planes[j * m + s]) << np.uint64(8 * j)
        d = ((z >> _U1) ^ ((_U0 - (z & _U1)) & full)) & full
        p = idx[i]
        buf[p] = (np.uint64(buf[p]) + d) & full


# --------------------------- Rice coder (positions as gaps: unary parts, then k-bit remainders)


@_jit
def _put_le(out: Any, off: int, v: int, nbytes: int) -> None:  # pragma: no cover
    u = np.uint64(v)
    for j in range(nbytes):
        out[off + j] = np.uint8((u >> np.uint64(8 * j)) & _UFF)


@_jit
def _get_le(buf: Any, off: int, nbytes: int) -> Any:  # pragma: no cover
    v = _U0
    for j in range(nbytes):
        v |= np.uint64(buf[off + j]) << np.uint64(8 * j)
    return v


@_jit
def _rice_k(pos: Any) -> Any:  # pragma: no cover
    """(k, unary bits) minimising the Rice code of the gaps of ``pos`` (same rule as bitpack).

    The gaps sum to ``pos[-1] + 1 - m`` (they telescope), so one pass remains: the unary bits of
    the five candidate ``k`` in five scalar sums (a loop LLVM vectorises; an array of sums it did
    not: 4x slower on 6M positions)."""
    m = pos.shape[0]
    if m == 0:
        return 0, 0
    total = pos[m - 1] + 1 - m
    x = (total / m) * 0.69 + 1.0
    xi = np.int64(x)
    k0 = 0
    while xi > 1:
        xi >>= 1
        k0 += 1
    lo = max(0, k0 - 2)
    hi = min(62, k0 + 3)
    s0, s1, s2 = min(lo, 63), min(lo + 1, 63), min(lo + 2, 63)  # shifts past 63 (unused candidates) clamped
    s3, s4 = min(lo + 3, 63), min(lo + 4, 63)
    u0 = u1 = u2 = u3 = u4 = 0
    g = pos[0]
    u0 += g >> s0
    u1 += g >> s1
    u2 += g >> s2
    u3 += g >> s3
    u4 += g >> s4
    for i in range(1, m):
        g = pos[i] - pos[i - 1] - 1
        u0 += g >> s0
        u1 += g >> s1
        u2 += g >> s2
        u3 += g >> s3
        u4 += g >> s4
    sums = (u0, u1, u2, u3, u4)
    best_k = lo
    best_bits = -1
    best_ub = 0
    for c in range(hi - lo):
        b = m * (lo + c + 1) + sums[c]
        if best_bits < 0 or b < best_bits:
            best_k, best_bits, best_ub = lo + c, b, sums[c]
    return best_k, m + best_ub


@_jit
def _rice_size(pos: Any) -> int:  # pragma: no cover
    m = pos.shape[0]
    if m == 0:
        return RICE_HDR
    k, ub = _rice_k(pos)
    return RICE_HDR + (ub + 7) // 8 + (m * k + 7) // 8


@_jit
def _rice_write(pos: Any, out: Any, off: int) -> int:  # pragma: no cover
    """Write rice(pos) at ``out[off:]`` (zeroed); returns the end offset."""
    m = pos.shape[0]
    if m == 0:
        for j in range(RICE_HDR):
            out[off + j] = 0
        return off + RICE_HDR
    k, ub = _rice_k(pos)
    out[off] = np.uint8(k)
    _put_le(out, off + 1, ub, 8)
    _put_le(out, off + 9, m, 8)
    u0 = off + RICE_HDR
    r0 = u0 + (ub + 7) // 8
    bit = 0
    prev = -1
    acc = _U0
    nb = 0
    o = r0
    kmask = (_U1 << np.uint64(k)) - _U1
    uk = np.uint64(k)
    for i in range(m):
        g = pos[i] - prev - 1
        prev = pos[i]
        bit += g >> k
        out[u0 + (bit >> 3)] |= np.uint8(0x80 >> (bit & 7))
        bit += 1
        if k:
            r = np.uint64(g) & kmask
            if k <= 32:  # nb < 32 before, so nb + k < 64 bits stay exact
                acc = (acc << uk) | r
                nb += k
                if nb >= 32:
                    nb -= 32
                    v = acc >> np.uint64(nb)
                    out[o] = np.uint8((v >> np.uint64(24)) & _UFF)
                    out[o + 1] = np.uint8((v >> np.uint64(16)) & _UFF)
                    out[o + 2] = np.uint8((v >> _U8) & _UFF)
                    out[o + 3] = np.uint8(v & _UFF)
                    o += 4
            else:
                kk = k
                while kk > 0:
                    step = kk if kk <= 32 else kk - 32
                    kk -= step
                    part = (r >> np.uint64(kk)) & ((_U1 << np.uint64(step)) - _U1)
                    acc = (acc << np.uint64(step)) | part
                    nb += step
                    while nb >= 8:
                        nb -= 8
                        out[o] = np.uint8((acc >> np.uint64(nb)) & _UFF)
                        o += 1
    while nb >= 8:
        nb -= 8
        out[o] = np.uint8((acc >> np.uint64(nb)) & _UFF)
        o += 1
    if nb > 0:
        out[o] = np.uint8((acc << np.uint64(8 - nb)) & _UFF)
        o += 1
    return o


@_jit(inline="always")
def _refill(buf: Any, reg: Any, nbits: int, at: int, end: int) -> Any:  # pragma: no cover
    """Load bytes ``buf[at:end]`` below the ``nbits`` valid bits of ``reg`` (MSB first) while
    they fit: returns ``(reg, nbits, at)``, at least 57 bits unless ``end`` came first."""
    while nbits <= 56 and at < end:
        reg |= np.uint64(buf[at]) << np.uint64(56 - nbits)
        nbits += 8
        at += 1
    return reg, nbits, at


@_jit
def _rice_read(buf: Any, off: int, limit: int) -> Any:  # pragma: no cover
    """Decode rice positions at ``buf[off:]``; (positions, end offset); raises on bad streams.

    Both streams are read through a 64-bit register (MSB first, refilled a byte at a time): a
    unary part is the register's leading zeros, a remainder its top ``k`` bits. Against reading
    them a byte at a time: 1.05-1.6x on synthetic streams (the more the changes, the smaller
    ``k``, the larger the gain), 1.13x / 1.2x on the position streams of SmolLM2-135M versions
    with 1M / 6M changed words (2-vCPU AMD EPYC VM)."""
    if off + RICE_HDR > buf.shape[0]:
        raise ValueError("position stream truncated")
    k = np.int64(buf[off])
    ub = _get_le(buf, off + 1, 8)
    m = _get_le(buf, off + 9, 8)
    off += RICE_HDR
    if m == _U0:
        return np.zeros(0, np.int64), off
    if k > 62 or m > np.uint64(limit) or ub > m + np.uint64(limit):
        raise ValueError("position header out of range")
    ubits = np.int64(ub)
    n = np.int64(m)
    ulen = (ubits + 7) // 8
    rlen = (n * k + 7) // 8
    if off + ulen + rlen > buf.shape[0]:
        raise ValueError("position stream truncated")
    out = np.empty(n, np.int64)
    uend = off + ulen
    ui = off  # next unary byte to load
    ua = _U0  # unary bits not yet consumed, MSB first; ua_n of them are valid
    ua_n = 0
    used = 0  # unary bits consumed
    r = uend  # next remainder byte to load
    rend = uend + rlen
    ra = _U0  # remainder bits, MSB first; ra_n valid
    ra_n = 0
    prev = -1
    for i in range(n):
        q = 0
        while ua == _U0:  # the valid bits left are zeros: count them, load more
            q += ua_n
            used += ua_n
            ua_n = 0
            ua, ua_n, ui = _refill(buf, ua, ua_n, ui, uend)
            if ua_n == 0:
                raise ValueError("position stream inconsistent")
        lz = np.int64(leading_zeros(ua))
        q += lz
        used += lz + 1
        ua_n -= lz + 1
        ua = (ua << np.uint64(lz)) << _U1
        if used > ubits:  # the terminating bit lies beyond the stream's unary bits
            raise ValueError("position stream inconsistent")
        rem = np.int64(0)
        if 0 < k <= 56:  # the usual case: one read of the register
            if ra_n < k:
                ra, ra_n, r = _refill(buf, ra, ra_n, r, rend)
            rem = np.int64(ra >> np.uint64(64 - k))
            ra = ra << np.uint64(k)
            ra_n -= k
        elif k > 56:
            kk = k
            while kk > 0:
                step = kk if kk <= 32 else 32
                kk -= step
                if ra_n < step:
                    ra, ra_n, r = _refill(buf, ra, ra_n, r, rend)
                rem = (rem << step) | np.int64(ra >> np.uint64(64 - step))
                ra = ra << np.uint64(step)
                ra_n -= step
        p = prev + 1 + ((q << k) | rem)
        if p <= prev or p >= limit:
            raise ValueError("position beyond tensor end")
        out[i] = p
        prev = p
    # the numpy decoder counts set bits among the first ubits: none may follow the last one
    bit = used
    while bit < ubits:
        if (np.int64(buf[off + (bit >> 3)]) >> (7 - (bit & 7))) & 1:
            raise ValueError("position stream inconsistent")
        bit += 1
    return out, off + ulen + rlen


# ----------------------------------- position streams (plain, or split by the base's hot class)


@_jit
def split_threshold(zz: Any, keys: Any) -> int:  # pragma: no cover
    """Exponent-byte threshold ``t`` of the hot class (see :func:`_np_positions`), 0 = plain."""
    m = zz.shape[0]
    if m < MIN_SPLIT:
        return 0
    hist = np.zeros(256, np.int64)
    nbig = 0
    for i in range(m):
        if (zz[i] >> _U1) >= np.uint64(4):
            hist[keys[i]] += 1
            nbig += 1
    if 50 * nbig < m:
        return 0
    rank = (9 * (nbig - 1)) // 10
    t = 0
    c = 0
    for b in range(256):
        c += hist[b]
        if c > rank:
            t = b + 1
            break
    below = 0
    for i in range(m):
        if keys[i] < t:
            below += 1
    if 10 * below < m:
        return 0
    return t


@_jit
def positions_plain(idx: Any) -> Any:  # pragma: no cover
    """The plain position stream of ``idx``: mode byte 0, then rice(idx)."""
    out = np.zeros(1 + _rice_size(idx), np.uint8)
    _rice_write(idx, out, 1)
    return out


@_jit
def positions_hot(idx: Any, hot: Any, thr: Any, n: int) -> Any:  # pragma: no cover
    """The position stream split by the hot class ``hot`` (sorted positions of the base words
    below ``thr``), or the plain stream when that is not smaller; same decisions as numpy."""
    m = idx.shape[0]
    nhot = hot.shape[0]
    if nhot == 0 or nhot > n // 4:
        return positions_plain(idx)
    hotflag = np.empty(m, np.bool_)
    before = np.empty(m, np.int64)
    j = 0
    for i in range(m):  # merge: hot words before each changed position
        p = idx[i]
        while j < nhot and hot[j] < p:
            j += 1
        before[i] = j
        hotflag[i] = j < nhot and hot[j] == p
    nh = 0
    for i in range(m):
        nh += hotflag[i]
    ranks = np.empty(nh, np.int64)
    normal = np.empty(m - nh, np.int64)
    a = b = 0
    for i in range(m):
        if hotflag[i]:
            ranks[a] = before[i]
            a += 1
        else:
            normal[b] = idx[i] - before[i]
            b += 1
    comp = 2 * nh > nhot
    if comp:
        cr = np.empty(nhot - nh, np.int64)
        j = 0
        c = 0
        for r in range(nhot):
            if j < nh and ranks[j] == r:
                j += 1
            else:
                cr[c] = r
                c += 1
        ranks = cr
    size = 1 + 9 + _rice_size(ranks) + _rice_size(normal)
    if size - 1 < _rice_size(idx):
        out = np.zeros(size, np.uint8)
        out[0] = 1
        _put_le(out, 1, thr, 8)
        out[9] = 1 if comp else 0
        o = _rice_write(ranks, out, 10)
        _rice_write(normal, out, o)
        return out
    return positions_plain(idx)


@_jit
def decode_positions(body: Any, buf: Any, magmask: Any) -> Any:  # pragma: no cover
    """(positions, bytes used) of a position stream of either mode; the split mode scans the hot
    class of ``buf`` (the base words) for the threshold in its header."""
    n = buf.shape[0]
    if body.shape[0] < 1:
        raise ValueError("position stream truncated")
    mode = body[0]
    if mode == 0:
        return _rice_read(body, 1, n)
    if mode != 1:
        raise ValueError("unknown position mode")
    if body.shape[0] < 10:
        raise ValueError("position stream truncated")
    hot = hot_words(buf, magmask, _get_le(body, 1, 8))
    return decode_split(body, hot, n)


@_jit
def decode_split(body: Any, hot: Any, n: int) -> Any:  # pragma: no cover
    """Positions of a split stream (mode 1, header already checked) given the hot list."""
    comp = body[9] != 0
    nhot = hot.shape[0]
    ranks, off = _rice_read(body, 10, nhot)
    if comp:
        hp = np.empty(nhot - ranks.shape[0], np.int64)
        j = c = 0
        for r in range(nhot):
            if j < ranks.shape[0] and ranks[j] == r:
                j += 1
            else:
                hp[c] = hot[r]
                c += 1
    else:
        hp = np.empty(ranks.shape[0], np.int64)
        for i in range(ranks.shape[0]):
            hp[i] = hot[ranks[i]]
    normal, off = _rice_read(body, off, n - nhot)
    j = 0
    for i in range(normal.shape[0]):  # rank r -> r + hot words at or before the result
        r = normal[i]
        while j < nhot and hot[j] - j <= r:
            j += 1
        normal[i] = r + j
    out = np.empty(hp.shape[0] + normal.shape[0], np.int64)
    a = b = o = 0
    while a < hp.shape[0] and b < normal.shape[0]:
        if hp[a] < normal[b]:
            out[o] = hp[a]
            a += 1
        else:
            out[o] = normal[b]
            b += 1
        o += 1
    while a < hp.shape[0]:
        out[o] = hp[a]
        a += 1
        o += 1
    while b < normal.shape[0]:
        out[o] = normal[b]
        b += 1
        o += 1
    return out, off


# -------------------------------------------- one call per chunk (needs the native C functions)

if NATIVE:

    @_jit
    def apply_sparse(body: Any, buf: Any, magmask: Any, w: int, kshift: int, kmask: int,
                     full: Any) -> Any:  # pragma: no cover
        """A whole sparse frame body applied to ``buf`` in place, then XXH3-128 of ``buf``:
        positions (with the hot-class scan), zstd of the value planes, the scatter and the
        digest in one ``nogil`` call. Returns ``(changed, low64, high64)``; raises ValueError
        on the streams :func:`codec.decode_into` rejects, before ``buf`` is modified."""
        idx, used = decode_positions(body, buf, magmask)
        if used + 8 > body.shape[0]:
            raise ValueError("sparse frame truncated")
        vlen = _get_le(body, used, 8)
        used += 8
        if vlen != np.uint64(body.shape[0] - used):  # (used <= body.shape[0] here)
            raise ValueError("sparse frame length mismatch (truncated or trailing bytes)")
        m = idx.shape[0]
        if m > 0:
            planes = np.empty(m * w, np.uint8)
            got = _unzstd(planes.ctypes.data, np.uint64(m * w), body.ctypes.data + np.uint64(used), vlen)
            if got >= _ZERR:
                raise ValueError("corrupt zstd stream")
            if got != np.uint64(m * w):
                raise ValueError("value stream decompressed to the wrong size")
            apply(buf, idx, planes, w, kshift, kmask, full)
        lo, hi = _xxh3(buf.ctypes.data, np.uint64(buf.nbytes))
        return m, lo, hi

    @_jit
    def encode_sparse(old: Any, new: Any, o64: Any, n64: Any, per: int, high: Any, w: int,
                      kshift: int, kmask: int, magmask: Any, full: Any, dense_max: int,
                      hot: Any, cap: Any, margin: Any) -> Any:  # pragma: no cover
        """The publisher's whole sparse encode of one chunk but zstd, in one ``nogil`` call.

        ``old`` is the publisher's base (updated to ``new`` here), ``o64``/``n64`` its uint64
        views (``per`` words each; empty for the plain compare); ``hot``/``cap`` the kept hot
        list of ``old`` (``cap`` 0: none). Returns ``(status, changed, planes, positions,
        hot, cap, looked, low64, high64)``: status 0 = nothing changed (nothing touched), 1 =
        sparse frame parts + XXH3-128 of ``new`` (base and hot list updated), 2 = more than
        ``dense_max`` changed (nothing touched: the caller compares codecs instead)."""
        n = new.shape[0]
        empty = np.zeros(0, np.uint8)
        size = 1024 + n // 16
        while True:  # most chunks change in far fewer than 1/16 of their words
            out = np.empty(size, np.int64)
            m = changed64(o64, n64, per, high, out) if per > 0 else changed_plain(old, new, out)
            if m >= 0:
                break
            size = n + 8
        idx = out[:m]
        if m == 0:
            return 0, 0, empty, empty, hot, cap, 0, _U0, _U0
        if m > dense_max:
            return 2, m, empty, empty, hot, cap, 0, _U0, _U0
        planes, zz, keys = values(old, new, idx, w, kshift, kmask, full)
        t = split_threshold(zz, keys)
        looked = 0  # the hot list: 0 not needed, 1 kept list used, 2 scanned
        if t == 0:
            positions = positions_plain(idx)
        else:
            looked = 1
            split_thr = np.uint64(t) << np.uint64(kshift)  # as written in the frame
            thr = split_thr if split_thr <= magmask + _U1 else magmask + _U1
            if cap == _U0 or thr > cap:  # as ChunkHot: scan once with headroom, keep the list
                cap = thr + margin
                if cap > magmask + _U1:
                    cap = magmask + _U1
                hot = hot_words(old, magmask, cap)
                looked = 2
            hw = hot if thr >= cap else hot_filter(hot, old, magmask, thr)
            positions = positions_hot(idx, hw, split_thr, n)
        lo, hi = _xxh3(new.ctypes.data, np.uint64(new.nbytes))
        for i in range(m):
            p = idx[i]
            old[p] = new[p]
        if cap != _U0:
            hot = hot_update(hot, idx, old, magmask, cap)
        return 1, m, planes, positions, hot, cap, looked, lo, hi
