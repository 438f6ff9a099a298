"""Ranges that stream in pieces: frames are decoded as they complete, and a short or broken
stream still fails the fetch with an error naming the version, never a partial version."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from infra.storage import FileStore
from infra.weightsync import VersionPublisher, VersionReader
from infra.weightsync.errors import WeightSyncError
from infra.weightsync.testing import Drift, same


class PieceStore(FileStore):
    """A store whose ranged reads arrive in small pieces (like a slow link), counting them."""

    def __init__(self, root: str, piece: int, cut: int | None = None) -> None:
        super().__init__(root)
        self.piece, self.cut, self.pieces = piece, cut, 0

    def iter_range(self, key: str, start: int, length: int, piece: int = 1 << 16) -> Iterator[bytes]:
        sent = 0
        for data in super().iter_range(key, start, length, self.piece):
            if self.cut is not None and sent + len(data) > self.cut:  # the connection drops
                yield data[: self.cut - sent]
                return
            sent += len(data)
            self.pieces += 1
            yield data


def _versions(root: Path, n: int, **pub) -> list[dict]:
    drift = Drift(seed=3, scale=8)
    pubr = VersionPublisher(FileStore(str(root)), "w", keyframe_every=100, delta_shard_bytes=4096, **pub)
    out = []
    for _ in range(n):
        drift.step(3e-5)
        v = drift.bf16()
        pubr.publish(v)
        out.append(v)
    return out


@pytest.mark.parametrize("piece", [97, 1000, 1 << 16])
def test_fetch_through_small_pieces_is_bit_exact(tmp_path: Path, piece: int) -> None:
    versions = _versions(tmp_path, 4)
    store = PieceStore(str(tmp_path), piece)
    rd = VersionReader(store, "w")
    have, hv = rd.fetch(1)  # the keyframe: its ranges stream too
    assert same(have, versions[0])
    for want in (2, 3, 4):
        have, hv = rd.fetch(want, have=have, have_version=hv, inplace=True)
        assert hv == want and same(have, versions[want - 1])
    assert store.pieces > 0
    got, v = VersionReader(store, "w").fetch()  # cold: keyframe + folded deltas
    assert v == 4 and same(got, versions[3])


def test_a_stream_cut_short_fails_the_path_and_names_the_version(tmp_path: Path) -> None:
    versions = _versions(tmp_path, 3)
    good = VersionReader(FileStore(str(tmp_path)), "w")
    base, bv = good.fetch(2)
    cut = PieceStore(str(tmp_path), 500, cut=700)
    strict = VersionReader(cut, "w", strict=True)
    with pytest.raises(WeightSyncError) as err:
        strict.fetch(have=base, have_version=bv)
    assert err.value.version is not None and "truncated" in str(err.value)
    # not strict: the reader falls back (here every range is cut, so no path works) and says why
    loose = VersionReader(cut, "w")
    with pytest.raises(WeightSyncError):
        loose.fetch(have={k: t.clone() for k, t in base.items()}, have_version=bv)
    assert loose.last_errors
    assert same(VersionReader(FileStore(str(tmp_path)), "w").fetch()[0], versions[2])
