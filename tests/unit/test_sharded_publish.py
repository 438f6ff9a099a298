"""Sharded publishing from trainer ranks (:mod:`infra.train.sharded_publish`) with real processes
over gloo: two parts on ranks spread over the world (ranks 0 and 1 of three, 0 and 2 of four)
publish their shares of each version and rank 0 commits it, with snapshots merged from both shares; a republish whose part's store fails fails on every rank, and
the next publish writes the version again as a full one; every version reads back bit-exact. And
the settings ``weight_sync.publish_ranks`` refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.config import ConfigError, load_config
from infra.storage import FileStore
from infra.weightsync import VersionReader
from infra.weightsync.layout import scan_versions
from tests.rank_helpers import run_ranks
from tests.sharded_helpers import PREFIX, sharded_rank
from tests.weightsync_helpers import Drift, same

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


@pytest.mark.parametrize("world,parts,publishing", [(3, 2, [0, 1]), (4, 2, [0, 2])])
def test_parts_publish_fail_together_and_republish(tmp_path: Path, world: int, parts: int,
                                                   publishing: list[int]) -> None:
    rendezvous, store_root = str(tmp_path / "rendezvous"), str(tmp_path / "store")
    got: dict[int, list] = {r: [] for r in range(world)}
    # per rank: 6 records, its part, an error, 1 record, the version
    for rank, what, value in run_ranks(sharded_rank, world, lambda r, q: (r, world, rendezvous, store_root, parts, q),
                                       world * 10, 180):
        got[rank].append((what, value))

    for r in range(world):
        whats = [w for w, _ in got[r]]
        assert whats == ["record"] * 6 + ["part", "error", "record", "version"], (r, whats)
        assert "ShardedPublishFailed" in got[r][7][1] and f"part {parts - 1}" in got[r][7][1]
        assert got[r][-1] == ("version", 6)
    # the parts sit on ranks spread evenly (one per node, where torchrun numbers ranks node by node)
    assert [r for r in range(world) if got[r][6][1] is not None] == publishing
    assert [got[r][6][1] for r in publishing] == list(range(parts))
    records = [v for w, v in got[0] if w == "record"]
    assert [r["version"] for r in records] == [1, 2, 3, 4, 5, 6, 6]
    assert [r["kind"] for r in records] == ["keyframe"] + ["delta"] * 5 + ["keyframe"]
    assert all(r["parts"] == parts for r in records)
    assert all(v == {} for r in range(1, world) for w, v in got[r] if w == "record")

    store = FileStore(tmp_path / "store")
    listing = scan_versions(store.list(PREFIX + "/"))
    assert listing.committed == [1, 2, 3, 4, 5, 6] and listing.snapshots and not listing.partial
    keys = store.list(PREFIX + "/")
    assert all(any(f"-p{p:03d}-" in k for k in keys) for p in range(parts))
    assert not any(f"-p{parts:03d}-" in k for k in keys)
    drift = Drift(seed=7)
    for v in range(1, 7):
        if v > 1:
            drift.step(1e-3)
        tensors, at = VersionReader(store, PREFIX).fetch(target=v)
        assert at == v and same(tensors, drift.bf16())


@pytest.mark.parametrize("overrides,setting", [
    (["weight_sync.placement=broadcast"], "weight_sync.placement='broadcast'"),
    (["weight_sync.placement=colocated"], "weight_sync.placement='colocated'"),
    (["cluster.ranks=2", "weight_sync.publish_ranks=3"], "cluster.ranks=2"),
    (["trainer.lora.enabled=true"], "trainer.lora.enabled=true"),
    (["cluster.type=hosts", "cluster.hosts=[{host: a, slots: 2}]"], "storage.type='file' with cluster.type='hosts'"),
])
def test_publish_ranks_refuses_settings_it_cannot_run(overrides: list[str], setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["weight_sync.publish_ranks=2", *overrides])
    assert setting in str(err.value) and "weight_sync.publish_ranks=" in str(err.value)
    assert load_config(DEMO, ["weight_sync.publish_ranks=2"]).weight_sync.publish_ranks == 2
