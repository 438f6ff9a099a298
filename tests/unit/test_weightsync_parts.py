"""Sharded publishing (:mod:`infra.weightsync.parts`): three parts each publish their share of a
drifting model, part 0 commits one manifest, and any reader (whole, one stage, a late joiner from a
snapshot merged from every part's share) gets the published bits. A part that fails leaves nothing
visible and makes the next version full on every part; new parts resume as deltas; a republish
rewrites the version in place."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from infra.storage import FileStore
from infra.weightsync import VersionReader
from infra.weightsync.layout import Manifest, read_manifest_object, scan_versions
from infra.weightsync.parts import Outcome, PartPublisher, PartReport, assign_parts
from tests.weightsync_helpers import Drift, same

PREFIX = "runs/parts/weights"
PARTS = 3


class FailingStore(FileStore):
    """Fails every PUT whose key contains ``fail`` (while set); takes 0.3 s for those containing ``slow``."""

    fail: str | None = None
    slow: str | None = None

    def put(self, key: str, data: bytes) -> None:
        if self.fail and self.fail in key:
            raise OSError(f"injected failure writing {key}")
        if self.slow and self.slow in key:
            time.sleep(0.3)
        super().put(key, data)


def _parts(store: FileStore, names: list[list[str]], **kw: object) -> list[PartPublisher]:
    kw = {"chunk_bytes": 16 << 10, "delta_shard_bytes": 1 << 10, "shard_bytes": 32 << 10, **kw}
    return [PartPublisher(store, PREFIX, p, PARTS, names[p], **kw) for p in range(PARTS)]  # type: ignore[arg-type]


def _publish(parts: list[PartPublisher], state: dict, names: list[list[str]]) -> Outcome:
    """One version through the two phases, as the trainer's ranks run them (here one after another)."""
    shares = [{n: state[n] for n in names[p.index]} for p in parts]
    full = not all(p.ready(s) for p, s in zip(parts, shares))
    reports = [p.prepare(s, full=full) for p, s in zip(parts, shares)]
    outcome = parts[0].commit(reports)
    for p in parts:
        p.settle(outcome)
    return outcome


def _names() -> list[list[str]]:
    state = Drift(seed=1).bf16()
    return assign_parts({n: t.numel() * t.element_size() for n, t in state.items()}, PARTS)


def test_assign_parts_balances_bytes_and_keeps_order() -> None:
    sizes = {"a": 10, "b": 70, "c": 40, "d": 30, "e": 30}
    got = assign_parts(sizes, 2)
    assert got == [["b", "e"], ["a", "c", "d"]]  # b 70, c 40, d 30 (to the lighter), e 30, a 10
    assert assign_parts(sizes, 2) == got  # the same on every rank
    assert assign_parts({"x": 1}, 3) == [["x"], [], []]
    with pytest.raises(ValueError):
        assign_parts(sizes, 0)


def test_parts_publish_one_version_every_reader_gets(tmp_path: Path) -> None:
    store, names = FileStore(tmp_path / "store"), _names()
    assert all(names)  # every part holds tensors
    parts = _parts(store, names, snapshot_chain_fraction=0.05)
    drift, states, kinds = Drift(seed=1), [], []
    for v in range(1, 7):
        if v > 1:
            drift.step(1e-3)
        states.append(drift.bf16())
        out = _publish(parts, states[-1], names)
        assert out.committed and out.version == v and out.info is not None
        kinds.append(out.info.kind)
        if out.snapshot:  # every part writes its share; part 0 merges them once all are in
            start = parts[0].collect_snapshots([p.snapshot_report(wait=True) for p in parts])
            assert start == v
    assert kinds == ["keyframe"] + ["delta"] * 5
    for v in range(2, 7):  # the parts' carried frames together stay within one delta shard (1 KiB)
        man = Manifest.from_bytes(read_manifest_object(store, PREFIX, v), v)
        assert len(man.tail) <= 1 << 10 and any(n.startswith("d-p") for n in man.shards)
    keys = store.list(PREFIX + "/")
    assert any("/d-p002-" in k for k in keys) and any("/k-p001-" in k for k in keys)
    for v in (1, 4, 6):
        got, got_v = VersionReader(store, PREFIX).fetch(target=v)
        assert got_v == v and same(got, states[v - 1])
    stage = sorted(names[1])[:1]
    got, _ = VersionReader(store, PREFIX, names=stage).fetch(target=6)
    assert same(got, {n: states[5][n] for n in stage})
    for p in parts:
        p.close(wait_snapshot=True)
    listing = scan_versions(store.list(PREFIX + "/"))
    assert listing.snapshots and not listing.partial
    late = VersionReader(store, PREFIX)
    got, v = late.fetch(target=6)
    assert v == 6 and same(got, states[5]) and late.last_stats["path"].startswith("snapshot")


def test_a_failed_part_commits_nothing_and_the_next_version_is_full(tmp_path: Path) -> None:
    store, names = FailingStore(tmp_path / "store"), _names()
    parts = _parts(store, names, snapshot_chain_fraction=100)
    drift = Drift(seed=2)
    assert _publish(parts, drift.bf16(), names).committed
    drift.step(1e-3)
    store.fail = "-p002-"
    out = _publish(parts, drift.bf16(), names)
    assert not out.committed and "part 2" in (out.error or "")
    assert scan_versions(store.list(PREFIX + "/")).committed == [1]
    assert all(p.version == 1 for p in parts)
    store.fail = None
    drift.step(1e-3)
    out = _publish(parts, drift.bf16(), names)
    assert out.committed and out.version == 2 and out.info is not None and out.info.kind == "keyframe"
    got, v = VersionReader(store, PREFIX).fetch()
    assert v == 2 and same(got, drift.bf16())


