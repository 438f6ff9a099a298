"""``weight_sync.publish_ranks: 2`` end to end on real services: two torchrun trainer ranks each
encode and upload their share of every version and rank 0 commits it; the rollout worker (its own
process) pulls each version from the file object store; sandboxes under bubblewrap.

- the whole rl-train flow (Prefect's test harness) on the tiny demo config, with snapshots asked
  for at every version: every step's rollouts come from the version trained before it, both ranks'
  shards are in the store, snapshots merged from both shares commit, and a late joiner that starts
  from one gets the bits a replay from version 1 gets;
- the flow's stages driven one by one, with DeepSpeed ZeRO-3 (each tensor gathered, and kept by
  its owner only): the worker serves the bits the store holds after each sync, a republish rewrites the
  newest version in place, and a restarted trainer group continues with deltas (each rank reads its
  share of the newest version back as its base).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

pytestmark = pytest.mark.slow

TINY = [
    "trainer.prompts_per_step=4", "trainer.group_size=4", "warmstart.steps=30", "env.eval_problems=10",
    "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128",
    "model.tiny.num_heads=2", "sandbox.runtime=bwrap", "cluster.ranks=2", "weight_sync.publish_ranks=2",
]


@pytest.fixture(scope="module")
def harness() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _digests(store: Any, prefix: str, version: int) -> tuple[dict[str, str], str]:
    """Digests of ``version`` as a fresh reader gets it, and the path it took."""
    from infra.rollout.digest import state_digests
    from infra.weightsync import VersionReader

    reader = VersionReader(store, prefix)
    tensors, got = reader.fetch(target=version)
    assert got == version
    return state_digests(tensors), str(reader.last_stats["path"])


def test_flow_with_two_publishing_ranks(harness: None, tmp_path: Path) -> None:
    from flows.rl_train import rl_train
    from infra.rollout.digest import state_digests
    from infra.storage import get_json, open_store
    from infra.weightsync import VersionReader
    from infra.weightsync.layout import scan_versions

    root = tmp_path / "runs"
    out = rl_train(config="configs/demo.yaml",
                   overrides=[*TINY, "trainer.steps=3", "promote.enabled=false", f"run_root={root}",
                              "weight_sync.snapshot_chain_fraction=0.01"])
    summary = json.loads(Path(out["summary_path"]).read_text())
    assert summary["steps"] == 3 and summary["final_weight_version"] == 4 and summary["publish_ranks"] == 2
    store = open_store(f"file://{root}/store")
    prefix = f"runs/{summary['run_id']}/weights"
    for step in (1, 2, 3):
        roll = get_json(store, f"runs/{summary['run_id']}/step-{step:06d}/rollouts.json")
        assert {s["version"] for s in roll["samples"]} == {step}
    keys = store.list(prefix + "/")
    for part in ("-p000-", "-p001-"):
        assert any(f"/k{part}" in k for k in keys), part  # version 1: both ranks uploaded their share
        assert any(f"/s{part}" in k for k in keys), part  # and their share of a snapshot
    listing = scan_versions(keys)
    assert listing.committed == [1, 2, 3, 4] and listing.snapshots
    newest = max(listing.snapshots)
    late, path = _digests(store, prefix, newest)
    assert path == f"snapshot {newest}"
    replay = VersionReader(store, prefix)
    tensors, _ = replay.fetch(target=1)
    for v in range(2, newest + 1):
        tensors, _ = replay.fetch(target=v, have=tensors, have_version=v - 1)
    assert state_digests(tensors) == late


def _served(service: Any) -> dict[str, Any]:
    from infra.rollout.guard import control_token

    resp = httpx.post(service.url + "/v1/weights/digest", timeout=120,
                      headers={"Authorization": f"Bearer {control_token(service._secret)}"})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_stages_serve_the_store_bits_through_republish_and_trainer_restart(tmp_path: Path) -> None:
    from infra.config import load_config
    from infra.stages.context import prepare_run
    from infra.stages.provision import provision, restart_trainer, teardown
    from infra.stages.steps import rollout_batch, score_batch, sync_weights, train_step

    cfg = load_config("configs/demo.yaml", [*TINY, "trainer.steps=2", "trainer.engine=deepspeed",
                                            "trainer.zero_stage=3", f"run_root={tmp_path}"])
    ctx = prepare_run(cfg)
    cluster = provision(ctx)
    prefix = ctx.key(None, "weights")
    try:
        for step in (1, 2):
            rollout_batch(ctx, cluster, step)
            score_batch(ctx, cluster, step)
            train = train_step(ctx, cluster, step)
            assert train["publish"]["kind"] == "delta" and train["publish"]["parts"] == 2
            version = int(train["publish"]["version"])
            assert sync_weights(ctx, cluster, version)["applied"] is True
            served = _served(cluster.rollout)
            assert served["version"] == version and served["tensors"] == _digests(ctx.store, prefix, version)[0]

        before = _digests(ctx.store, prefix, 3)[0]
        again = cluster.trainer.call("republish", version=3)
        assert again["version"] == 3 and again["kind"] == "keyframe" and again["parts"] == 2
        assert _digests(ctx.store, prefix, 3)[0] == before  # the same bits, now a full version

        restart_trainer(ctx, cluster, "test: trainer group replaced")
        while int(cluster.trainer.call("ping")["weights_version"]) < 3:  # replayed: already published
            cluster.trainer.call("publish")
        nxt = cluster.trainer.call("publish")
        assert nxt["version"] == 4 and nxt["kind"] == "delta" and nxt["parts"] == 2  # each rank resumed its base
        assert sync_weights(ctx, cluster, 4)["applied"] is True
        assert _served(cluster.rollout)["tensors"] == _digests(ctx.store, prefix, 4)[0]
    finally:
        teardown(cluster)
        ctx.tracker.end("FINISHED")
