"""Hot loops of the sparse codec: numba kernels with pure-numpy twins that produce identical bytes.

Why: at lr 1e-6 a 4 MiB chunk has ~8,000 changed words out of 2M. The numpy formulation of the
sparse frame costs ~150 numpy calls per chunk (position coding, byte-splitting, the base-magnitude
class scan) plus full-size temporaries; that, not memory bandwidth, capped encode at ~1.4 GB/s and
decode at ~2.8 GB/s on one core. The numba kernels do each step in one pass without temporaries
(``nogil``, so a thread pool uses every core) and run at memory speed.

Both implementations write and read exactly the same format (see :mod:`codec`), make the same
encoder decisions (Rice parameter, magnitude-class threshold, complement flag) with integer
arithmetic, and raise ``ValueError`` on the same malformed streams; tests compare them byte for byte.
numba is optional: without it (or with ``DELTALOOP_NO_NUMBA=1``) the numpy twins run.
Compiled kernels are cached on disk (``NUMBA_CACHE_DIR``, default ``<repo>/.state/numba`` in a
checkout) so a process pays the ~10 s compile once per machine, not per start.

Sparse frame body, as produced here (after the codec's frame header)::

    positions: mode byte 0, rice(idx)                                   (plain)
           or  mode byte 1, <QB> thr, comp, rice(ranks), rice(normal)   (split by base magnitude)
    values:    zigzag(new - old) of each changed word, stably ordered by the base word's exponent
               byte, byte-split into w planes (compressed by the caller)

``rice(p)`` = ``<BQQ>`` k, unary bit count, count; unary parts of the gaps ``p_i - p_{i-1} - 1``
(MSB-first bits), then their k low bits as big-endian k-bit fields.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np

from infra.weightsync.bitpack import decode_positions, encode_positions, positions_size


def _set_cache_dir() -> None:
    """Point numba's on-disk cache at ``<repo>/.state/numba`` in a source checkout (unless set)."""
    if "NUMBA_CACHE_DIR" in os.environ:
        return
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").exists():
        d = root / ".state" / "numba"
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
        import numba

        HAVE_NUMBA = True
    except ImportError:  # optional accelerator
        pass

HotSource = Callable[[int], np.ndarray]  # threshold -> sorted positions of the words below it

_POS_PLAIN, _POS_SPLIT = 0, 1
_SPLIT_HDR = struct.Struct("<QB")  # threshold (masked word value), complement flag
_RICE_HDR = 17  # struct "<BQQ": k, unary bits, count
_MIN_SPLIT = 64  # fewer changes than this: always plain positions

# ----------------------------------------------------------------------------- word constants


def _consts(w: int) -> tuple[int, int, int]:
    """(key shift, key mask, magnitude mask) of ``w``-byte words (see ``codec._key``)."""
    if w == 1:
        return 0, 0x7F, 0x7F
    return 8 * w - 9, 0xFF, (1 << (8 * w - 1)) - 1


def _key_np(words: np.ndarray) -> np.ndarray:
    """Exponent-ish byte of each word (uint8): bits (8w-2)..(8w-9); the 7 low bits for w=1."""
    sh, km, _ = _consts(words.dtype.itemsize)
    return ((words >> sh) & km).astype(np.uint8)


# ------------------------------------------------------------------------------ numpy twins


def _np_changed(old: np.ndarray, new: np.ndarray, block: int = 1 << 15) -> np.ndarray:
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