def test_new_parts_resume_with_deltas_and_republish_in_place(tmp_path: Path) -> None:
    store, names = FileStore(tmp_path / "store"), _names()
    drift = Drift(seed=3)
    first = _parts(store, names, snapshot_chain_fraction=100)
    assert _publish(first, drift.bf16(), names).committed
    for p in first:
        p.close()
    again = _parts(store, names, snapshot_chain_fraction=100)
    assert [p.version for p in again] == [1, 1, 1]
    drift.step(1e-3)
    out = _publish(again, drift.bf16(), names)
    assert out.committed and out.info is not None and out.info.kind == "delta"
    for p in again:
        p.drop_newest()
    assert scan_versions(store.list(PREFIX + "/")).committed == [1]
    out = _publish(again, drift.bf16(), names)  # the same weights, written again as a full version 2
    assert out.committed and out.version == 2 and out.info is not None and out.info.kind == "keyframe"
    got, v = VersionReader(store, PREFIX).fetch()
    assert v == 2 and same(got, drift.bf16())
    with pytest.raises(TypeError):
        again[0].publish(drift.bf16())


def test_commit_refuses_missing_or_mismatched_reports(tmp_path: Path) -> None:
    store, names = FileStore(tmp_path / "store"), _names()
    parts = _parts(store, names)
    state = Drift(seed=4).bf16()
    reports = [p.prepare({n: state[n] for n in names[p.index]}, full=True) for p in parts]
    out = parts[0].commit(reports[:2])
    assert not out.committed and "2 reports for 3 parts" in (out.error or "")
    out = parts[0].commit(reports[:2] + [PartReport(2, 5, reports[2].manifest)])
    assert not out.committed and "not 1" in (out.error or "")
    assert scan_versions(store.list(PREFIX + "/")).committed == []
    with pytest.raises(RuntimeError):
        parts[1].commit(reports)


def test_a_failed_snapshot_share_drops_the_snapshot_and_the_cadence_asks_again(tmp_path: Path) -> None:
    store, names = FailingStore(tmp_path / "store"), _names()
    parts = _parts(store, names, snapshot_chain_fraction=0.01)
    drift = Drift(seed=5)
    _publish(parts, drift.bf16(), names)
    drift.step(1e-3)
    store.fail = "/s-p001-"
    assert _publish(parts, drift.bf16(), names).snapshot  # the chain outgrew 1% of a snapshot
    assert parts[0].collect_snapshots([p.snapshot_report(wait=True) for p in parts]) == 1  # not 2
    listing = scan_versions(store.list(PREFIX + "/"))
    assert not listing.snapshots and not listing.partial  # every part's share deleted
    store.fail = None
    drift.step(1e-3)
    assert _publish(parts, drift.bf16(), names).snapshot  # asked again at once
    assert parts[0].collect_snapshots([p.snapshot_report(wait=True) for p in parts]) == 3
    assert scan_versions(store.list(PREFIX + "/")).snapshots == {3}


def test_parts_killed_before_the_commit_leave_nothing_and_new_parts_resume(tmp_path: Path) -> None:
    store, names = FileStore(tmp_path / "store"), _names()
    drift = Drift(seed=6)
    parts = _parts(store, names, snapshot_chain_fraction=100)
    assert _publish(parts, drift.bf16(), names).committed
    drift.step(1e-3)
    state = drift.bf16()
    for p in parts:  # every part uploads its share of version 2; the process dies before part 0 commits
        assert p.prepare({n: state[n] for n in names[p.index]}, full=False).error is None
    assert any("/v00000002/" in k for k in store.list(PREFIX + "/"))
    again = _parts(store, names, snapshot_chain_fraction=100)  # the restarted ranks
    assert not any("/v00000002/" in k for k in store.list(PREFIX + "/"))  # part 0 deleted the orphan shares
    assert [p.version for p in again] == [1, 1, 1]
    out = _publish(again, state, names)
    assert out.committed and out.version == 2 and out.info is not None and out.info.kind == "delta"
    got, v = VersionReader(store, PREFIX).fetch()
    assert v == 2 and same(got, state)


def test_a_republish_deletes_the_shares_of_the_snapshot_it_abandoned(tmp_path: Path) -> None:
    store, names = FailingStore(tmp_path / "store"), _names()
    parts = _parts(store, names, snapshot_chain_fraction=0.01)
    drift = Drift(seed=8)
    _publish(parts, drift.bf16(), names)
    drift.step(1e-3)
    store.slow = "/s-p002-"  # part 2's share of the snapshot is still uploading when version 3 commits
    assert _publish(parts, drift.bf16(), names).snapshot
    parts[0].snapshot_report(wait=True)  # part 0's share is written (its report is not sent)
    drift.step(1e-3)
    assert _publish(parts, drift.bf16(), names).committed
    for p in parts:  # a reader found version 3 damaged: every part drops it, abandoning the snapshot of 2
        p.drop_newest()
    store.slow = None
    out = _publish(parts, drift.bf16(), names)
    assert out.committed and out.version == 3 and out.info is not None and out.info.kind == "keyframe"
    listing = scan_versions(store.list(PREFIX + "/"))
    assert not listing.partial and not listing.snapshots  # part 0's finished share is gone too
