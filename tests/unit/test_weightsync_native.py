"""The one-call native decode (positions, zstd, scatter, xxh3 in one nogil kernel) gives exactly what
the step-by-step decode gives: the same words, the same digest, the same rejections."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from infra.weightsync import codec, kernels, native
from infra.weightsync.errors import CorruptData
from infra.weightsync.layout import digest
from tests.weightsync_helpers import word_pair as _case

needs_native = pytest.mark.skipif(not (kernels.HAVE_NUMBA and native.AVAILABLE),
                                  reason="numba or the native xxh3/zstd symbols are not available")


@needs_native
def test_native_xxh3_matches_xxhash_for_every_length_path() -> None:
    import numba

    @numba.njit
    def h(a: np.ndarray) -> tuple[int, int]:
        return native.xxh3_128(a.ctypes.data, np.uint64(a.nbytes))

    rng = np.random.default_rng(1)
    for n in [*range(0, 260), 1023, 1024, 1025, 4096, 65536 + 3, (1 << 20) + 17]:
        a = rng.integers(0, 256, n, dtype=np.uint8)
        lo, hi = h(a)
        assert f"{int(hi):016x}{int(lo):016x}" == xxhash.xxh3_128_hexdigest(a), n


@needs_native
def test_fused_decode_equals_step_by_step_decode() -> None:
    rng = np.random.default_rng(5)
    fused = 0
    for trial in range(200):
        old, new = _case(rng, trial)
        frame = codec.encode_delta(old, new, "sparse")[0]
        if frame is None:
            continue
        buf = old.copy()
        got = codec.decode_digest(frame, buf)
        assert got is not None
        fused += 1
        assert np.array_equal(buf, new), trial
        assert got == digest(new), trial
        ro = old.copy()  # read-only frame bytes and a second call on fresh words give the same
        assert codec.decode_digest(bytes(frame), ro) == got
    assert fused > 150


@needs_native
def test_fused_decode_accepts_exactly_the_frames_that_give_the_right_words() -> None:
    """Corrupt and truncated frames: the fused decode raises ValueError before touching the words,
    or (zstd versions differ in which damage they detect) returns a digest that is not the expected
    one; a frame is accepted (digest == expected) exactly when the words are right, as in the
    step-by-step decode. Errors in the frame header and position stream are the same ones."""
    from infra.weightsync.chunks import apply_frame

    rng = np.random.default_rng(9)
    for trial in range(120):
        old, new = _case(rng, trial)
        frame = codec.encode_delta(old, new, "sparse")[0]
        if frame is None:
            continue
        want = digest(new)
        bads = [frame[: int(rng.integers(codec._HDR.size + 1, len(frame)))], frame + b"\0"]
        for _ in range(3):
            bad = bytearray(frame)
            j = int(rng.integers(codec._HDR.size, len(bad)))
            bad[j] ^= 1 << int(rng.integers(0, 8))
            bads.append(bytes(bad))
        for bad in bads:
            one = old.copy()
            try:
                got = codec.decode_digest(bad, one)
            except ValueError:
                assert np.array_equal(one, old), "a rejected frame must not touch the words"
                got = None
            if got is not None:
                assert (got == want) == np.array_equal(one, new), trial
            buf = old.copy()
            try:
                apply_frame(bad, buf, want)
                accepted = True
            except CorruptData:  # (ChecksumMismatch is one; a malformed frame is one too)
                accepted = False
            if accepted:  # never the wrong words
                assert np.array_equal(buf, new), trial


def test_fused_decode_declines_other_frames() -> None:
    rng = np.random.default_rng(2)
    old = rng.integers(0, 1 << 16, 5000, dtype=np.uint64).astype(np.uint16)
    new = old ^ np.uint16(1)
    for frame in (codec.encode_xor(old, new, 1), codec.encode_raw(new, 1), b"\x03"):
        buf = old.copy()
        assert codec.decode_digest(frame, buf) is None
        assert np.array_equal(buf, old)
    sparse = codec.encode_delta(old, old + np.uint16(1) * (np.arange(5000) % 50 == 0), "sparse")[0]
    assert sparse is not None
    assert codec.decode_digest(sparse, old[:-1].copy()) is None  # header does not fit the buffer


@needs_native
@pytest.mark.parametrize("codec_name", ["auto", "sparse"])
def test_fused_encode_equals_step_by_step_encode_across_versions(codec_name: str) -> None:
    """The publisher's one-call encode writes the same frames and digests and leaves the same base
    and hot lists as the step-by-step encode, version after version, dense chunks included."""
    import infra.weightsync.chunks as chunks
    from infra.weightsync.hotwords import HotWords

    rng = np.random.default_rng(13)
    used_lists = 0
    for trial in range(60):
        old, _ = _case(rng, trial)
        versions = [old]
        for _ in range(4):
            cur = versions[-1].copy()
            moved = rng.random(len(cur)) < rng.choice([0.002, 0.02, 0.4])  # 0.4: dense chunks
            cur[moved] += rng.integers(1, 9, len(cur)).astype(cur.dtype)[moved]
            versions.append(cur)
        fused_base, step_base = old.copy(), old.copy()
        fused_hot, step_hot = HotWords(), HotWords()
        real = chunks._encode_native
        for v in versions[1:]:
            a = chunks.encode_chunk(fused_base, v, keyframe=False, codec=codec_name, update_base=fused_base,
                                    hot=fused_hot.chunk(0, fused_base))
            chunks._encode_native = lambda *args, **kw: None  # the step-by-step path
            try:
                b = chunks.encode_chunk(step_base, v, keyframe=False, codec=codec_name, update_base=step_base,
                                        hot=step_hot.chunk(0, step_base))
            finally:
                chunks._encode_native = real
            assert a == b, trial
            assert a.digest == digest(v)
            assert np.array_equal(fused_base, v) and np.array_equal(step_base, v)
            fa, fb = fused_hot._lists.get(0), step_hot._lists.get(0)
            assert (fa is None) == (fb is None)
            if fa is not None and fb is not None:
                assert fa[0] == fb[0] and np.array_equal(fa[1], fb[1])
        assert (fused_hot.hits, fused_hot.scans) == (step_hot.hits, step_hot.scans)
        used_lists += fused_hot.hits + fused_hot.scans
    assert used_lists > 20  # the split position code, with kept and rebuilt hot lists, was exercised


@needs_native
def test_fused_encode_of_an_unchanged_chunk_touches_nothing() -> None:
    from infra.weightsync.chunks import encode_chunk
    from infra.weightsync.hotwords import HotWords

    rng = np.random.default_rng(4)
    base = rng.integers(0, 1 << 16, 9000, dtype=np.uint64).astype(np.uint16)
    lists = HotWords()
    res = encode_chunk(base, base.copy(), keyframe=False, prev_digest="p" * 32, update_base=base,
                       hot=lists.chunk(0, base))
    assert res.delta is None and res.changed == 0 and res.digest == "p" * 32 and len(lists) == 0
