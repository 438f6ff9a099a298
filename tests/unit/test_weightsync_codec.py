"""Codec round-trips: every dtype, edge cases, bit-exactness (NaN payloads included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infra.weightsync.bitpack import decode_positions, encode_positions
from infra.weightsync.codec import changed_positions, decode_into, encode_delta, encode_raw, frame_tag
from infra.weightsync.rawbytes import tensor_words

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int8,
          torch.uint8, torch.int32, torch.int64, torch.bool]


def _pair(dtype: torch.dtype, n: int, frac: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
    old = raw.view(dtype).clone() if dtype != torch.bool else (raw % 2).bool()
    new = old.clone()
    flip = torch.rand(n, generator=g) < frac
    nb = new.view(torch.uint8).view(-1, new.element_size())
    nb[flip, 0] ^= 1  # flip the lowest bit of the chosen elements' first byte
    return old, new


def _roundtrip(old: torch.Tensor, new: torch.Tensor, codec: str) -> str:
    o, n = tensor_words(old), tensor_words(new)
    frame, _ = encode_delta(o, n, codec)  # type: ignore[arg-type]
    buf = o.copy()
    if frame is not None:
        decode_into(frame, buf)
    assert buf.tobytes() == n.tobytes()
    kf = encode_raw(n, 1)
    out = np.zeros_like(n)
    decode_into(kf, out)
    assert out.tobytes() == n.tobytes()
    return "same" if frame is None else frame_tag(frame)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", ["auto", "xor", "sparse"])
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.5, 1.0])
def test_roundtrip_dtypes(dtype: torch.dtype, codec: str, frac: float) -> None:
    old, new = _pair(dtype, 3001, frac)
    _roundtrip(old, new, codec)


@pytest.mark.parametrize("shape", [(0,), (), (1,), (0, 5), (7,)])
def test_edge_shapes(shape: tuple[int, ...]) -> None:
    old = torch.zeros(shape, dtype=torch.bfloat16)
    new = torch.full(shape, 1.5, dtype=torch.bfloat16)
    for codec in ("auto", "xor", "sparse"):
        _roundtrip(old, new, codec)
        _roundtrip(old, old.clone(), codec)


def test_nan_payloads_bit_exact() -> None:
    bits = torch.tensor([0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0x0001, 0x8000], dtype=torch.int32).to(torch.int16)
    old = bits.view(torch.bfloat16)
    new = (bits ^ 0x0003).view(torch.bfloat16)  # different NaN payloads compare "equal" as floats: not here
    assert _roundtrip(old, new, "sparse") == "sparse"


def test_all_and_none_changed() -> None:
    old, new = _pair(torch.bfloat16, 100_000, 1.0)
    tag = _roundtrip(old, new, "auto")
    assert tag in ("raw", "xor", "sparse")
    assert _roundtrip(old, old.clone(), "auto") == "same"


def test_sparse_smaller_than_xor_on_small_updates() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(400_000, generator=g) * 0.05
    old = w.to(torch.bfloat16)
    new = (w + 3e-6 * torch.sign(torch.randn(400_000, generator=g))).to(torch.bfloat16)
    o, n = tensor_words(old), tensor_words(new)
    sparse, _ = encode_delta(o, n, "sparse")
    xor, _ = encode_delta(o, n, "xor")
    assert sparse is not None and xor is not None
    assert len(sparse) < 0.7 * len(xor)


def test_changed_positions_matches_numpy() -> None:
    for dtype in (torch.bfloat16, torch.float32, torch.uint8, torch.float64):
        old, new = _pair(dtype, 70_001, 0.003, seed=3)
        o, n = tensor_words(old), tensor_words(new)
        assert np.array_equal(changed_positions(o, n), np.flatnonzero(o != n))


def test_positions_roundtrip_and_limits() -> None:
    rng = np.random.default_rng(0)
    for n, big in [(0, 10), (1, 1), (9, 9), (2000, 10**6)]:
        idx = np.sort(rng.choice(big, n, replace=False)).astype(np.int64)
        data = encode_positions(idx)
        got, used = decode_positions(memoryview(data), big)
        assert np.array_equal(got, idx) and used == len(data)
    idx = np.array([5, 50], np.int64)
    with pytest.raises(ValueError):
        decode_positions(memoryview(encode_positions(idx)), 10)


def test_truncated_frame_raises() -> None:
    old, new = _pair(torch.bfloat16, 10_000, 0.05)
    o, n = tensor_words(old), tensor_words(new)
    frame, _ = encode_delta(o, n, "sparse")
    assert frame is not None
    for cut in (3, len(frame) // 2, len(frame) - 1):
        with pytest.raises(ValueError):
            decode_into(frame[:cut], o.copy())
    with pytest.raises(ValueError):
        decode_into(frame, o[:-1].copy())  # wrong size


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_sparse_positions_split_by_magnitude_class(dtype: torch.dtype) -> None:
    """Tiny weights (which an update moves many ulps) are coded as their own class, bit-exact."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(200_000, generator=g) * 0.05
    tiny = torch.rand(200_000, generator=g) < 0.01
    w[tiny] = torch.randn(int(tiny.sum()), generator=g) * 1e-4
    upd = 2e-6 * torch.sign(torch.randn(200_000, generator=g)) if dtype != torch.float32 else 2e-9 * torch.sign(
        torch.randn(200_000, generator=g))
    old, new = w.to(dtype), (w + upd).to(dtype)
    o, n = tensor_words(old), tensor_words(new)
    frame, _ = encode_delta(o, n, "sparse")
    assert frame is not None
    assert frame[10] == 1  # header (10 bytes), then position mode 1 = split by class
    buf = o.copy()
    decode_into(frame, buf)
    assert buf.tobytes() == n.tobytes()
