"""Sharded publishing from trainer ranks (:mod:`infra.train.sharded_publish`) with real processes
over gloo: two of three ranks publish their shares of each version and rank 0 commits it, with
snapshots merged from both shares; a republish whose part's store fails fails on every rank, and
the next publish writes the version again as a full one; every version reads back bit-exact. And
the settings ``weight_sync.publish_ranks`` refuses."""

from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path

import pytest

from infra.config import ConfigError, load_config
from infra.storage import FileStore
from infra.weightsync import VersionReader
from infra.weightsync.layout import scan_versions
from tests.sharded_helpers import PREFIX, sharded_rank
from tests.weightsync_helpers import Drift, same

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_parts_of_three_ranks_publish_fail_together_and_republish(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world, parts, port = 3, 2, _port()
    procs = [ctx.Process(target=sharded_rank, args=(r, world, port, str(tmp_path), parts, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, list] = {r: [] for r in range(world)}
    for _ in range(world * 9):  # 6 records, the failed republish's error, 1 record, the version: per rank
        rank, what, value = q.get(timeout=180)
        got[rank].append((what, value))
    for p in procs:
        p.join(timeout=30)
    assert all(p.exitcode == 0 for p in procs)

    for r in range(world):
        whats = [w for w, _ in got[r]]
        assert whats == ["record"] * 6 + ["error", "record", "version"], (r, whats)
        assert "ShardedPublishFailed" in got[r][6][1] and "part 1" in got[r][6][1]
        assert got[r][-1] == ("version", 6)
    records = [v for w, v in got[0] if w == "record"]
    assert [r["version"] for r in records] == [1, 2, 3, 4, 5, 6, 6]
    assert [r["kind"] for r in records] == ["keyframe"] + ["delta"] * 5 + ["keyframe"]
    assert all(r["parts"] == 2 for r in records) and all(v == {} for w, v in got[1] + got[2] if w == "record")

    store = FileStore(tmp_path)
    listing = scan_versions(store.list(PREFIX + "/"))
    assert listing.committed == [1, 2, 3, 4, 5, 6] and listing.snapshots and not listing.partial
    keys = store.list(PREFIX + "/")
    assert any("-p000-" in k for k in keys) and any("-p001-" in k for k in keys)
    assert not any("-p002-" in k for k in keys)  # rank 2 holds no part
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
])
def test_publish_ranks_refuses_settings_it_cannot_run(overrides: list[str], setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["weight_sync.publish_ranks=2", *overrides])
    assert setting in str(err.value) and "weight_sync.publish_ranks=" in str(err.value)
    assert load_config(DEMO, ["weight_sync.publish_ranks=2"]).weight_sync.publish_ranks == 2
