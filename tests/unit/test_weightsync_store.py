"""Version store over file://: deltas and snapshots, replay, folding, resume, GC, concurrency."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from infra.storage import FileStore
from infra.weightsync import VersionPublisher, VersionReader, collect
from infra.weightsync.layout import scan_versions
from tests.weightsync_helpers import Drift, same

PREFIX = "runs/t/weights"


@pytest.fixture()
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


def _publish(store: FileStore, n: int, k: int = 3, **kw) -> tuple[VersionPublisher, list[dict[str, torch.Tensor]]]:
    """Versions 1..n, with a snapshot of versions 1+k, 1+2k... each waited for (a test's fixed
    cadence; the publisher's own is off)."""
    d = Drift()
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10,
                           shard_bytes=64 << 10, **kw)
    history = []
    for v in range(1, n + 1):
        t = d.bf16()
        history.append(t)
        if pub.publish(t, snapshot=v > 1 and (v - 1) % k == 0).snapshot_started:
            pub.wait_snapshot()
        d.step()
    return pub, history


def test_every_version_after_the_first_is_a_delta(store: FileStore) -> None:
    d = Drift()
    pub = VersionPublisher(store, PREFIX, chunk_bytes=16 << 10)  # the shipped cadence
    kinds = []
    for _ in range(12):
        info = pub.publish(d.bf16())
        kinds.append(info.kind)
        assert info.raw_bytes > 0 and info.bytes_written > 0
        pub.wait_snapshot()
        d.step()
    assert kinds == ["keyframe"] + ["delta"] * 11
    listing = scan_versions(store.list(PREFIX + "/"))
    assert listing.committed == list(range(1, 13)) and listing.full == {1}
    assert listing.snapshots and not listing.partial  # the chain outgrew half a snapshot: some were taken
    assert not store.list(f"{PREFIX}/v00000002/keyframe")


def test_snapshot_cadence_follows_the_chain_bytes(store: FileStore) -> None:
    """A snapshot starts once the deltas since the last start exceed the fraction of a snapshot."""
    d = Drift()
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=0.5, chunk_bytes=16 << 10)
    first = pub.publish(d.bf16())
    chain, started = 0, []
    for _ in range(40):
        d.step()
        info = pub.publish(d.bf16())
        chain += info.bytes_written
        assert info.snapshot_started == (chain > 0.5 * first.bytes_written)
        if info.snapshot_started:
            started.append(info.version)
            assert pub.wait_snapshot() == info.version
            snap = sum(store.size(k) for k in store.list(f"{PREFIX}/v{info.version:08d}/") if "/s-" in k)
            assert 0.5 * first.bytes_written < snap < 2 * first.bytes_written
            break
    assert started, "40 deltas should outgrow half a snapshot of this model"


def test_delta_is_small_and_changed_fraction(store: FileStore) -> None:
    d = Drift()
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100)
    full = pub.publish(d.bf16())
    d.step(lr=1e-6)
    delta = pub.publish(d.bf16())
    assert delta.kind == "delta" and 0 < delta.changed_fraction < 0.2
    assert delta.bytes_written < 0.2 * full.bytes_written


def test_every_version_replays_bit_exact(store: FileStore) -> None:
    _pub, history = _publish(store, 8)
    rd = VersionReader(store, PREFIX)
    assert rd.latest() == 8
    for v in range(1, 9):
        got, ver = rd.fetch(v)
        assert ver == v and same(got, history[v - 1])
        # late joiner: starts at the newest snapshot <= v and folds the deltas after it
        assert rd.last_stats["versions"][0] == 1 + 3 * ((v - 1) // 3)
        assert rd.last_stats["path"] == ("keyframe 1" if v < 4 else f"snapshot {1 + 3 * ((v - 1) // 3)}")


def test_incremental_fetch_reads_only_deltas(store: FileStore) -> None:
    pub, history = _publish(store, 2, k=100)
    rd = VersionReader(store, PREFIX)
    have, hv = rd.fetch(1)
    got, v = rd.fetch(have=have, have_version=hv)
    assert v == 2 and same(got, history[1]) and rd.last_stats["path"] == "have"
    assert same(have, history[0])  # not modified without inplace
    d = Drift()
    d.step(), d.step()
    t3 = d.bf16()
    pub.publish(t3)
    got3, v3 = rd.fetch(have=got, have_version=2, inplace=True)
    assert v3 == 3 and same(got3, t3) and same(got, t3)  # patched in place


def test_a_reader_one_behind_never_reads_a_snapshot(store: FileStore) -> None:
    _pub, history = _publish(store, 4, k=3)  # 4 has a snapshot
    rd = VersionReader(store, PREFIX)
    have, _ = rd.fetch(3)
    got, v = rd.fetch(have=have, have_version=3)
    assert v == 4 and same(got, history[3]) and rd.last_stats["versions"] == [4]
    assert rd.last_stats["bytes_read"] < 0.5 * store.size(f"{PREFIX}/v00000004/s-0000.bin")


def test_resume_continues_with_delta(store: FileStore) -> None:
    _pub, history = _publish(store, 2, k=10)
    pub2 = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10, shard_bytes=64 << 10)
    assert pub2.version == 2
    d = Drift()
    for _ in range(2):
        d.step()
    info = pub2.publish(d.bf16())
    assert info.version == 3 and info.kind == "delta"
    got, _ = VersionReader(store, PREFIX).fetch(3)
    assert same(got, d.bf16())