def _np_values(old: np.ndarray, new: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(byte planes of the ordered zigzag differences, base words, zigzag values)."""
    w = new.dtype.itemsize
    base = old[idx]
    diff = (new[idx] - base).view(_SIGNED[w])  # wraps modulo 2**(8w): exact for any bits
    zz = ((diff << 1) ^ (diff >> (8 * w - 1))).view(new.dtype)
    ordered = zz[np.argsort(_key_np(base), kind="stable")]
    planes = ordered.view(np.uint8).reshape(-1, w).T.reshape(-1) if w > 1 else ordered
    return np.ascontiguousarray(planes), base, zz


def _np_positions(old: np.ndarray, idx: np.ndarray, base: np.ndarray, zz: np.ndarray,
                  hot: "HotSource | None" = None) -> bytes:
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
        return bytes([_POS_PLAIN]) + encode_positions(idx)

    if m < _MIN_SPLIT:
        return plain()
    w = old.dtype.itemsize
    keys = _key_np(base)
    big = keys[(zz >> 1) >= 4]
    if 50 * len(big) < m:
        return plain()
    t = int(np.sort(big)[(9 * (len(big) - 1)) // 10]) + 1
    if 10 * int(np.count_nonzero(keys < t)) < m:
        return plain()
    sh, _km, mm = _consts(w)
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
    if positions_size(ranks) + positions_size(normal_ranks) + _SPLIT_HDR.size >= positions_size(idx):
        return plain()
    return b"".join((
        bytes([_POS_SPLIT]), _SPLIT_HDR.pack(thr, comp), encode_positions(ranks), encode_positions(normal_ranks)
    ))


def _np_decode_positions(body: np.ndarray, buf: np.ndarray, hot: "HotSource | None" = None) -> tuple[np.ndarray, int]:
    """Inverse of the position stream: (sorted changed positions, bytes consumed)."""
    n = len(buf)
    if len(body) < 1:
        raise ValueError("position stream truncated")
    mode = int(body[0])
    if mode == _POS_PLAIN:
        idx, used = decode_positions(memoryview(body)[1:], n)
        return idx, used + 1
    if mode != _POS_SPLIT:
        raise ValueError(f"unknown position mode {mode}")
    if len(body) < 1 + _SPLIT_HDR.size:
        raise ValueError("position stream truncated")
    thr, comp = _SPLIT_HDR.unpack_from(memoryview(body), 1)
    off = 1 + _SPLIT_HDR.size
    mask = buf.dtype.type(_consts(buf.dtype.itemsize)[2])
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


def _np_apply(buf: np.ndarray, idx: np.ndarray, planes: np.ndarray) -> None:
    """``buf[idx] += unzigzag(values)`` (modulo 2**(8w)), values un-ordered from ``planes``."""
    w, m = buf.dtype.itemsize, len(idx)
    base = buf[idx]
    zz = np.empty(m, buf.dtype)
    if w > 1:
        vals = np.empty(m, buf.dtype)
        vals.view(np.uint8).reshape(m, w)[:] = planes.reshape(w, m).T
    else:
        vals = planes.view(buf.dtype)
    zz[np.argsort(_key_np(base), kind="stable")] = vals
    diff = (zz >> 1) ^ (-(zz & 1).view(_SIGNED[w])).view(buf.dtype)
    buf[idx] = base + diff


_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}

# ----------------------------------------------------------------------------- numba kernels

if HAVE_NUMBA:
    def _jit(fn: Any = None, **kw: Any) -> Any:
        opts = dict(cache=True, nogil=True, boundscheck=False, **kw)
        return numba.njit(**opts) if fn is None else numba.njit(**opts)(fn)

    from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros
    _U0, _U1, _U8, _UFF = np.uint64(0), np.uint64(1), np.uint64(8), np.uint64(0xFF)

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
    def _nb_changed64(o: Any, n: Any, per: int, high: Any, out: Any) -> int:  # pragma: no cover
        """Changed lanes of 8-byte words holding ``per`` lanes each.

        One branch per 4 words; in a word that differs, a SWAR test marks the lanes that differ
        (their top bit in ``high``) and trailing-zero counts walk them. (Reducing 2 KiB pieces to
        a mask first, as the hot-class scan does, measured slower here: changes are too frequent.)
        """
        low = ~high
        lane_bits = 64 // per
        k = 0
        m = o.shape[0]
        i = 0
        while i + 4 <= m:
            if ((o[i] ^ n[i]) | (o[i + 1] ^ n[i + 1]) | (o[i + 2] ^ n[i + 2]) | (o[i + 3] ^ n[i + 3])) != _U0:
                for a in range(i, i + 4):
                    y = o[a] ^ n[a]
                    k = _emit_lanes((((y & low) + low) | y) & high, a, per, lane_bits, out, k)
                    if k < 0:  # ``out`` is full
                        return -1
            i += 4
        for a in range(i, m):
            y = o[a] ^ n[a]
            k = _emit_lanes((((y & low) + low) | y) & high, a, per, lane_bits, out, k)
            if k < 0:
                return -1
        return k

    @_jit
    def _nb_changed_plain(o: Any, n: Any, out: Any) -> int:  # pragma: no cover
        k = 0
        for i in range(o.shape[0]):
            if o[i] != n[i]:
                if k >= out.shape[0]:
                    return -1
                out[k] = i
                k += 1
        return k

    @_jit
    def _nb_slots(keys: Any) -> Any:  # pragma: no cover
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
    def _nb_values(old: Any, new: Any, idx: Any, w: int, kshift: int, kmask: int, full: Any) -> Any:  # pragma: no cover
        m = idx.shape[0]
        bits = 8 * w
        sb = np.uint64(bits - 1)
        keys = np.empty(m, np.int64)
        zz = np.empty(m, np.uint64)
        base = np.empty(m, np.uint64)
        for i in range(m):
            p = idx[i]
            b = np.uint64(old[p])
            u = (np.uint64(new[p]) - b) & full
            s = (u >> sb) & _U1
            z = ((u << _U1) & full) ^ (full if s else _U0)
            zz[i] = z
            base[i] = b
            keys[i] = np.int64((b >> np.uint64(kshift)) & np.uint64(kmask))
        slot = _nb_slots(keys)
        planes = np.empty(m * w, np.uint8)
        for i in range(m):
            z = zz[i]
            s = slot[i]
            for j in range(w):
                planes[j * m + s] = np.uint8((z >> np.uint64(8 * j)) & _UFF)
        return planes, base, zz, keys

    @_jit
    def _nb_rice_k(pos: Any) -> Any:  # pragma: no cover
        """(k, unary bits) minimising the Rice code of the gaps of ``pos`` (same rule as bitpack)."""
        m = pos.shape[0]
        if m == 0:
            return 0, 0
        total = 0
        prev = -1
        for i in range(m):
            total += pos[i] - prev - 1
            prev = pos[i]
        x = (total / m) * 0.69 + 1.0
        xi = np.int64(x)
        k0 = 0
        while xi > 1:
            xi >>= 1
            k0 += 1
        lo = max(0, k0 - 2)
        hi = min(62, k0 + 3)
        sums = np.zeros(5, np.int64)
        prev = -1
        for i in range(m):
            g = pos[i] - prev - 1
            prev = pos[i]
            for c in range(hi - lo):
                sums[c] += g >> (lo + c)
        best_k = lo
        best_bits = -1
        for c in range(hi - lo):
            b = m * (lo + c + 1) + sums[c]
            if best_bits < 0 or b < best_bits:
                best_k, best_bits = lo + c, b
        return best_k, m + sums[best_k - lo]

    @_jit
    def _nb_rice_size(pos: Any) -> int:  # pragma: no cover
        m = pos.shape[0]
        if m == 0:
            return _RICE_HDR
        k, ub = _nb_rice_k(pos)
        return _RICE_HDR + (ub + 7) // 8 + (m * k + 7) // 8

    @_jit
    def _nb_put_le(out: Any, off: int, v: int, nbytes: int) -> None:  # pragma: no cover
        u = np.uint64(v)
        for j in range(nbytes):
            out[off + j] = np.uint8((u >> np.uint64(8 * j)) & _UFF)

    @_jit
    def _nb_rice_write(pos: Any, out: Any, off: int) -> int:  # pragma: no cover
        """Write rice(pos) at ``out[off:]`` (zeroed); returns the end offset."""
        m = pos.shape[0]
        if m == 0:
            for j in range(_RICE_HDR):
                out[off + j] = 0
            return off + _RICE_HDR
        k, ub = _nb_rice_k(pos)
        out[off] = np.uint8(k)
        _nb_put_le(out, off + 1, ub, 8)
        _nb_put_le(out, off + 9, m, 8)
        u0 = off + _RICE_HDR
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
    def _nb_hot_swar(b64: Any, per: int, lmask: Any, high: Any, tb: Any, hot: Any, h: int) -> int:  # pragma: no cover
        """Append to ``hot`` the lanes of ``b64`` (``per`` words per uint64) with magnitude below
        the threshold; returns the new count, or -1 when ``hot`` is full.

        SWAR: with ``lmask`` = the magnitude mask and ``high`` = the top bit in every lane, and
        ``tb`` = the threshold (<= top bit) in every lane, ``((x & lmask) | high) - tb`` borrows
        into no other lane and keeps a lane's top bit exactly when its magnitude >= threshold.
        2 KiB pieces are first reduced to a 64-bit mask of 32-byte blocks with a hit
        (:func:`_piece_hits`, vectorised); only those blocks are walked, with trailing-zero counts
        (written out: with :func:`_emit_lanes` inlined here the walk compiled ~3x slower on dense
        hot classes). Block size: at lr 1e-6 (~0.25% hot words, clustered) so many 128-byte blocks
        held a hit that the scalar walk dominated; 32-byte blocks halve the whole scan (SmolLM2,
        one core, cold caches: 73 -> 36 ms on the AMD EPYC; the 128-byte version had measured
        45-53 -> 24-31 ms against a plain loop on the Xeon).
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
    def _nb_hot_words(buf: Any, magmask: Any, thr: Any) -> Any:  # pragma: no cover
        """Sorted positions of words with ``(word & magmask) < thr`` (``magmask``, ``thr``: uint64).

        The class is rare but clustered (~0.25% of words at lr 1e-6). ``magmask`` is always the
        word's bits below its top bit, so the test runs SWAR on 8-byte groups (:func:`_nb_hot_swar`);
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
            h = _nb_hot_swar(buf[:m4].view(np.uint64), per, lmask, high, tb, hot, 0)
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
    def _nb_split_threshold(zz: Any, keys: Any) -> int:  # pragma: no cover
        """Exponent-byte threshold ``t`` of the hot class (see :func:`_np_positions`), 0 = plain."""
        m = zz.shape[0]
        if m < _MIN_SPLIT:
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
    def _nb_positions_plain(idx: Any) -> Any:  # pragma: no cover
        out = np.zeros(1 + _nb_rice_size(idx), np.uint8)
        _nb_rice_write(idx, out, 1)
        return out

    @_jit
    def _nb_positions_hot(idx: Any, hot: Any, thr: Any, n: int) -> Any:  # pragma: no cover
        """The position stream split by the hot class ``hot`` (sorted positions of the base words
        below ``thr``), or the plain stream when that is not smaller; same decisions as numpy."""
        m = idx.shape[0]
        nhot = hot.shape[0]
        if nhot == 0 or nhot > n // 4:
            return _nb_positions_plain(idx)
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
        size = 1 + 9 + _nb_rice_size(ranks) + _nb_rice_size(normal)
        if size - 1 < _nb_rice_size(idx):
            out = np.zeros(size, np.uint8)
            out[0] = 1
            _nb_put_le(out, 1, thr, 8)
            out[9] = 1 if comp else 0
            o = _nb_rice_write(ranks, out, 10)
            _nb_rice_write(normal, out, o)
            return out
        return _nb_positions_plain(idx)

    @_jit
    def _nb_hot_filter(hot: Any, words: Any, magmask: Any, thr: Any) -> Any:  # pragma: no cover
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
    def _nb_hot_update(hot: Any, idx: Any, words: Any, magmask: Any, cap: Any) -> Any:  # pragma: no cover
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

    @_jit
    def _nb_get_le(buf: Any, off: int, nbytes: int) -> Any:  # pragma: no cover
        v = _U0
        for j in range(nbytes):
            v |= np.uint64(buf[off + j]) << np.uint64(8 * j)
        return v

    @_jit
    def _nb_rice_read(buf: Any, off: int, limit: int) -> Any:  # pragma: no cover
        """Decode rice positions at ``buf[off:]``; (positions, end offset); raises on bad streams."""
        if off + _RICE_HDR > buf.shape[0]:
            raise ValueError("position stream truncated")
        k = np.int64(buf[off])
        ub = _nb_get_le(buf, off + 1, 8)
        m = _nb_get_le(buf, off + 9, 8)
        off += _RICE_HDR
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
        bit = 0
        prev = -1
        r = off + ulen
        acc = _U0
        nb = 0
        for i in range(n):
            byte = bit >> 3
            v = np.int64(buf[off + byte]) & (0xFF >> (bit & 7))
            while v == 0:
                byte += 1
                if byte >= ulen:
                    raise ValueError("position stream inconsistent")
                v = np.int64(buf[off + byte])
            term = byte * 8 + np.int64(leading_zeros(np.uint8(v)))
            if term >= ubits:
                raise ValueError("position stream inconsistent")
            q = term - bit
            bit = term + 1
            rem = _U0
            kk = k
            while kk > 0:
                step = kk if kk <= 32 else 32
                kk -= step
                while nb < step:
                    acc = (acc << _U8) | np.uint64(buf[r])
                    r += 1
                    nb += 8
                nb -= step
                rem = (rem << np.uint64(step)) | ((acc >> np.uint64(nb)) & ((_U1 << np.uint64(step)) - _U1))
            p = prev + 1 + ((q << k) | np.int64(rem))
            if p <= prev or p >= limit:
                raise ValueError("position beyond tensor end")
            out[i] = p
            prev = p
        # the numpy decoder counts set bits among the first ubits: none may follow the last one
        while bit < ubits:
            if (np.int64(buf[off + (bit >> 3)]) >> (7 - (bit & 7))) & 1:
                raise ValueError("position stream inconsistent")
            bit += 1
        return out, off + ulen + rlen

    @_jit
    def _nb_decode_positions(body: Any, buf: Any, magmask: Any) -> Any:  # pragma: no cover
        n = buf.shape[0]
        if body.shape[0] < 1:
            raise ValueError("position stream truncated")
        mode = body[0]
        if mode == 0:
            return _nb_rice_read(body, 1, n)
        if mode != 1:
            raise ValueError("unknown position mode")
        if body.shape[0] < 10:
            raise ValueError("position stream truncated")
        hot = _nb_hot_words(buf, magmask, _nb_get_le(body, 1, 8))
        return _nb_decode_split(body, hot, n)

    @_jit
    def _nb_decode_split(body: Any, hot: Any, n: int) -> Any:  # pragma: no cover
        """Positions of a split stream (mode 1, header already checked) given the hot list."""
        comp = body[9] != 0
        nhot = hot.shape[0]
        ranks, off = _nb_rice_read(body, 10, nhot)
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
        normal, off = _nb_rice_read(body, off, n - nhot)
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

    @_jit
    def _nb_apply(buf: Any, idx: Any, planes: Any, w: int, kshift: int, kmask: int, full: Any) -> None:  # pragma: no cover
        m = idx.shape[0]
        keys = np.empty(m, np.int64)
        for i in range(m):
            keys[i] = np.int64((np.uint64(buf[idx[i]]) >> np.uint64(kshift)) & np.uint64(kmask))
        slot = _nb_slots(keys)
        for i in range(m):
            s = slot[i]
            z = _U0
            for j in range(w):
                z |= np.uint64(planes[j * m + s]) << np.uint64(8 * j)
            d = ((z >> _U1) ^ ((_U0 - (z & _U1)) & full)) & full
            p = idx[i]
            buf[p] = (np.uint64(buf[p]) + d) & full

    from infra.weightsync import native as _native

    if _native.AVAILABLE:
        _xxh3, _unzstd = _native.xxh3_128, _native.zstd_decompress
        _ZERR = np.uint64(_native.ZSTD_ERROR_MIN)

        @_jit
        def _nb_apply_sparse(body: Any, buf: Any, magmask: Any, w: int, kshift: int, kmask: int,
                             full: Any) -> Any:  # pragma: no cover
            """A whole sparse frame body applied to ``buf`` in place, then XXH3-128 of ``buf``:
            positions (with the hot-class scan), zstd of the value planes, the scatter and the
            digest in one ``nogil`` call. Returns ``(changed, low64, high64)``; raises ValueError
            on the streams :func:`codec.decode_into` rejects, before ``buf`` is modified."""
            idx, used = _nb_decode_positions(body, buf, magmask)
            if used + 8 > body.shape[0]:
                raise ValueError("sparse frame truncated")
            vlen = _nb_get_le(body, used, 8)
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
                _nb_apply(buf, idx, planes, w, kshift, kmask, full)
            lo, hi = _xxh3(buf.ctypes.data, np.uint64(buf.nbytes))
            return m, lo, hi

        @_jit
        def _nb_encode_sparse(old: Any, new: Any, o64: Any, n64: Any, per: int, high: Any, w: int,
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
                m = _nb_changed64(o64, n64, per, high, out) if per > 0 else _nb_changed_plain(old, new, out)
                if m >= 0:
                    break
                size = n + 8
            idx = out[:m]
            if m == 0:
                return 0, 0, empty, empty, hot, cap, 0, _U0, _U0
            if m > dense_max:
                return 2, m, empty, empty, hot, cap, 0, _U0, _U0
            planes, _base, zz, keys = _nb_values(old, new, idx, w, kshift, kmask, full)
            t = _nb_split_threshold(zz, keys)
            looked = 0  # the hot list: 0 not needed, 1 kept list used, 2 scanned
            if t == 0:
                positions = _nb_positions_plain(idx)
            else:
                looked = 1
                split_thr = np.uint64(t) << np.uint64(kshift)  # as written in the frame
                thr = split_thr if split_thr <= magmask + _U1 else magmask + _U1
                if cap == _U0 or thr > cap:  # as ChunkHot: scan once with headroom, keep the list
                    cap = thr + margin
                    if cap > magmask + _U1:
                        cap = magmask + _U1
                    hot = _nb_hot_words(old, magmask, cap)
                    looked = 2
                hw = hot if thr >= cap else _nb_hot_filter(hot, old, magmask, thr)
                positions = _nb_positions_hot(idx, hw, split_thr, n)
            lo, hi = _xxh3(new.ctypes.data, np.uint64(new.nbytes))
            for i in range(m):
                p = idx[i]
                old[p] = new[p]
            if cap != _U0:
                hot = _nb_hot_update(hot, idx, old, magmask, cap)
            return 1, m, planes, positions, hot, cap, looked, lo, hi


# --------------------------------------------------------------------------------- dispatch

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
    return np.uint64((1 << (8 * w)) - 1)


_HIGH = {w: np.uint64(int.from_bytes(((1 << (8 * w - 1)).to_bytes(w, "little")) * (8 // w), "little"))
         for w in (1, 2, 4)}  # the top bit of every ``w``-byte lane of a uint64 (SWAR compare)


def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Sorted indices (int64) of the words where ``old`` and ``new`` differ."""
    if _impl == "numpy":
        return _np_changed(old, new)
    n, w = len(new), new.dtype.itemsize
    out = np.empty(n + 8, np.int64)  # only the pages written are touched; slack for branch-free stores
    per = 8 // w
    if w < 8 and n % per == 0 and old.flags.c_contiguous and new.flags.c_contiguous:
        k = _nb_changed64(old.view(np.uint64), new.view(np.uint64), per, _HIGH[w], out)
    else:
        k = _nb_changed_plain(old, new, out)
    return out[:k].copy()


def sparse_parts(old: np.ndarray, new: np.ndarray, idx: np.ndarray,
                 hot: "HotSource | None" = None) -> tuple[np.ndarray, bytes | np.ndarray]:
    """(value planes to compress, position stream) of a sparse frame; ``idx`` = changed positions.

    ``hot``: where the hot-class list of ``old`` comes from (a cache kept across versions, see
    :mod:`infra.weightsync.hotwords`); None scans ``old``. The bytes are the same either way."""
    if _impl == "numpy":
        planes, base, zz = _np_values(old, new, idx)
        return planes, _np_positions(old, idx, base, zz, hot)
    w = new.dtype.itemsize
    sh, km, mm = _consts(w)
    idx = np.ascontiguousarray(idx, np.int64)
    planes, base, zz, keys = _nb_values(old, new, idx, w, sh, km, _full(w))
    t = _nb_split_threshold(zz, keys)
    if t == 0:
        return planes, _nb_positions_plain(idx)
    thr = t << sh
    hw = hot(thr) if hot is not None else hot_words(old, thr)
    return planes, _nb_positions_hot(idx, hw, np.uint64(thr), len(old))


def decode_positions_ctx(body: np.ndarray, buf: np.ndarray, hot: "HotSource | None" = None) -> tuple[np.ndarray, int]:
    """Changed positions from a position stream (``body``: uint8, from its mode byte), bytes used.

    ``hot`` as in :func:`sparse_parts` (the hot list of ``buf``'s current words)."""
    if _impl == "numpy":
        return _np_decode_positions(body, buf, hot)
    if hot is not None and len(body) >= 1 + _SPLIT_HDR.size and body[0] == _POS_SPLIT:
        thr = int(_SPLIT_HDR.unpack_from(body, 1)[0])
        idx, used = _nb_decode_split(body, np.ascontiguousarray(hot(thr), np.int64), len(buf))
    else:
        idx, used = _nb_decode_positions(body, buf, np.uint64(_consts(buf.dtype.itemsize)[2]))
    return idx, int(used)


def magnitude_mask(w: int) -> int:
    """The bits below a ``w``-byte word's top (sign) bit: its magnitude for the hot class."""
    return _consts(w)[2]


def hot_words(words: np.ndarray, thr: int) -> np.ndarray:
    """Sorted positions (int64) of the words whose magnitude (``word & magnitude_mask``) is below
    ``thr``: the "hot" class the split position code conditions on (a scan of every word)."""
    mm = magnitude_mask(words.dtype.itemsize)
    if _impl == "numpy":
        return np.flatnonzero((words & words.dtype.type(mm)) < min(thr, mm + 1))
    return _nb_hot_words(words, np.uint64(mm), np.uint64(min(thr, mm + 1)))


def hot_filter(hot: np.ndarray, words: np.ndarray, thr: int) -> np.ndarray:
    """The positions in ``hot`` whose word's magnitude is below ``thr`` (a sub-list, order kept)."""
    mm = magnitude_mask(words.dtype.itemsize)
    if _impl == "numpy":
        return hot[(words[hot] & words.dtype.type(mm)) < thr]
    return _nb_hot_filter(hot, words, np.uint64(mm), np.uint64(thr))


def hot_update(hot: np.ndarray, idx: np.ndarray, words: np.ndarray, cap: int) -> np.ndarray:
    """The hot list (threshold ``cap``) of ``words`` after the words at ``idx`` (sorted) changed:
    ``hot`` without ``idx``, plus the changed words now below ``cap``. O(len(hot) + len(idx))."""
    mm = magnitude_mask(words.dtype.itemsize)
    if _impl == "numpy":
        keep = hot[~np.isin(hot, idx, assume_unique=True)]
        now = idx[(words[idx] & words.dtype.type(mm)) < cap]
        return np.union1d(keep, now).astype(np.int64)
    return _nb_hot_update(hot, np.ascontiguousarray(idx, np.int64), words, np.uint64(mm), np.uint64(cap))


def apply_values(buf: np.ndarray, idx: np.ndarray, planes: np.ndarray) -> None:
    """Add the zigzag differences in ``planes`` to ``buf`` at ``idx`` (in place)."""
    if _impl == "numpy":
        _np_apply(buf, idx, planes)
        return
    w = buf.dtype.itemsize
    sh, km, _ = _consts(w)
    _nb_apply(buf, idx, planes, w, sh, km, _full(w))


# the one-call kernels, when numba and the native symbols are there (:mod:`native`)
_FUSED_ENCODE = globals().get("_nb_encode_sparse")
_FUSED_DECODE = globals().get("_nb_apply_sparse")
_NO_HOT = np.zeros(0, np.int64)
_NO_WORDS = np.zeros(0, np.uint64)


def encode_sparse_update(old: np.ndarray, new: np.ndarray, hot: tuple[int, np.ndarray] | None,
                         margin: int, dense_max: int) -> tuple | None:
    """The publisher's sparse encode of one chunk in one native call (see ``_nb_encode_sparse``):
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
    sh, km, mm = _consts(w)
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
    sh, km, mm = _consts(w)
    _m, lo, hi = fused(body, buf, np.uint64(mm), w, sh, km, _full(w))
    return f"{int(hi):016x}{int(lo):016x}"


_warm = False


def warm_up() -> None:
    """Compile (or load from the on-disk cache) every kernel signature the codec uses, once per
    process, so that no publish or fetch pays it: every word width, writable and read-only inputs
    (safetensors maps and ``np.frombuffer`` give read-only arrays)."""
    global _warm
    if _warm or not HAVE_NUMBA or _impl != "numba":
        return
    from infra.weightsync import codec

    rng = np.random.default_rng(0)
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        old = rng.integers(0, 1 << 8, 4096).astype(dt)
        new = old.copy()
        new[::3] += 1
        new[:80] = 0
        for ro in (False, True):
            o, n = old.copy(), new.copy()
            o.flags.writeable = n.flags.writeable = not ro
            frame, _idx = codec.encode_delta(o, n, "sparse")
            if frame is not None:
                codec.decode_into(frame, old.copy())
                codec.decode_into(bytearray(frame), old.copy())
                codec.decode_digest(frame, old.copy())  # the reader's fused path
                codec.decode_digest(bytearray(frame), old.copy())
            b = o.copy()  # the publisher's fused path (writable base, new words either way)
            encode_sparse_update(b, n, None, 2, len(n))
            encode_sparse_update(b, o, (1 << 4, hot_words(b, 1 << 4)), 2, len(n))
            # the publisher's kept hot lists (scan, filter, update) and the split position code
            hot = hot_words(o, 1 << 4)
            hot_filter(hot, o, 1 << 3)
            hot_update(hot, np.arange(0, 4096, 7, dtype=np.int64), o, 1 << 4)
    idx = np.arange(0, 4096, 5, dtype=np.int64)
    _nb_positions_hot(idx, idx[::3].copy(), np.uint64(1 << 7), 4096)
    _nb_positions_plain(idx)
    _nb_split_threshold(np.arange(len(idx), dtype=np.uint64), np.zeros(len(idx), np.int64))
    _warm = True
