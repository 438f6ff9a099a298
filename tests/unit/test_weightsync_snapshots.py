"""Snapshots off the critical path: every version after the first is a delta, committed without
waiting for a snapshot; a snapshot that fails or is cut short commits nothing and damages nothing;
a late joiner reads one snapshot and the deltas after it; GC keeps every replay path.

The stores below are real :class:`FileStore` objects with a gate or a fault on the snapshot's own
objects (``s-*.bin``): the publisher, its snapshot lane and the reader run unchanged."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import pytest
import torch

from infra.storage import FileStore
from infra.weightsync import VersionPublisher, VersionReader, collect
from infra.weightsync.layout import scan_versions, snapshot_key
from tests.weightsync_helpers import Drift, same

PREFIX = "runs/snap/weights"


def _is_snapshot_shard(key: str) -> bool:
    return key.rsplit("/", 1)[-1].startswith("s-")


class GatedStore(FileStore):
    """Snapshot shard uploads wait until ``gate`` is set (a link that is busy for a long time)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.waiting = threading.Event()  # a snapshot upload is blocked on the gate

    def put(self, key: str, data: bytes) -> None:
        if _is_snapshot_shard(key):
            self.waiting.set()
            assert self.gate.wait(60), "the test never opened the gate"
        super().put(key, data)


class FaultyStore(FileStore):
    """The second snapshot shard upload fails; with ``dead_deletes`` deleting snapshot shards fails
    too (a process killed mid-snapshot: nothing cleans up after it)."""

    def __init__(self, root: Path, dead_deletes: bool = False) -> None:
        super().__init__(root)
        self.dead_deletes = dead_deletes
        self.snapshot_puts = 0

    def put(self, key: str, data: bytes) -> None:
        if _is_snapshot_shard(key):
            self.snapshot_puts += 1
            if self.snapshot_puts == 2:
                raise OSError("connection reset during a snapshot upload")
        super().put(key, data)

    def delete(self, key: str) -> None:
        if self.dead_deletes and _is_snapshot_shard(key):
            raise OSError("store unreachable")
        super().delete(key)


