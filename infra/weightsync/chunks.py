"""Per-chunk work shared by the publisher, the reader and the benchmark.

``encode_chunk`` is everything the publisher does for one chunk (frames and their digests, the
chunk digest, base update); ``apply_frame`` is everything the reader does for one frame (check the
frame digest, decode in place, verify the chunk digest). The benchmark times exactly these, so its
GB/s are the production path's. ``apply_frame`` raises only :class:`CorruptData`: a frame comes
from the store, and whatever is wrong with it is corrupt data to the reader, never another error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infra.weightsync.codec import (
    DENSE_FRACTION,
    CodecName,
    decode_digest,
    decode_into,
    encode_delta,
    encode_raw,
    sparse_frame,
)
from infra.weightsync.errors import CorruptData
from infra.weightsync.hotwords import MARGIN, ChunkHot
from infra.weightsync.kernels import encode_sparse_update
from infra.weightsync.layout import digest


@dataclass
class EncodedChunk:
    """What :func:`encode_chunk` produced for one chunk."""

    key: bytes | None  # keyframe frame (keyframe versions only)
    delta: bytes | None  # delta frame; None when the chunk did not change (or no base)
    digest: str  # xxh3-128 of the new words
    changed: int  # words that differ from the base (all of them without a base)
    key_h: str | None = None  # xxh3-128 of the keyframe frame's bytes
    delta_h: str | None = None  # xxh3-128 of the delta frame's bytes

    def __post_init__(self) -> None:
        if self.key is not None and self.key_h is None:
            self.key_h = digest(self.key)
        if self.delta is not None and self.delta_h is None:
            self.delta_h = digest(self.delta)


def encode_chunk(
    old: np.ndarray | None,
    new: np.ndarray,
    *,
    keyframe: bool,
    codec: CodecName = "auto",
    level: int = 1,
    prev_digest: str | None = None,
    update_base: np.ndarray | None = None,
    hot: ChunkHot | None = None,
) -> EncodedChunk:
    """Encode one chunk. ``old`` is the base words (None: keyframe only).

    ``update_base``: a buffer (normally ``old`` itself) made equal to ``new`` afterwards, touching
    only the changed words when the sparse codec found them. ``hot``: the hot-word list of
    ``update_base`` (kept up to date here); only with ``update_base``.
    """
    if hot is not None and update_base is None:
        raise ValueError("a hot-word cache needs update_base (the words it describes)")
    kf = encode_raw(new, level) if keyframe else None
    if old is None:
        if update_base is not None:
            np.copyto(update_base, new)
            if hot is not None:
                hot.changed(None)
        return EncodedChunk(kf, None, digest(new), len(new))
    if hot is not None and old is update_base and codec != "xor":  # the publisher's case
        native = _encode_native(old, new, codec, level, prev_digest, hot)
        if native is not None:
            return EncodedChunk(kf, *native)
    frame, idx = encode_delta(old, new, codec, level, hot if old is update_base else None)
    if frame is None:
        return EncodedChunk(kf, None, prev_digest if prev_digest is not None else digest(new), 0)
    changed = len(idx) if idx is not None else int(np.count_nonzero(old != new))
    h = digest(new)
    if update_base is not None:
        if idx is not None:
            update_base[idx] = new[idx]
        else:
            np.copyto(update_base, new)
        if hot is not None:
            hot.changed(idx if old is update_base else None)
    return EncodedChunk(kf, frame, h, changed)


def _encode_native(old: np.ndarray, new: np.ndarray, codec: CodecName, level: int, prev_digest: str | None,
                   hot: ChunkHot) -> tuple[bytes | None, str, int] | None:
    """``(delta frame, digest, changed)`` from one native call that also updates ``old`` (the
    base) and its hot list (:func:`~infra.weightsync.kernels.encode_sparse_update`); the same
    frame and state as the step-by-step path. None when that call is not available or the chunk
    is dense (then the caller compares codecs step by step; nothing was touched)."""
    dense_max = len(new) if codec == "sparse" else int(DENSE_FRACTION * len(new))
    got = encode_sparse_update(old, new, hot.entry(), MARGIN, dense_max)
    if got is None or got[0] == 2:
        return None
    status, changed, planes, positions, kept, looked, h = got
    if status == 0:
        return None, prev_digest if prev_digest is not None else digest(new), 0
    hot.replace(kept, looked)
    return sparse_frame(planes, positions, new.dtype.itemsize, len(new), changed, level), h, changed


class ChecksumMismatch(CorruptData, ValueError):
    """The decoded chunk does not hash to the digest its manifest recorded."""


def apply_frame(frame: bytes | memoryview, buf: np.ndarray, expect: str, hot: ChunkHot | None = None, *,
                frame_h: str | None = None) -> None:
    """Decode ``frame`` into ``buf`` (holding the base words) in place and verify the digest.

    ``frame_h``: the frame's own digest from the manifest, checked before the frame is decoded
    (``buf`` is then untouched on a mismatch). ``hot``: the hot-word list of ``buf``; updated to the
    decoded words when the digest matches. (On a mismatch the caller must drop its hot lists:
    ``buf`` is no longer a known version.) Raises :class:`CorruptData` for any fault of the frame:
    the decoders' errors for a truncated or malformed frame, a frame digest or checksum mismatch."""
    if frame_h is not None and digest(frame) != frame_h:
        raise CorruptData("frame digest mismatch (the frame's bytes are not the ones its manifest names)")
    try:
        if hot is None:  # the reader's case: one native call for decode + digest when possible
            got = decode_digest(frame, buf)
            if got is not None:
                if got != expect:
                    raise ChecksumMismatch("checksum mismatch after decoding")
                return
        idx = decode_into(frame, buf, hot)
    except ValueError as exc:  # the decoders' one error type for a malformed frame (numba raises it too)
        if isinstance(exc, CorruptData):
            raise
        raise CorruptData(f"malformed frame: {exc}") from None
    if digest(buf) != expect:
        raise ChecksumMismatch("checksum mismatch after decoding")
    if hot is not None:
        hot.changed(idx)
