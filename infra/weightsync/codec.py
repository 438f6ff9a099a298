"""Frame codecs: one independent frame per tensor chunk, raw-byte based, bit-exact.

A frame turns the words of one chunk (see :mod:`rawbytes`) into bytes and back:

``raw``     (keyframes) the new words, byte-split (all first bytes, then all second bytes...) and
            zstd-compressed. Byte-splitting puts bf16 sign+exponent bytes together (low entropy)
            away from mantissa bytes (near random): ~12% smaller than zstd of the plain bytes.
``xor``     the reference design of open-source RL stacks: zstd(old XOR new).
``sparse``  positions of changed words, Rice-coded (:mod:`bitpack`, within ~0.05 bit of the
            position entropy), plus the integer difference ``new - old`` of the raw bits of each
            changed word, zigzag-mapped, grouped by the base word's exponent, byte-split and
            zstd-compressed. Small weight updates change a bf16 word by ±1 ulp, so most values cost
            ~1 bit after zstd's Huffman stage.
``same``    the chunk did not change (no bytes at all; lives only in the manifest).

``auto`` picks per chunk: sparse when under a quarter of the words changed (then it is always the
smallest), otherwise the smallest of sparse, xor and raw. Every frame starts with a small header
(tag, word width, word count) that the decoder checks against what the manifest expects.
Decoding writes into a caller-provided buffer holding the base words, in place, so no full-size
temporary is made.
"""

from __future__ import annotations

import struct
import threading
from typing import Literal

import numpy as np
import zstandard

from infra.weightsync.bitpack import decode_positions, encode_positions, positions_size
from infra.weightsync.rawbytes import word_dtype

CodecName = Literal["auto", "xor", "sparse"]
TAG_RAW, TAG_XOR, TAG_SPARSE = 1, 2, 3
TAG_NAMES = {TAG_RAW: "raw", TAG_XOR: "xor", TAG_SPARSE: "sparse"}
_HDR = struct.Struct("<BBQ")  # tag, word width, word count
_SPARSE_LEN = struct.Struct("<Q")  # length of the value stream
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
DENSE_FRACTION = 0.25  # above this changed fraction, auto also tries xor and raw

_local = threading.local()


def _cctx(level: int) -> zstandard.ZstdCompressor:
    """Per-thread compressor (zstd contexts are not thread-safe; creating one costs ~100 µs)."""
    cache = getattr(_local, "c", None)
    if cache is None:
        cache = _local.c = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def _split(words: np.ndarray) -> np.ndarray:
    """Byte-split (shuffle): plane j holds byte j of every word."""
    w = words.dtype.itemsize
    if w == 1:
        return words
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, w).T)