class CountingStore(FileStore):
    """Records every ranged read: (key, bytes)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[str, int]] = []

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = super().get_range(key, start, length)
        self.reads.append((key, len(data)))
        return data


def _in_thread(fn: Callable[[], object], timeout: float = 60) -> object:
    """Run ``fn`` on a thread; fail (instead of hanging) if it has not returned within ``timeout``."""
    box: list[object] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "publish waited for the snapshot upload"
    return box[0]


def _versions(d: Drift, n: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for _ in range(n):
        out.append(d.bf16())
        d.step()
    return out


def test_a_delta_publish_does_not_wait_for_a_slow_snapshot(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "s")
    hist = _versions(Drift(), 5)
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10, shard_bytes=16 << 10)
    try:
        assert pub.publish(hist[0]).kind == "keyframe"
        info = pub.publish(hist[1], snapshot=True)
        assert info.kind == "delta" and info.snapshot_started and pub.snapshot_in_flight == 2
        assert store.waiting.wait(30)  # the snapshot of version 2 is stuck in its first upload
        for v in (3, 4, 5):  # each commits while the snapshot is stuck, and changes the publisher's base
            info = _in_thread(lambda v=v: pub.publish(hist[v - 1]))
            assert info.version == v and info.kind == "delta"  # type: ignore[attr-defined]
            got, gv = VersionReader(store, PREFIX).fetch()
            assert gv == v and same(got, hist[v - 1])
        assert not store.exists(snapshot_key(PREFIX, 2))  # not visible before it is complete
        assert VersionReader(store, PREFIX).starts() == [1]
        store.gate.set()
        assert pub.wait_snapshot(timeout=60) == 2
    finally:
        store.gate.set()
        pub.close()
    # the snapshot holds version 2's bits, although the base moved on three times while it waited
    rd = VersionReader(store, PREFIX)
    assert rd.starts() == [1, 2]
    got, gv = rd.fetch(2)
    assert gv == 2 and same(got, hist[1]) and rd.last_stats["path"] == "snapshot 2"
    got, gv = rd.fetch()
    assert gv == 5 and same(got, hist[4]) and rd.last_stats["versions"] == [2, 3, 4, 5]


@pytest.mark.parametrize("killed", [False, True], ids=["failed", "killed"])
def test_a_snapshot_cut_short_commits_nothing_and_damages_no_delta(tmp_path: Path, killed: bool) -> None:
    """A snapshot whose upload fails mid-way (or whose writer dies: nothing deletes its shards)
    leaves no committed snapshot; the deltas around it are intact; its shards are collected (by the
    lane itself, else by the next publisher or GC); the next snapshot succeeds."""
    store = FaultyStore(tmp_path / "s", dead_deletes=killed)
    hist = _versions(Drift(scale=4), 5)
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10, shard_bytes=16 << 10)
    pub.publish(hist[0])
    assert pub.publish(hist[1], snapshot=True).snapshot_started
    assert pub.publish(hist[2]).kind == "delta"  # while the snapshot fails, or after
    with pytest.raises(OSError, match="connection reset"):
        pub.wait_snapshot(timeout=60)
    assert pub.publish(hist[3]).kind == "delta"
    listing = scan_versions(store.list(PREFIX + "/"))
    assert listing.snapshots == set() and listing.committed == [1, 2, 3, 4]
    assert not store.exists(snapshot_key(PREFIX, 2))
    left = [k for k in store.list(PREFIX + "/") if _is_snapshot_shard(k)]
    assert bool(left) == killed and listing.partial == ({2} if killed else set())
    rd = VersionReader(store, PREFIX, strict=True)
    for v in (1, 2, 3, 4):
        got, gv = rd.fetch(v)
        assert gv == v and same(got, hist[v - 1]) and rd.last_stats["versions"][0] == 1
    if killed:  # what a dead writer left is collected: by GC, and by the next publisher on start
        store.dead_deletes = False
        collect(store, PREFIX, keep=100)
        assert not [k for k in store.list(PREFIX + "/") if _is_snapshot_shard(k)]
    assert pub.publish(hist[4], snapshot=True).snapshot_started  # the next snapshot (its 2nd shard is fine)
    assert pub.wait_snapshot(timeout=60) == 5
    pub.close()
    got, gv = VersionReader(store, PREFIX, strict=True).fetch()
    assert gv == 5 and same(got, hist[4])


def test_a_publisher_restarted_after_a_killed_snapshot_removes_its_shards(tmp_path: Path) -> None:
    store = FaultyStore(tmp_path / "s", dead_deletes=True)
    hist = _versions(Drift(scale=4), 3)
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10, shard_bytes=16 << 10)
    pub.publish(hist[0])
    pub.publish(hist[1], snapshot=True)
    with pytest.raises(OSError):
        pub.wait_snapshot(timeout=60)
    pub.close()
    assert scan_versions(store.list(PREFIX + "/")).partial == {2}
    store.dead_deletes = False
    pub2 = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10)
    assert scan_versions(store.list(PREFIX + "/")).partial == set()
    assert pub2.publish(hist[2]).kind == "delta"
    pub2.close()


def test_close_abandons_a_snapshot_in_flight(tmp_path: Path) -> None:
    """``close()`` stops the lane after the upload under way; the snapshot never commits and its
    shards are deleted. (The gate opens from another thread while close waits for that upload.)"""
    store = GatedStore(tmp_path / "s")
    hist = _versions(Drift(scale=4), 2)
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10, shard_bytes=16 << 10)
    pub.publish(hist[0])
    pub.publish(hist[1], snapshot=True)
    assert store.waiting.wait(30)
    threading.Timer(0.2, store.gate.set).start()
    pub.close()
    assert pub.snapshot_in_flight is None
    assert not store.exists(snapshot_key(PREFIX, 2))
    assert not [k for k in store.list(PREFIX + "/") if _is_snapshot_shard(k)]
    assert VersionReader(store, PREFIX).starts() == [1]


def test_late_joiner_at_37_reads_one_snapshot_and_the_deltas_after_it(tmp_path: Path) -> None:
    """45 versions at the shipped cadence; a reader starting at version 37 gets its bits from the
    newest committed snapshot at or below 37 plus the deltas after it, and nothing else."""
    store = CountingStore(tmp_path / "s")
    d = Drift()
    pub = VersionPublisher(store, PREFIX, chunk_bytes=16 << 10)  # snapshot_chain_fraction: the default
    hist = []
    for _ in range(45):
        hist.append(d.bf16())
        pub.publish(hist[-1])
        d.step()
    pub.wait_snapshot(timeout=60)
    pub.close()
    listing = scan_versions(store.list(PREFIX + "/"))
    assert listing.full == {1} and listing.snapshots  # the cadence took snapshots on its own
    start = max(s for s in listing.starts if s <= 37)
    store.reads.clear()
    rd = VersionReader(store, PREFIX)
    got, v = rd.fetch(37)
    assert v == 37 and same(got, hist[36])
    assert rd.last_stats["path"] == (f"snapshot {start}" if start > 1 else "keyframe 1")
    assert rd.last_stats["versions"] == list(range(start, 38))
    read_versions = {int(k.split("/v")[1][:8]) for k, _n in store.reads}
    frames = [(k, n) for k, n in store.reads if k.endswith(".bin")]
    full_reads = {int(k.split("/v")[1][:8]) for k, _n in frames if k.rsplit("/", 1)[1][:2] in ("s-", "k-")}
    assert full_reads == {start}  # one snapshot (or the first version), no other full copy
    assert read_versions <= set(range(start, 38))  # nothing before the start, nothing after 37
    snapshot_bytes = sum(store.size(k) for k in store.list(f"{PREFIX}/v{start:08d}/") if k.endswith(".bin")
                         and k.rsplit("/", 1)[1][:2] in ("s-", "k-"))
    delta_bytes = sum(store.size(k) for v in range(start + 1, 38) for k in store.list(f"{PREFIX}/v{v:08d}/"))
    manifests = store.size(f"{PREFIX}/v{start:08d}/manifest.json.zst")  # (a snapshot is checked against it)
    if start > 1:
        manifests += store.size(snapshot_key(PREFIX, start))
    assert sum(n for _k, n in store.reads) <= snapshot_bytes + delta_bytes + manifests


def test_gc_keeps_every_replay_path(tmp_path: Path) -> None:
    """With ``keep_versions`` the publisher's GC keeps the newest committed snapshot at or below the
    oldest kept version and every delta after it; a snapshot still being written is neither the
    anchor nor deleted."""
    store = GatedStore(tmp_path / "s")
    store.gate.set()
    hist = _versions(Drift(), 10)
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10, shard_bytes=16 << 10,
                           keep_versions=2)
    try:
        for v in range(1, 5):
            pub.publish(hist[v - 1], snapshot=v == 3)
            pub.wait_snapshot(timeout=60)
        # versions 1, 2 are gone: snapshot 3 anchors the kept 3, 4
        assert VersionReader(store, PREFIX).versions() == [3, 4]
        store.gate.clear()
        store.waiting.clear()
        pub.publish(hist[4], snapshot=True)  # snapshot of 5: stuck
        assert store.waiting.wait(30)
        for v in range(6, 9):
            pub.publish(hist[v - 1])
        rd = VersionReader(store, PREFIX)
        assert rd.versions() == list(range(3, 9))  # anchor still 3: snapshot 5 is not committed
        assert scan_versions(store.list(PREFIX + "/")).partial <= {5}
        store.gate.set()
        assert pub.wait_snapshot(timeout=60) == 5
        pub.publish(hist[8])
        pub.publish(hist[9])
    finally:
        store.gate.set()
        pub.close()
    rd = VersionReader(store, PREFIX)
    assert rd.versions() == list(range(5, 11)) and rd.starts() == [5]  # anchor 5: 9, 10 kept with 5..8
    for v in range(5, 11):
        got, gv = VersionReader(store, PREFIX).fetch(v)  # a late joiner at every kept version
        assert gv == v and same(got, hist[v - 1])
    have, hv = rd.fetch(9)
    got, gv = rd.fetch(have=have, have_version=hv)  # and a reader one behind
    assert gv == 10 and same(got, hist[9]) and rd.last_stats["path"] == "have"
