"""Repairing a corrupt newest version: the publisher writes it again as a keyframe, same number.

Replays the corrupted-weight-object fault of issue #16: a reader (the rollout worker) that failed on
a corrupt object of the newest version fetches the republished version bit-exact — in place, from
the half-patched tensors it held, with the stale manifest in its cache — and the next delta applies
on top of it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.storage import FileStore
from infra.weightsync import CorruptData, VersionPublisher, VersionReader
from tests.weightsync_helpers import Drift, same

PREFIX = "runs/r/weights"


@pytest.fixture()
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


def test_republished_version_replaces_a_corrupt_one(store: FileStore) -> None:
    drift = Drift()
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10, delta_shard_bytes=2 << 10)
    history = []
    for _ in range(3):
        history.append(drift.bf16())
        pub.publish(history[-1])
        drift.step()
    reader = VersionReader(store, PREFIX)
    have, v = reader.fetch(2)
    assert v == 2
    shard = store.root / PREFIX / "v00000003" / "d-0000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptData):
        reader.fetch(3, have=have, have_version=2, inplace=True)  # caches v3's manifest, half-patches have

    info = pub.republish(history[2])
    assert (info.version, info.kind, pub.version) == (3, "keyframe", 3)
    assert reader.versions()[-1] == 3
    got, v = reader.fetch(3)  # the held tensors are no base any more: from the new keyframe
    assert v == 3 and same(got, history[2])
    history.append(drift.bf16())
    assert pub.publish(history[3]).kind == "delta"
    nxt, v = reader.fetch(4, have=got, have_version=3, inplace=True)
    assert v == 4 and same(nxt, history[3])
    assert same(VersionReader(store, PREFIX).fetch()[0], history[3])


def test_republish_needs_a_published_version(store: FileStore) -> None:
    from infra.weightsync import VersionNotFound

    with pytest.raises(VersionNotFound, match="nothing was published"):
        VersionPublisher(store, PREFIX).republish(Drift().bf16())
