"""A corrupt newest weight version is repaired, not fatal (issue #16, the corrupted-weight-object fault).

The real services of a run (trainer, rollout worker, sandbox pool: :func:`provision`) on the tiny
demo model: the trainer publishes a version, one byte of its manifest is flipped in the store
before the rollout worker loads it, and the *sync weights* stage must end with the worker serving
that version — the trainer, which still holds the weights, writes it again as a keyframe — and the
next delta must apply on top of it. Before, the stage failed and the run stopped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128",
        "model.tiny.num_heads=2", "warmstart.steps=0", "cluster.ranks=1"]


def _flip_a_byte(store_root: Path, run_id: str, version: int) -> Path:
    """Flip one byte in the middle of ``version``'s manifest (the one object every version has: an
    untrained step's delta may have no frame shard)."""
    target = store_root / "runs" / run_id / "weights" / f"v{version:08d}" / "manifest.json.zst"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x40
    target.write_bytes(bytes(data))
    return target


def test_corrupt_new_version_is_republished_and_served(tmp_path: Path) -> None:
    from infra.config import load_config
    from infra.stages.context import prepare_run
    from infra.stages.provision import provision, teardown
    from infra.stages.steps import sync_weights
    from infra.weightsync import VersionReader

    cfg = load_config("configs/demo.yaml", [*TINY, f"run_root={tmp_path}"])
    ctx = prepare_run(cfg)
    cluster = provision(ctx)
    try:
        first = cluster.version
        pub = cluster.trainer.call("publish")
        version = int(pub["version"])
        assert version == first + 1 and pub["kind"] == "delta"
        _flip_a_byte(Path(cfg.resolved_storage_root().removeprefix("file://")), ctx.run_id, version)

        res = sync_weights(ctx, cluster, version)
        assert res["version"] == version and res["applied"] and res["republished"]["kind"] == "keyframe"
        assert cluster.version == version and cluster.rollout.version() == version
        reader = VersionReader(ctx.store, f"runs/{ctx.run_id}/weights")
        assert reader.manifest(version).keyframe

        nxt = cluster.trainer.call("publish")  # the chain goes on from the republished keyframe
        assert nxt["kind"] == "delta"
        res = sync_weights(ctx, cluster, int(nxt["version"]))
        assert res["applied"] and "republished" not in res and cluster.rollout.version() == nxt["version"]
    finally:
        teardown(cluster)
        ctx.tracker.end("FINISHED")