def test_layout_change_forces_keyframe(store: FileStore) -> None:
    d = Drift()
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100)
    pub.publish(d.bf16())
    t = d.bf16()
    t["new.bias"] = torch.zeros(3, dtype=torch.float16)
    assert pub.publish(t).kind == "keyframe"
    got, _ = VersionReader(store, PREFIX).fetch()
    assert same(got, t)


def test_side_files_and_meta(store: FileStore) -> None:
    d = Drift()
    pub = VersionPublisher(store, PREFIX)
    pub.publish(d.bf16(), files={"config.json": b'{"a": 1}'}, meta={"step": 7})
    rd = VersionReader(store, PREFIX)
    assert rd.files(1) == {"config.json": b'{"a": 1}'}
    assert rd.manifest(1).meta == {"step": 7}


def test_gc_keeps_what_readers_need(store: FileStore) -> None:
    _pub, history = _publish(store, 8, k=3)  # starts 1 (full), snapshots 4, 7
    deleted = collect(store, PREFIX, keep=3)  # keep 6,7,8 -> anchor snapshot 4
    assert deleted == [1, 2, 3]
    rd = VersionReader(store, PREFIX)
    assert rd.versions() == [4, 5, 6, 7, 8]
    for v in (4, 6, 8):
        got, _ = rd.fetch(v)
        assert same(got, history[v - 1])
    assert not store.list(f"{PREFIX}/v00000001/")


def test_gc_from_publisher(store: FileStore) -> None:
    _pub, history = _publish(store, 9, k=2, keep_versions=2)
    rd = VersionReader(store, PREFIX)
    assert rd.versions()[0] >= 7 and rd.latest() == 9
    got, _ = rd.fetch()
    assert same(got, history[-1])


def test_concurrent_readers_and_writer(store: FileStore) -> None:
    d = Drift(scale=4)
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=0.5, chunk_bytes=16 << 10, shard_bytes=32 << 10,
                           keep_versions=4)
    history: dict[int, dict[str, torch.Tensor]] = {}
    history[pub.publish(d.bf16()).version] = d.bf16()
    stop = threading.Event()
    failures: list[str] = []
    seen: list[int] = []

    def reader() -> None:
        rd = VersionReader(store, PREFIX)
        have, hv = None, None
        while not stop.is_set():
            got, v = rd.fetch(have=have, have_version=hv)
            if not same(got, history[v]):
                failures.append(f"version {v} not bit-exact")
            have, hv = got, v
            seen.append(v)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(12):
            d.step()
            t = d.bf16()
            history[pub.version + 1] = t
            pub.publish(t)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not failures
    assert seen


class _Counting(FileStore):
    """A FileStore that counts listings."""

    lists = 0

    def list(self, prefix: str = "") -> list[str]:
        type(self).lists += 1
        return super().list(prefix)


def test_one_version_behind_fetch_needs_no_listing(tmp_path: Path) -> None:
    """The common rollout-worker case (one version behind) reads the next manifest and probes the
    one after instead of listing; two behind, it lists and still gets the newest."""
    store = _Counting(tmp_path / "s")
    d = Drift()
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10)
    hist = []
    for _ in range(4):
        hist.append(d.bf16())
        pub.publish(hist[-1])
        d.step()
    rd = VersionReader(store, PREFIX)
    have, hv = rd.fetch(2)
    _Counting.lists = 0
    got, v = rd.fetch(have=have, have_version=hv)  # two behind: lists
    assert v == 4 and same(got, hist[3]) and _Counting.lists == 1
    have, hv = rd.fetch(3)
    _Counting.lists = 0
    got, v = rd.fetch(have=have, have_version=hv, inplace=True)  # one behind: no listing
    assert v == 4 and same(got, hist[3]) and _Counting.lists == 0 and rd.last_stats["path"] == "have"
    got, v = rd.fetch(4, have={k: t.clone() for k, t in hist[2].items()}, have_version=3)  # explicit target
    assert v == 4 and same(got, hist[3]) and _Counting.lists == 0
    got, v = rd.fetch(have=got, have_version=4)  # nothing newer: lists, returns 4 unchanged
    assert v == 4 and same(got, hist[3]) and _Counting.lists == 1


