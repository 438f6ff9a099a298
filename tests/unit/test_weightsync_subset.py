"""A reader that fetches only some tensors (``VersionReader(names=...)``, e.g. the layers one
pipeline stage serves): it downloads only their frames, hands back exactly those tensors bit-exact
on every path (a full version, a snapshot and the deltas after it, its own tensors one version
behind), and refuses a name the version does not have. And a fetch's ``progress`` callback: it
hears every byte of the replay, in order."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.storage import FileStore
from infra.weightsync import IncompatibleTensors, VersionPublisher, VersionReader
from tests.weightsync_helpers import Drift, same

PREFIX = "runs/subset/weights"
STAGE = {"layers.0.q.weight", "layers.0.mlp.weight"}  # one stage's tensors, without the big embedding


def _published(tmp_path: Path, versions: int) -> tuple[FileStore, list[dict]]:
    """``versions`` drifting versions, 1 KiB delta shards (frames in shard objects), a snapshot of 3."""
    store = FileStore(tmp_path / "store")
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10,
                           delta_shard_bytes=1 << 10)
    drift, states = Drift(seed=3), []
    for v in range(1, versions + 1):
        if v > 1:
            drift.step(1e-3)
        states.append(drift.bf16())
        pub.publish(states[-1], snapshot=v == 3)
        if v == 3:
            pub.wait_snapshot()
    pub.close()
    return store, states


def _exact(got: dict, want: dict) -> None:
    assert same(got, {name: want[name] for name in STAGE})


def test_a_stage_reads_only_its_tensors_on_every_path(tmp_path: Path) -> None:
    store, states = _published(tmp_path, 6)
    whole = VersionReader(store, PREFIX)
    part = VersionReader(store, PREFIX, names=STAGE)

    whole.fetch(target=2)
    got, v = part.fetch(target=2)  # from the full version 1 and one delta
    assert v == 2 and part.last_stats["path"] == "keyframe 1"
    _exact(got, states[1])
    assert 0 < part.last_stats["bytes_read"] < whole.last_stats["bytes_read"] / 2  # the embedding is most bytes

    late = VersionReader(store, PREFIX, names=STAGE)
    got5, v = late.fetch(target=5)  # a late joiner: snapshot 3, then deltas 4 and 5
    assert v == 5 and late.last_stats["path"] == "snapshot 3"
    _exact(got5, states[4])

    got6, v = late.fetch(have=got5, have_version=5, inplace=True)  # its own tensors, one version behind
    assert v == 6 and late.last_stats["path"] == "have"
    _exact(got6, states[5])


def test_a_name_the_version_lacks_is_refused(tmp_path: Path) -> None:
    store, _states = _published(tmp_path, 2)
    with pytest.raises(IncompatibleTensors, match="no tensor 'layers.9.q.weight'"):
        VersionReader(store, PREFIX, names={*STAGE, "layers.9.q.weight"}).fetch()


def test_progress_counts_every_byte_of_the_replay(tmp_path: Path) -> None:
    store, states = _published(tmp_path, 5)
    heard: list[tuple[int, int]] = []
    rd = VersionReader(store, PREFIX, io_threads=4)
    got, v = rd.fetch(progress=lambda done, total: heard.append((done, total)))  # snapshot 3 + deltas 4, 5
    assert v == 5 and same(got, states[4])
    assert len(heard) > 1 and [d for d, _t in heard] == sorted(d for d, _t in heard)
    assert heard[-1] == (rd.last_stats["bytes_read"], rd.last_stats["bytes_read"])
    assert {t for _d, t in heard} == {rd.last_stats["bytes_read"]}
    n = len(heard)
    rd.fetch(target=4)  # no progress asked: nothing more heard
    assert len(heard) == n