def _unsplit(planes: np.ndarray, n: int, w: int, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`_split` into ``out`` (uint-w words) when given."""
    if w == 1:
        if out is not None:
            out[:] = planes
            return out
        return planes
    if out is None:
        out = np.empty(n, word_dtype(w))
    out.view(np.uint8).reshape(n, w)[:] = planes.reshape(w, n).T
    return out


def _decompress(data: memoryview | bytes, size: int) -> bytes:
    out = _dctx().decompress(data, max_output_size=size)
    if len(out) != size:
        raise ValueError(f"decompressed {len(out)} bytes, expected {size}")
    return out


def changed_positions(old: np.ndarray, new: np.ndarray, block: int = 1 << 15) -> np.ndarray:
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


def _value_order(base: np.ndarray) -> np.ndarray:
    """Order in which changed values are stored: grouped by the base word's exponent-ish bits.

    The size of a weight's change in ulps depends on its magnitude (tiny weights move many ulps,
    normal ones ±1), so grouping values by the top exponent bits of the *base* word (which the
    decoder has) gives zstd's Huffman stage homogeneous blocks: ~20% fewer value bits on real
    AdamW deltas. Bits (8w-2)..(8w-9) are the exponent of bf16/fp32/fp64 (fp16: exponent + 3
    mantissa bits); 1-byte words use their low 7 bits.
    """
    return np.argsort(_key(base).astype(np.uint8), kind="stable")


def encode_raw(new: np.ndarray, level: int) -> bytes:
    """Keyframe frame of ``new`` words."""
    return _HDR.pack(TAG_RAW, new.dtype.itemsize, len(new)) + _cctx(level).compress(_split(new))


def encode_xor(old: np.ndarray, new: np.ndarray, level: int) -> bytes:
    """Reference delta frame: zstd(old XOR new)."""
    return _HDR.pack(TAG_XOR, new.dtype.itemsize, len(new)) + _cctx(level).compress(np.bitwise_xor(old, new))


def _key(words: np.ndarray) -> np.ndarray:
    """Exponent-ish byte of each word: bits (8w-2)..(8w-9) (the sign dropped); 7 low bits for w=1."""
    w = words.dtype.itemsize
    return ((words >> (8 * w - 9)) & 0xFF) if w > 1 else (words & 0x7F)


def _magnitude_mask(w: int) -> int:
    return (1 << (8 * w - 1)) - 1


_POS_PLAIN, _POS_SPLIT = 0, 1
_SPLIT_HDR = struct.Struct("<QB")  # threshold (masked word value), complement flag


def _encode_positions_ctx(old: np.ndarray, idx: np.ndarray, base: np.ndarray, mag: np.ndarray) -> bytes:
    """Positions, optionally split by the base word's magnitude class (the decoder knows the base).

    Weights much smaller than the update size (tiny magnitude, tiny ulp) change almost surely;
    ordinary weights rarely. When the changed words show such a "hot" class (>= 2% of changes moved
    4+ ulps), the words whose magnitude is below a threshold (90th percentile exponent of those
    big movers, +1) are listed from the base, and positions are coded as ranks within each class:
    hot changes (or the hot words that did *not* change, if fewer) and ordinary changes. This
    conditions the position code on the base (the unconditional entropy is not the floor: on real
    AdamW deltas this saves ~20% of position bits). Used only when smaller than the plain code.
    """
    def plain() -> bytes:
        return bytes([_POS_PLAIN]) + encode_positions(idx)

    if len(idx) < 64:
        return plain()
    keys = _key(base)
    big = keys[mag >= 4]
    if len(big) < 0.02 * len(idx):
        return plain()
    w = old.dtype.itemsize
    t = int(np.percentile(big, 90)) + 1
    if np.count_nonzero(keys < t) < 0.1 * len(idx):  # too few hot changes to pay for the extra pass
        return plain()
    thr = (t << (8 * w - 9)) if w > 1 else t
    mask = old.dtype.type(_magnitude_mask(w))
    hot_words = np.flatnonzero((old & mask) < thr)
    if len(hot_words) == 0 or len(hot_words) > len(old) // 4:
        return plain()
    hot = (base & mask) < thr
    ranks = np.searchsorted(hot_words, idx[hot])
    comp = 2 * len(ranks) > len(hot_words)
    if comp:
        keep = np.ones(len(hot_words), np.bool_)
        keep[ranks] = False
        ranks = np.flatnonzero(keep)
    normal = idx[~hot]
    normal_ranks = normal - np.searchsorted(hot_words, normal)
    if positions_size(ranks) + positions_size(normal_ranks) + _SPLIT_HDR.size >= positions_size(idx):
        return plain()
    return b"".join((
        bytes([_POS_SPLIT]), _SPLIT_HDR.pack(thr, comp), encode_positions(ranks), encode_positions(normal_ranks)
    ))


def _decode_positions_ctx(body: memoryview, buf: np.ndarray) -> tuple[np.ndarray, int]:
    n = len(buf)
    mode = body[0]
    if mode == _POS_PLAIN:
        idx, used = decode_positions(body[1:], n)
        return idx, used + 1
    if mode != _POS_SPLIT:
        raise ValueError(f"unknown position mode {mode}")
    thr, comp = _SPLIT_HDR.unpack_from(body, 1)
    off = 1 + _SPLIT_HDR.size
    mask = buf.dtype.type(_magnitude_mask(buf.dtype.itemsize))
    hot_words = np.flatnonzero((buf & mask) < thr)
    ranks, used = decode_positions(body[off:], len(hot_words))
    off += used
    if comp:
        keep = np.ones(len(hot_words), np.bool_)
        keep[ranks] = False
        hot_pos = hot_words[keep]
    else:
        hot_pos = hot_words[ranks]
    normal_ranks, used = decode_positions(body[off:], n - len(hot_words))
    off += used
    gaps = hot_words - np.arange(len(hot_words))  # ordinary words before each hot word
    normal = normal_ranks + np.searchsorted(gaps, normal_ranks, side="right")
    idx = np.concatenate((hot_pos, normal))
    idx.sort(kind="stable")
    return idx, off


def encode_sparse(old: np.ndarray, new: np.ndarray, level: int, idx: np.ndarray | None = None) -> bytes:
    """Sparse delta frame (positions + zigzag integer differences)."""
    if idx is None:
        idx = changed_positions(old, new)
    w = new.dtype.itemsize
    base = old[idx]
    diff = (new[idx] - base).view(_SIGNED[w])  # wraps modulo 2**(8w): exact for any bits
    zz = ((diff << 1) ^ (diff >> (8 * w - 1))).view(new.dtype)
    values = _cctx(level).compress(_split(zz[_value_order(base)])) if len(idx) else b""
    positions = _encode_positions_ctx(old, idx, base, zz >> 1)
    return b"".join((_HDR.pack(TAG_SPARSE, w, len(new)), positions, _SPARSE_LEN.pack(len(values)), values))


def encode_delta(
    old: np.ndarray, new: np.ndarray, codec: CodecName = "auto", level: int = 1
) -> tuple[bytes | None, np.ndarray | None]:
    """Encode the change from ``old`` to ``new`` (same dtype and length).

    Returns ``(frame, changed_positions)``; ``frame`` is None when nothing changed. The positions
    are returned (None for xor/raw frames) so the caller can update its copy of the base cheaply.
    """
    if codec == "xor":
        if np.array_equal(old, new):
            return None, np.zeros(0, np.int64)
        return encode_xor(old, new, level), None
    idx = changed_positions(old, new)
    if len(idx) == 0:
        return None, idx
    sparse = encode_sparse(old, new, level, idx)
    if codec == "sparse" or len(idx) <= DENSE_FRACTION * len(new):
        return sparse, idx
    if codec != "auto":
        raise ValueError(f"unknown codec {codec!r}; known: auto, xor, sparse")
    best = min((sparse, encode_xor(old, new, level), encode_raw(new, level)), key=len)
    return best, (idx if best is sparse else None)


def frame_tag(frame: bytes | memoryview) -> str:
    """Codec name of a frame (for statistics)."""
    return TAG_NAMES.get(frame[0], "?")


def decode_into(frame: bytes | memoryview, buf: np.ndarray) -> None:
    """Apply ``frame`` to ``buf`` in place: ``buf`` holds the base words (ignored for raw frames).

    Raises ValueError when the frame is truncated, malformed or does not fit ``buf``.
    """
    mv = memoryview(frame)
    if len(mv) < _HDR.size:
        raise ValueError(f"frame of {len(mv)} bytes is shorter than its header")
    tag, w, n = _HDR.unpack_from(mv, 0)
    if w != buf.dtype.itemsize or n != len(buf):
        raise ValueError(f"frame is {n} words of {w} bytes, expected {len(buf)} of {buf.dtype.itemsize}")
    body = mv[_HDR.size :]
    if tag == TAG_RAW:
        planes = np.frombuffer(_decompress(body, n * w), np.uint8)
        _unsplit(planes, n, w, out=buf)
    elif tag == TAG_XOR:
        np.bitwise_xor(buf, np.frombuffer(_decompress(body, n * w), buf.dtype), out=buf)
    elif tag == TAG_SPARSE:
        idx, used = _decode_positions_ctx(body, buf)
        (vlen,) = _SPARSE_LEN.unpack_from(body, used)
        used += _SPARSE_LEN.size
        if used + vlen != len(body):
            raise ValueError("sparse frame length mismatch (truncated or trailing bytes)")
        if len(idx) == 0:
            return
        base = buf[idx]
        zz = np.empty(len(idx), buf.dtype)
        zz[_value_order(base)] = _unsplit(np.frombuffer(_decompress(body[used:], len(idx) * w), np.uint8), len(idx), w)
        diff = (zz >> 1) ^ (-(zz & 1).view(_SIGNED[w])).view(buf.dtype)
        buf[idx] = base + diff
    else:
        raise ValueError(f"unknown frame tag {tag}")
