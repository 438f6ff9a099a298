"""The numba kernels and their numpy twins write and read the same sparse frames, byte for byte."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from infra.weightsync import codec, kernels
from infra.weightsync.sparse_format import magnitude_mask
from tests.weightsync_helpers import word_pair as _case

needs_numba = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed")


@pytest.fixture
def restore_impl() -> Iterator[None]:
    prev = kernels.implementation()
    yield
    kernels.set_implementation(prev)


def _frame(impl: str, old: np.ndarray, new: np.ndarray) -> bytes | None:
    kernels.set_implementation(impl)
    return codec.encode_delta(old, new, "sparse")[0]


def _decode(impl: str, frame: bytes, old: np.ndarray) -> tuple[str, bytes]:
    kernels.set_implementation(impl)
    buf = old.copy()
    try:
        codec.decode_into(frame, buf)
    except ValueError:
        return "error", b""
    return "ok", buf.tobytes()


@needs_numba
def test_twins_write_identical_frames_and_decode_them(restore_impl: None) -> None:
    rng = np.random.default_rng(7)
    split = 0
    for trial in range(240):
        old, new = _case(rng, trial)
        a, b = _frame("numpy", old, new), _frame("numba", old, new)
        assert a == b, f"trial {trial}: frames differ"
        if a is None:
            continue
        split += a[codec._HDR.size] == 1
        for impl in ("numpy", "numba"):
            assert _decode(impl, a, old) == ("ok", new.tobytes()), (trial, impl)
    assert split > 10  # the magnitude-split position code was exercised


@needs_numba
def test_twins_agree_on_corrupt_and_truncated_frames(restore_impl: None) -> None:
    rng = np.random.default_rng(11)
    for trial in range(120):
        old, new = _case(rng, trial)
        frame = _frame("numpy", old, new)
        if frame is None:
            continue
        for _ in range(4):
            bad = bytearray(frame)
            j = int(rng.integers(codec._HDR.size, len(bad)))
            bad[j] ^= 1 << int(rng.integers(0, 8))
            assert _decode("numpy", bytes(bad), old) == _decode("numba", bytes(bad), old), trial
            assert _decode("numpy", frame[:j], old)[0] == "error"
            assert _decode("numba", frame[:j], old)[0] == "error"


@needs_numba
def test_changed_positions_twins(restore_impl: None) -> None:
    rng = np.random.default_rng(3)
    for trial in range(60):
        old, new = _case(rng, trial)
        got = {}
        for impl in ("numpy", "numba"):
            kernels.set_implementation(impl)
            got[impl] = codec.changed_positions(old, new)
        assert np.array_equal(got["numpy"], got["numba"])
        assert np.array_equal(got["numba"], np.flatnonzero(old != new))


@needs_numba
def test_changed64_stores_every_changed_lane_or_reports_a_short_buffer() -> None:
    """The SWAR change scan (store-always per lane) at every packed width and density, lengths
    with a tail after the last 4-word group; a buffer without its ``4 * per`` slack is refused
    (-1), never overrun."""
    from infra.weightsync import numba_kernels

    rng = np.random.default_rng(5)
    for dt in (np.uint8, np.uint16, np.uint32):
        w = np.dtype(dt).itemsize
        per = 8 // w
        high = kernels._HIGH[w]
        for words64 in (1, 3, 4, 37, 1001):
            n = words64 * per
            for density in (0.0, 0.003, 0.045, 0.5, 1.0):
                old = rng.integers(0, 1 << (8 * w), n, dtype=np.uint64).astype(dt)
                new = old.copy()
                hit = rng.random(n) < density
                new[hit] ^= dt(1 << int(rng.integers(0, 8 * w)))
                want = np.flatnonzero(old != new)
                out = np.full(n + 8, -7, np.int64)
                k = numba_kernels.changed64(old.view(np.uint64), new.view(np.uint64), per, high, out)
                assert k == len(want) and np.array_equal(out[:k], want), (dt, n, density)
                room = np.full(len(want) + 1 + 64, -7, np.int64)  # a view of the first part: the rest guards
                k = numba_kernels.changed64(old.view(np.uint64), new.view(np.uint64), per, high,
                                            room[: len(want) + 1])
                assert k in (-1, len(want)) and (room[len(want) + 1 :] == -7).all()
                if k >= 0:
                    assert np.array_equal(room[:k], want)


@needs_numba
def test_rice_parameter_matches_the_reference_rule() -> None:
    """The numba Rice parameter (gaps summed by telescoping, five candidates in one pass) is the
    reference's (``bitpack._best``) for sparse, dense and huge gaps, one position, position 0."""
    from infra.weightsync import bitpack, numba_kernels

    rng = np.random.default_rng(9)
    cases = [np.array([0]), np.array([5]), np.array([(1 << 50) + 3]), np.arange(1000), np.arange(0, 10**6, 7)]
    for span, m in [(100, 50), (10**6, 45_000), (10**6, 300), (1 << 40, 20), (1 << 61, 5)]:
        cases.append(np.unique(rng.integers(0, span, m)))
    for pos in cases:
        pos = pos.astype(np.int64)
        gaps = np.diff(pos, prepend=-1) - 1
        k, bits = bitpack._best(gaps)
        assert numba_kernels._rice_k(pos) == (k, len(pos) + int((gaps >> k).sum())), pos[:5]


def test_set_implementation_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="known: numba, numpy"):
        kernels.set_implementation("cython")


@pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed")
def test_hot_words_kernel_matches_the_definition() -> None:
    """The SWAR magnitude-class scan lists exactly the words with ``(w & mask) < thr``: every word
    width, lengths not a multiple of 8 bytes, thresholds 0, inside, at and above the mask."""
    from infra.weightsync import numba_kernels

    rng = np.random.default_rng(5)
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        mm = magnitude_mask(np.dtype(dt).itemsize)
        for n in (0, 1, 3, 15, 255, 256, 257, 1000, 70001):
            buf = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
            buf[: n // 3] &= dt(mm >> 4)  # a clustered run of small magnitudes
            for thr in (0, 1, mm // 1000, mm // 3, mm, mm + 1, mm + 5, 2**64 - 1):
                got = numba_kernels.hot_words(buf, np.uint64(mm), np.uint64(thr))
                want = np.flatnonzero((buf.astype(np.uint64) & np.uint64(mm)) < np.uint64(thr))
                assert np.array_equal(got, want), (dt, n, thr)
                if n > 8:  # an unaligned view (offset by one word) too
                    got = numba_kernels.hot_words(buf[1:], np.uint64(mm), np.uint64(thr))
                    want = np.flatnonzero((buf[1:].astype(np.uint64) & np.uint64(mm)) < np.uint64(thr))
                    assert np.array_equal(got, want), (dt, n, thr, "unaligned")
