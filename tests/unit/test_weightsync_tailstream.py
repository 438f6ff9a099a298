"""The delta frames a manifest object carries, read as they arrive (``infra/weightsync/tailstream.py``):
the reader has the manifest once its JSON is in, the fetch waits for (and decodes) the frames as
their bytes come, and a stream that fails is read again by the next fetch."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from infra.storage import FileStore, StorageError
from infra.weightsync import CorruptData, VersionPublisher, VersionReader
from infra.weightsync.layout import MANIFEST
from infra.weightsync.tailstream import StreamedTail
from tests.weightsync_helpers import Drift, same

PREFIX = "w"


class SlowTailStore(FileStore):
    """Manifest objects that carry frames arrive in two pieces: the bytes up to ``split`` before the end, then the
    rest once ``gate`` is set (or, with ``fail``, a storage error instead)."""

    def __init__(self, root: Path, split: int) -> None:
        super().__init__(root)
        self.split = split
        self.gate = threading.Event()
        self.fail = False

    def iter_range(self, key: str, start: int, length: int) -> Iterator[bytes]:
        data = self.get_range(key, start, length)
        if not key.endswith(MANIFEST) or data[:4] != b"DLM2" or len(data) <= self.split:  # no frames carried
            yield data
            return
        yield data[: -self.split]
        if self.fail:
            raise StorageError(f"{key}: connection reset")
        assert self.gate.wait(30), "the test never let the rest arrive"
        yield data[-self.split :]


def _publish(root: Path, n: int) -> list[dict[str, torch.Tensor]]:
    """Versions 1..n; the deltas ride whole in their manifest objects (one large delta shard)."""
    d, out = Drift(seed=2), []
    pub = VersionPublisher(FileStore(root), PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10,
                           delta_shard_bytes=4 << 20)
    for _ in range(n):
        out.append(d.bf16())
        pub.publish(out[-1])
        d.step()
    pub.close()
    return out


def test_the_manifest_comes_before_its_frames_and_the_fetch_waits_for_them(tmp_path: Path) -> None:
    versions = _publish(tmp_path, 2)
    store = SlowTailStore(tmp_path, split=200)
    rd = VersionReader(store, PREFIX, strict=True)
    have, hv = rd.fetch(1)
    man = rd.manifest(2)  # returns although the last 200 bytes are held back
    assert isinstance(man.tail, StreamedTail) and not man.tail.complete and len(man.tail) > 200
    result: list[object] = []
    fetch = threading.Thread(target=lambda: result.append(rd.fetch(None, have, hv)))
    fetch.start()
    fetch.join(0.5)
    assert fetch.is_alive() and not result  # waiting for the frames still on their way
    store.gate.set()
    fetch.join(30)
    got, v = result[0]  # type: ignore[misc]
    assert v == 2 and same(got, versions[1]) and man.tail.complete
    assert rd.last_stats["path"] == "have"


def test_a_stream_that_fails_is_read_again_by_the_next_fetch(tmp_path: Path) -> None:
    versions = _publish(tmp_path, 2)
    store = SlowTailStore(tmp_path, split=200)
    store.fail = True
    rd = VersionReader(store, PREFIX, strict=True)
    have, hv = rd.fetch(1)
    with pytest.raises(StorageError, match="connection reset"):
        rd.fetch(None, have, hv)
    store.fail = False
    store.gate.set()
    got, v = rd.fetch(None, have, hv)  # not the cached manifest with its failed stream
    assert v == 2 and same(got, versions[1])


def _gated(pieces: list[bytes], go: list[threading.Event]) -> Iterator[bytes]:
    """``pieces``, each once its event is set."""
    for piece, ev in zip(pieces, go):
        assert ev.wait(30)
        yield piece


def test_wait_hears_of_each_part_before_the_last() -> None:
    data = bytes(range(100))
    tail = StreamedTail(100, "k", 7)
    go = [threading.Event() for _ in range(3)]
    with ThreadPoolExecutor(1) as pool:
        pool.submit(tail.feed, _gated([data[:30], data[30:60], data[60:]], go))
        seen: list[tuple[int, bytes]] = []

        def arrived(n: int, buf: memoryview) -> None:
            seen.append((n, bytes(buf[:n])))
            if len(seen) < len(go):
                go[len(seen)].set()

        go[0].set()
        part = tail.wait(20, 70, arrived)  # bytes 20..89: 10 in after the first piece, 40 after the second
    assert bytes(part) == data[20:90]
    assert seen == [(10, data[20:30]), (40, data[20:60])]
    assert tail.complete and not tail.failed and tail[95:] == data[95:]


@pytest.mark.parametrize("pieces, match", [([b"x" * 60], "truncated"), ([b"x" * 60, b"y" * 50], "more than")])
def test_a_stream_of_the_wrong_length_is_corrupt_data_of_the_manifest(pieces: list[bytes], match: str) -> None:
    tail = StreamedTail(100, "w/v00000007/manifest.json.zst", 7)
    tail.feed(iter(pieces))
    assert tail.complete and tail.failed
    with pytest.raises(CorruptData, match=match) as err:
        tail.wait(0, 100, None)
    assert (err.value.version, err.value.key) == (7, "w/v00000007/manifest.json.zst")
    with pytest.raises(CorruptData, match="a frame ends at 101"):
        tail.wait(0, 101, None)
