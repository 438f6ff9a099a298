"""Hot-word lists kept across versions (:mod:`infra.weightsync.hotwords`): frames stay byte-identical
to a stateless encode, decoding with a kept list restores every version exactly, the lists equal a
fresh scan after every change, they are reused, and a failed publish drops them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from infra.storage import FileStore
from infra.weightsync import VersionPublisher, VersionReader, codec, hotwords, kernels
from infra.weightsync.chunks import apply_frame, encode_chunk
from tests.weightsync_helpers import same

IMPLS = ["numpy"] + (["numba"] if kernels.HAVE_NUMBA else [])


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    prev = kernels.set_implementation(request.param)
    yield request.param
    kernels.set_implementation(prev)


def _versions(seed: int, n: int = 60_000, count: int = 7) -> list[np.ndarray]:
    """bf16 words of an fp32 "master" tensor after successive small AdamW-like updates. A few
    weights are tiny (they change at every step: the hot class); one step is 30x larger, so the
    encoder's threshold moves beyond the kept lists' headroom and they must be rebuilt."""
    rng = np.random.default_rng(seed)
    master = rng.normal(0, 0.02, n).astype(np.float32)
    tiny = rng.random(n) < 0.004
    master[tiny] *= 1e-4
    out = []
    for step in range(count):
        lr = 3e-5 if step == 4 else 1e-6
        master += (lr * np.sign(rng.normal(size=n))).astype(np.float32)  # Adam-like: ~lr for every weight
        bf16 = torch.from_numpy(master.copy()).to(torch.bfloat16)
        out.append(bf16.view(torch.int16).numpy().view(np.uint16).copy())
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_lists_give_the_stateless_frames_and_decode_exactly(impl: str, seed: int) -> None:
    vs = _versions(seed)
    base, held = vs[0].copy(), vs[0].copy()
    pub, rd = hotwords.HotWords(), hotwords.HotWords()
    split_frames = 0
    for new in vs[1:]:
        stateless, _ = codec.encode_delta(base, new, "sparse")
        res = encode_chunk(base, new, keyframe=False, codec="sparse", update_base=base, hot=pub.chunk("c", base))
        assert res.delta == stateless
        assert np.array_equal(base, new)
        split_frames += res.delta is not None and res.delta[codec._HDR.size] == 1
        apply_frame(res.delta, held, res.digest, rd.chunk("c", held))
        assert np.array_equal(held, new)
        # the kept list is exactly what a fresh scan of the current words gives
        for store, words in ((pub, base), (rd, held)):
            if "c" in store._lists:
                cap, lst = store._lists["c"]
                assert np.array_equal(lst, kernels.hot_words(words, cap))
    assert split_frames >= 3  # the split position code (the one that uses the lists) was exercised
    assert pub.hits >= 2 and pub.scans >= 2  # reused, and rebuilt after the big step
    assert rd.hits >= 2


def test_hot_update_twins_agree() -> None:
    rng = np.random.default_rng(5)
    for trial in range(40):
        dt = [np.uint8, np.uint16, np.uint32][trial % 3]
        n = int(rng.integers(1, 5000))
        words = rng.integers(0, np.iinfo(dt).max, n, dtype=np.uint64).astype(dt)
        cap = int(rng.integers(1, kernels.magnitude_mask(words.itemsize) + 2))
        hot = kernels.hot_words(words, cap)
        idx = np.flatnonzero(rng.random(n) < rng.choice([0.0, 0.01, 0.3, 1.0]))
        words[idx] = rng.integers(0, np.iinfo(dt).max, len(idx), dtype=np.uint64).astype(dt)
        expect = kernels.hot_words(words, cap)
        outs = []
        for name in IMPLS:
            prev = kernels.set_implementation(name)
            try:
                outs.append(kernels.hot_update(hot, idx, words, cap))
            finally:
                kernels.set_implementation(prev)
        for got in outs:
            assert np.array_equal(got, expect)


def _tensors(words: np.ndarray) -> dict[str, torch.Tensor]:
    t = torch.from_numpy(words.view(np.int16).copy()).view(torch.bfloat16)
    return {"w": t.reshape(-1, 100), "b": t[:100].clone()}


def test_publisher_reuses_lists_across_versions_and_after_a_failed_publish(tmp_path: object) -> None:
    vs = _versions(3, n=200_000, count=6)
    store = FileStore(str(tmp_path))
    pub = VersionPublisher(store, "m", snapshot_chain_fraction=100, threads=2, chunk_bytes=64 << 10)
    rd = VersionReader(store, "m", threads=2)
    pub.publish(_tensors(vs[0]))
    have, hv = rd.fetch()
    for new in vs[1:4]:
        pub.publish(_tensors(new))
        have, hv = rd.fetch(have=have, have_version=hv, inplace=True)
        assert same(have, _tensors(new))
    assert pub._hot.hits > 0 and len(pub._hot) > 0
    # a publish that fails midway leaves the base unknown: the lists go with it
    real_put = store.put

    def failing_put(key: str, data: bytes) -> None:
        raise OSError("disk full")

    store.put = failing_put  # type: ignore[method-assign]
    with pytest.raises(OSError):
        pub.publish(_tensors(vs[4]))
    store.put = real_put  # type: ignore[method-assign]
    assert len(pub._hot) == 0
    info = pub.publish(_tensors(vs[4]))  # a keyframe (the base is unknown), then deltas again
    assert info.kind == "keyframe"
    info = pub.publish(_tensors(vs[5]))
    assert info.kind == "delta" and len(pub._hot) > 0
    got, v = rd.fetch()
    assert v == info.version and same(got, _tensors(vs[5]))
