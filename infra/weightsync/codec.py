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

from infra.weightsync.kernels import (
    apply_sparse_digest,
    apply_values,
    changed_positions,
    decode_positions_ctx,
    sparse_parts,
)
from infra.weightsync.rawbytes import word_dtype
from infra.weightsync.sparse_format import HotSource

CodecName = Literal["auto", "xor", "sparse"]
TAG_RAW, TAG_XOR, TAG_SPARSE = 1, 2, 3
TAG_NAMES = {TAG_RAW: "raw", TAG_XOR: "xor", TAG_SPARSE: "sparse"}
_HDR = struct.Struct("<BBQ")  # tag, word width, word count
_SPARSE_LEN = struct.Struct("<Q")  # length of the value stream
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
    """The ``size`` bytes a zstd frame holds. The content size a frame header declares is checked
    first: zstd allocates that much whatever ``max_output_size`` says."""
    try:
        declared = zstandard.frame_content_size(data)
        if declared > size:
            raise ValueError(f"zstd frame declares {declared} bytes, expected {size}")
        out = _dctx().decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise ValueError(f"corrupt zstd stream: {exc}") from None
    if len(out) != size:
        raise ValueError(f"decompressed {len(out)} bytes, expected {size}")
    return out


def encode_raw(new: np.ndarray, level: int) -> bytes:
    """Keyframe frame of ``new`` words."""
    return _HDR.pack(TAG_RAW, new.dtype.itemsize, len(new)) + _cctx(level).compress(_split(new))


def encode_xor(old: np.ndarray, new: np.ndarray, level: int) -> bytes:
    """Reference delta frame: zstd(old XOR new)."""
    return _HDR.pack(TAG_XOR, new.dtype.itemsize, len(new)) + _cctx(level).compress(np.bitwise_xor(old, new))


def encode_sparse(old: np.ndarray, new: np.ndarray, level: int, idx: np.ndarray | None = None,
                  hot: HotSource | None = None) -> bytes:
    """Sparse delta frame (positions + ordered, byte-split zigzag integer differences).

    ``hot``: the hot-word list of ``old`` from a cache (:mod:`infra.weightsync.hotwords`), else scanned."""
    if idx is None:
        idx = changed_positions(old, new)
    planes, positions = sparse_parts(old, new, idx, hot)
    return sparse_frame(planes, positions, new.dtype.itemsize, len(new), len(idx), level)


def sparse_frame(planes: np.ndarray, positions: bytes | np.ndarray, w: int, n: int, changed: int,
                 level: int) -> bytes:
    """A sparse frame from its parts (value planes of ``changed`` words, position stream)."""
    values = _cctx(level).compress(planes) if changed else b""
    return b"".join((_HDR.pack(TAG_SPARSE, w, n), positions, _SPARSE_LEN.pack(len(values)), values))


def encode_delta(
    old: np.ndarray, new: np.ndarray, codec: CodecName = "auto", level: int = 1,
    hot: HotSource | None = None,
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
    sparse = encode_sparse(old, new, level, idx, hot)
    if codec == "sparse" or len(idx) <= DENSE_FRACTION * len(new):
        return sparse, idx
    if codec != "auto":
        raise ValueError(f"unknown codec {codec!r}; known: auto, xor, sparse")
    best = min((sparse, encode_xor(old, new, level), encode_raw(new, level)), key=len)
    return best, (idx if best is sparse else None)


def frame_tag(frame: bytes | memoryview) -> str:
    """Codec name of a frame (for statistics)."""
    return TAG_NAMES.get(frame[0], "?")


def decode_digest(frame: bytes | memoryview, buf: np.ndarray) -> str | None:
    """:func:`decode_into` a sparse frame and return the xxh3-128 hex digest of ``buf`` after it,
    in one native call that holds no GIL (:func:`~infra.weightsync.kernels.apply_sparse_digest`).

    None, with ``buf`` untouched, for anything else (raw and xor frames, a header that does not
    fit ``buf``, no native path): the caller then decodes with :func:`decode_into`, which also
    gives the precise error for a bad header."""
    mv = memoryview(frame)
    if len(mv) < _HDR.size:
        return None
    tag, w, n = _HDR.unpack_from(mv, 0)
    if tag != TAG_SPARSE or w != buf.dtype.itemsize or n != len(buf):
        return None
    return apply_sparse_digest(np.frombuffer(mv[_HDR.size :], np.uint8), buf)


def decode_into(frame: bytes | memoryview, buf: np.ndarray, hot: HotSource | None = None) -> np.ndarray | None:
    """Apply ``frame`` to ``buf`` in place: ``buf`` holds the base words (ignored for raw frames).

    Returns the changed positions for a sparse frame, None for raw and xor frames (any word may
    have changed). ``hot``: the hot-word list of ``buf`` from a cache, else scanned.
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
        return None
    if tag == TAG_XOR:
        np.bitwise_xor(buf, np.frombuffer(_decompress(body, n * w), buf.dtype), out=buf)
        return None
    if tag == TAG_SPARSE:
        body_u8 = np.frombuffer(body, np.uint8)
        idx, used = decode_positions_ctx(body_u8, buf, hot)
        if used + _SPARSE_LEN.size > len(body):
            raise ValueError("sparse frame truncated")
        (vlen,) = _SPARSE_LEN.unpack_from(body, used)
        used += _SPARSE_LEN.size
        if used + vlen != len(body):
            raise ValueError("sparse frame length mismatch (truncated or trailing bytes)")
        if len(idx) == 0:
            return idx
        planes = np.frombuffer(_decompress(body[used:], len(idx) * w), np.uint8)
        apply_values(buf, idx, planes)
        return idx
    raise ValueError(f"unknown frame tag {tag}")