def test_one_behind_fast_path_failure_falls_back_to_keyframe(tmp_path: Path) -> None:
    """A wrong base on the listing-free path is recorded and the reader recovers from the keyframe
    (the caller's tensors, possibly patched, are not tried again)."""
    store = FileStore(tmp_path / "s")
    d = Drift()
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10)
    hist = []
    for _ in range(3):
        hist.append(d.bf16())
        pub.publish(hist[-1])
        d.step()
    rd = VersionReader(store, PREFIX)
    wrong = {k: t.clone() for k, t in hist[0].items()}  # claims to be version 2
    got, v = rd.fetch(have=wrong, have_version=2, inplace=True)
    assert v == 3 and same(got, hist[2]) and rd.last_stats["path"] == "keyframe 1"
    assert len(rd.last_errors) == 1
    with pytest.raises(Exception, match="version"):
        VersionReader(store, PREFIX, strict=True).fetch(have={k: t.clone() for k, t in hist[0].items()},
                                                         have_version=2)


def test_manifest_cache_is_bounded_by_the_frames_it_carries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each cached manifest carries its version's last delta frames; the cache drops the oldest
    versions once those add up to MANIFEST_CACHE_BYTES (and keeps at least the newest)."""
    from infra.weightsync import reader as reader_module

    store = FileStore(tmp_path / "s")
    d = Drift(scale=4)
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10,
                           delta_shard_bytes=64 << 10)
    for _ in range(6):
        pub.publish(d.bf16())
        d.step(lr=2e-4)
    rd = VersionReader(store, PREFIX)
    tails = [len(rd.manifest(v).tail) for v in range(2, 7)]
    assert min(tails) > 1000
    monkeypatch.setattr(reader_module, "MANIFEST_CACHE_BYTES", 2 * max(tails))
    rd = VersionReader(store, PREFIX)
    have, hv = rd.fetch(1)
    for v in range(2, 7):
        have, hv = rd.fetch(v, have, hv, inplace=True)
        cached = rd._manifests
        assert v in cached and sum(len(m.tail) for m in cached.values()) <= 2 * max(tails)
    assert len(rd._manifests) < 6


def test_weight_sync_config_sets_the_delta_shard_size(tmp_path: Path) -> None:
    """``weight_sync.delta_shard_kib`` reaches the publisher: at 64 KiB a large delta goes up in
    shard objects of about that size, at the default (4 MiB) it rides in the manifest object;
    the reader gets the same bits either way. Out-of-range sizes are refused."""
    from pydantic import ValidationError

    from infra.configs.services import WeightSyncConfig

    for bad in (0, 63, 65537):
        with pytest.raises(ValidationError, match="delta_shard_kib"):
            WeightSyncConfig(delta_shard_kib=bad)
    shards: dict[int | None, list[int]] = {}
    for kib in (64, None):
        store = FileStore(tmp_path / f"s{kib}")
        cfg = WeightSyncConfig(delta_shard_kib=kib, snapshot_chain_fraction=100)
        pub = VersionPublisher(store, PREFIX, chunk_bytes=16 << 10, **cfg.publisher_kwargs())
        d = Drift(scale=16)
        pub.publish(d.bf16())
        d.step(lr=2e-4)
        want = d.bf16()
        pub.publish(want)
        keys = [k for k in store.list(f"{PREFIX}/v00000002/") if k.rsplit("/", 1)[-1].startswith("d-")]
        shards[kib] = [store.size(k) for k in keys]
        got, v = VersionReader(store, PREFIX).fetch()
        assert v == 2 and same(got, want)
    # a shard closes at the first frame that takes it to the size: under it plus one 16 KiB chunk's frame
    assert len(shards[64]) >= 2 and min(shards[64]) >= 64 << 10 and max(shards[64]) < (64 + 17) << 10
    assert shards[None] == []
