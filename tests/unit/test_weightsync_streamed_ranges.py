"""Ranges decoded while they download: the reader hands a range's frames to the decoders as the
store delivers its bytes (``ObjectStore.iter_range``), and a store that delivers too much, too
little or nothing is refused as before."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from infra.storage import FileStore
from infra.weightsync import CorruptData, MissingObject, VersionPublisher, VersionReader
from infra.weightsync.layout import MANIFEST
from infra.weightsync.schedule import Arrived, DecodePipeline, Range
from tests.weightsync_helpers import Drift, same

PREFIX = "w"


class PieceStore(FileStore):
    """A store whose ranged reads arrive in ``piece``-byte pieces, as over a network; ``extra``
    bytes are appended to (negative: cut from) every range of a shard, as a faulty server would
    (manifest objects cut or lengthened: tests/unit/test_weightsync_faults.py)."""

    def __init__(self, root: Path, piece: int, extra: int = 0) -> None:
        super().__init__(root)
        self.piece, self.extra = piece, extra
        self.pieces = 0

    def iter_range(self, key: str, start: int, length: int) -> Iterator[bytes]:
        data = self.get_range(key, start, length)
        if not key.endswith(MANIFEST):
            data = data + b"\0" * self.extra if self.extra >= 0 else data[: self.extra]
        for i in range(0, len(data), self.piece):
            self.pieces += 1
            yield data[i : i + self.piece]


def _versions(n: int) -> list[dict[str, torch.Tensor]]:
    d = Drift(seed=4, scale=4)
    out = []
    for _ in range(n):
        out.append(d.bf16())
        d.step(lr=2e-4)  # dense deltas: frames of several KiB, ranges of many frames
    return out


def _publish(store: FileStore, versions: list[dict[str, torch.Tensor]]) -> None:
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10,
                           delta_shard_bytes=8 << 10)
    for t in versions:
        pub.publish(t)
    pub.close()


@pytest.mark.parametrize("piece", [7, 1000, 1 << 20])
def test_fetches_through_pieces_are_bit_exact(tmp_path: Path, piece: int) -> None:
    versions = _versions(5)
    _publish(FileStore(tmp_path), versions)
    store = PieceStore(tmp_path, piece)
    rd = VersionReader(store, PREFIX)
    have, hv = rd.fetch(2)  # the full version, then a chain of deltas in one replay
    assert hv == 2 and same(have, versions[1])
    have, hv = rd.fetch(None, have, hv, inplace=True)  # the rest, patched in place
    assert hv == 5 and same(have, versions[4])
    assert store.pieces > 0


@pytest.mark.parametrize("extra, match", [(3, "more than"), (-1, "truncated")])
def test_a_range_of_the_wrong_length_is_corrupt(tmp_path: Path, extra: int, match: str) -> None:
    versions = _versions(3)
    _publish(FileStore(tmp_path), versions)
    for piece in (5, 1 << 20):
        rd = VersionReader(PieceStore(tmp_path, piece, extra), PREFIX, strict=True)
        with pytest.raises(CorruptData, match=match):
            rd.fetch(3)


def test_a_shard_gone_is_a_missing_object(tmp_path: Path) -> None:
    versions = _versions(3)
    _publish(FileStore(tmp_path), versions)
    shard = next(p for p in (tmp_path / PREFIX / "v00000003").iterdir() if p.name.startswith("d-"))
    shard.unlink()
    with pytest.raises(MissingObject):
        VersionReader(PieceStore(tmp_path, 100), PREFIX, strict=True).fetch(3)


def test_frames_decode_before_their_range_has_finished_downloading() -> None:
    """A range of 8 frames delivered in 4 parts: the pipeline decodes the frames of the first
    parts while the download still waits for the last (it would hang here if decoding waited
    for the whole range)."""
    frames = [(0, i, 10 * i, 10) for i in range(8)]
    r = Range(0, "k", 0, 80, frames=frames)
    decoded: list[int] = []
    seen_early = threading.Event()

    def download(rng: Range, arrived: Arrived) -> bytes:
        buf = memoryview(bytearray(rng.length))
        for got in (20, 40, 60):
            buf[got - 20 : got] = bytes(range(got - 20, got))
            arrived(got, buf)
        assert seen_early.wait(10), "no frame was decoded before the range's last bytes came"
        buf[60:80] = bytes(range(60, 80))
        return buf

    def decode(step: int, ti: int, ci: int, frame: memoryview) -> None:
        assert bytes(frame) == bytes(range(10 * ci, 10 * ci + 10))
        decoded.append(ci)
        if len(decoded) >= 6:
            seen_early.set()

    with ThreadPoolExecutor(2) as io, ThreadPoolExecutor(2) as cpu:
        t0 = time.monotonic()
        DecodePipeline([r], 1, download, decode, io, cpu, io_threads=2, threads=2, budget_bytes=1 << 20).run()
    assert sorted(decoded) == list(range(8)) and time.monotonic() - t0 < 10


def test_a_download_that_fails_after_parts_arrived_raises_and_settles() -> None:
    r = Range(0, "k", 0, 40, frames=[(0, i, 10 * i, 10) for i in range(4)])
    decoded: list[int] = []

    def download(rng: Range, arrived: Arrived) -> bytes:
        buf = memoryview(bytearray(rng.length))
        arrived(20, buf)
        raise MissingObject("gone", version=1, key="k")

    with ThreadPoolExecutor(2) as io, ThreadPoolExecutor(2) as cpu:
        with pytest.raises(MissingObject, match="gone"):
            DecodePipeline([r], 1, download, lambda s, t, c, f: decoded.append(c), io, cpu, io_threads=2,
                           threads=2, budget_bytes=1 << 20).run()
    assert set(decoded) <= {0, 1}
