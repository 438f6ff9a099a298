"""``weight_sync.placement: broadcast`` end to end on real services: torchrun trainer ranks, the
rollout worker process, bubblewrap sandboxes, a file object store.

- the whole rl-train flow (Prefect's test harness) on the tiny demo config: every step's rollouts
  come from the version trained before it, each received from trainer rank 0 over the group;
- the flow's stages driven one by one (as the flow calls them), to look at the served weights after
  each sync: their digests equal the bits the trainer publishes to the store after sending them; a
  rollout worker killed right after a sync is replaced with that version from the store and joins a
  fresh group; a restarted trainer group binds again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

pytestmark = pytest.mark.slow

TINY = [
    "trainer.prompts_per_step=4", "trainer.group_size=4", "warmstart.steps=30", "env.eval_problems=10",
    "model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128",
    "model.tiny.num_heads=2", "sandbox.runtime=bwrap", "weight_sync.placement=broadcast",
    "weight_sync.broadcast_timeout_s=30",
]


@pytest.fixture(scope="module")
def harness() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_flow_with_broadcast_placement(harness: None, tmp_path: Path) -> None:
    from flows.rl_train import rl_train
    from infra.storage import get_json, open_store

    root = tmp_path / "runs"
    out = rl_train(config="configs/demo.yaml",
                   overrides=[*TINY, "trainer.steps=3", "promote.enabled=false", f"run_root={root}"])
    summary = json.loads(Path(out["summary_path"]).read_text())
    assert summary["steps"] == 3 and summary["final_weight_version"] == 4
    store = open_store(f"file://{root}/store")
    for step in (1, 2, 3):  # the worker served versions 1..3, one per step
        roll = get_json(store, f"runs/{summary['run_id']}/step-{step:06d}/rollouts.json")
        assert {s["version"] for s in roll["samples"]} == {step}
    log = (Path(summary["run_dir"]) / "logs" / "rollout.log").read_text(errors="replace")
    assert "broadcast of weight version" not in log  # no failed receive


def _served(service: Any) -> dict[str, Any]:
    from infra.rollout.guard import control_token

    resp = httpx.post(service.url + "/v1/weights/digest", timeout=120,
                      headers={"Authorization": f"Bearer {control_token(service._secret)}"})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _published(ctx: Any, version: int) -> dict[str, str]:
    """Digests of ``version`` as the store has it, once committed (it is published after its send)."""
    from infra.rollout.digest import state_digests
    from infra.weightsync import VersionReader

    reader = VersionReader(ctx.store, ctx.key(None, "weights"))
    deadline = time.monotonic() + 60
    while version not in reader.versions() and time.monotonic() < deadline:
        time.sleep(0.1)
    tensors, got = reader.fetch(target=version)
    assert got == version
    return state_digests(tensors)


def _sync(ctx: Any, cluster: Any, version: int) -> dict[str, Any]:
    """Sync ``version``: it came over the group and the worker serves the trainer's bits."""
    from infra.stages.steps import sync_weights

    res = sync_weights(ctx, cluster, version)
    assert res["applied"] is True and res["via"] == "broadcast" and res["version"] == version, res
    assert res["bytes"] >= res.get("sent_bytes", 0) > 0
    served = _served(cluster.rollout)
    assert served["version"] == version and served["tensors"] == _published(ctx, version)
    return res


def test_stages_serve_the_trainers_bits_across_worker_and_trainer_restarts(tmp_path: Path) -> None:
    from infra.config import load_config
    from infra.rollout.broadcast_service import BroadcastRolloutService
    from infra.stages.context import prepare_run
    from infra.stages.provision import provision, restart_trainer, teardown
    from infra.stages.steps import rollout_batch, score_batch, train_step

    cfg = load_config("configs/demo.yaml", [*TINY, "trainer.steps=2", "cluster.ranks=1", f"run_root={tmp_path}"])
    ctx = prepare_run(cfg)
    cluster = provision(ctx)
    try:
        service = cluster.rollout
        assert isinstance(service, BroadcastRolloutService) and service.bound
        assert _served(service)["tensors"] == _published(ctx, cluster.version)  # version 1 at provision
        for step in (1, 2):
            rollout_batch(ctx, cluster, step)
            score_batch(ctx, cluster, step)
            train = train_step(ctx, cluster, step)
            # sent first, published after: the step's record has no store bytes yet, the next one has them
            assert train["publish"]["kind"] == "behind" and train["publish"]["bytes_written"] is None
            if step == 2:
                assert train["published_behind"]["version"] == 2 and train["published_behind"]["bytes_written"] > 0
            _sync(ctx, cluster, int(train["publish"]["version"]))

        os.kill(service.pid, 9)  # dies right after a sync: the replacement loads version 3 from the store
        rollout_batch(ctx, cluster, 3)
        assert service.restarts == 1 and _served(service)["tensors"] == _published(ctx, 3)
        nxt = int(cluster.trainer.call("publish")["version"])
        _sync(ctx, cluster, nxt)
        assert service.restarts == 1 and service.bound and service.broadcast_fallbacks == 0

        restart_trainer(ctx, cluster, "test: trainer group replaced")  # binds the new group again
        assert service.bound
        while int(cluster.trainer.call("ping")["weights_version"]) < nxt:  # back to the newest version
            cluster.trainer.call("publish")
        _sync(ctx, cluster, int(cluster.trainer.call("publish")["version"]))
        assert service.broadcast_fallbacks == 0
    finally:
        teardown(cluster)
        ctx.tracker.end("FINISHED")
