"""The whole rl-train flow on real components: torchrun ranks, rollout worker, bubblewrap sandboxes,
local object store, MLflow sqlite store, Prefect's test harness. Small sizes, same code paths."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = pytest.mark.slow

TINY = [
    "trainer.steps=2", "trainer.prompts_per_step=4", "trainer.group_size=4",
    "warmstart.steps=30", "env.eval_problems=20", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
    "model.tiny.intermediate_size=128", "model.tiny.num_heads=2", "sandbox.runtime=bwrap",
    "promote.floors={}",  # this tiny model scores ~0.01, below the demo's production floor: plumbing, not quality
]


@pytest.fixture(scope="module")
def harness() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _service_pids(run_root: Path) -> list[int]:
    """Processes whose command line or environment (a service's spec, ``DELTALOOP_SPEC``) mentions
    the run root (trainer ranks, rollout worker, sandboxes)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = ((d / "cmdline").read_bytes() + (d / "environ").read_bytes()).decode(errors="replace")
        except OSError:
            continue
        if str(run_root) in cmd:
            pids.append(int(d.name))
    return pids


def _wait_gone(run_root: Path, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = _service_pids(run_root)
        if not left:
            return []
        time.sleep(0.3)
    return _service_pids(run_root)


def test_flow_end_to_end_promotes_then_gates(harness: None, tmp_path: Path) -> None:
    from flows.rl_train import rl_train
    from infra.registry import Registry

    root = tmp_path / "runs"
    overrides = [*TINY, f"run_root={root}"]
    out = rl_train(config="configs/demo.yaml", overrides=overrides)
    summary = json.loads(Path(out["summary_path"]).read_text())
    for field in ("eval_before", "eval_after", "steps", "final_weight_version", "promoted", "model_version",
                  "wall_seconds", "mlflow_run_id"):
        assert field in summary, field
    assert summary["steps"] == 2
    assert summary["final_weight_version"] == 3  # v1 after warm start, +1 per step
    assert summary["promoted"] is True  # first model: no champion yet
    assert (Path(summary["run_dir"]) / "curves.png").stat().st_size > 1000
    # every rollout records the policy version that produced it
    from infra.storage import get_json, open_store

    store = open_store(f"file://{root}/store")
    for step in (1, 2):
        roll = get_json(store, f"runs/{summary['run_id']}/step-{step:06d}/rollouts.json")
        assert {s["version"] for s in roll["samples"]} == {step}
    # MLflow: metrics per step, lineage tags on the registered version, champion alias
    uri = f"sqlite:///{root}/mlflow.db"
    reg = Registry(uri, "deltaloop-policy")
    champ = reg.alias("champion")
    assert champ is not None and champ.version == str(summary["model_version"])
    for tag in ("deltaloop.run_id", "step", "weight_version", "eval_score", "config_hash", "sandbox_image"):
        assert tag in champ.tags, tag
    hist = reg.client.get_metric_history(summary["mlflow_run_id"], "reward_mean")
    assert [m.step for m in hist] == [1, 2]
    assert not _wait_gone(root)
    # second run from the champion with a margin no model can clear: registered, rejected, champion kept
    out2 = rl_train(config="configs/demo.yaml",
                    overrides=[*overrides, "init_from=champion", "promote.margin=0.99", "trainer.steps=1"])
    s2 = json.loads(Path(out2["summary_path"]).read_text())
    assert s2["promoted"] is False
    assert s2["eval_before"] == pytest.approx(summary["eval_after"])  # starts exactly from the champion
    assert reg.alias("champion").version == champ.version  # type: ignore[union-attr]
    rejected = reg.get(s2["model_version"])
    assert rejected.tags["deltaloop.status"] == "rejected" and "margin" in rejected.tags["deltaloop.reason"]
    assert not _wait_gone(root)


def test_flow_failure_tears_everything_down(harness: None, tmp_path: Path) -> None:
    """Kill the rollout worker mid-flow with no restart allowed (``rollout.max_restarts=0``): the flow
    fails with a clear error and leaves no process behind.

    (With restarts allowed a dead worker is replaced, see test_rollout_worker_loss; a killed *trainer*
    rank is recovered from its checkpoint, see test_resume.)"""
    from flows.rl_train import rl_train

    root = tmp_path / "runs"
    stop = threading.Event()

    def killer() -> None:
        # once step 1 has trained, SIGKILL the rollout worker
        while not stop.is_set():
            done = list(root.glob("store/runs/*/step-000001/train.json"))
            if done:
                for pid in _service_pids(root):
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    if b"infra.rollout.server" in cmd:
                        try:
                            os.kill(pid, 9)
                        except ProcessLookupError:
                            pass
                return
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    with pytest.raises(Exception) as info:
        rl_train(config="configs/demo.yaml", overrides=[*TINY, "trainer.steps=30", "rollout.max_restarts=0",
                                                         f"run_root={root}"])
    stop.set()
    assert "rollout worker" in str(info.value).lower()
    assert not _wait_gone(root), "services survived a failed flow"


def test_async_loop_enforces_staleness_bound(harness: None, tmp_path: Path) -> None:
    """Async RL: batches are generated one version behind; with bound 0 they are dropped and
    regenerated from the current policy, so no trained batch exceeds the bound."""
    from flows.rl_train import rl_train

    common = [*TINY, "trainer.steps=3", "loop.mode=async", "promote.enabled=false"]
    out = rl_train(config="configs/demo.yaml", overrides=[*common, "loop.max_staleness=1", f"run_root={tmp_path}/a"])
    s = json.loads(Path(out["summary_path"]).read_text())
    steps = [h for h in s["history"] if h["kind"] == "step"]
    assert [h["staleness"] for h in steps] == [0, 1, 1]
    assert s["max_staleness_seen"] == 1 <= s["staleness_bound"]
    out0 = rl_train(config="configs/demo.yaml", overrides=[*common, "loop.max_staleness=0", f"run_root={tmp_path}/b"])
    s0 = json.loads(Path(out0["summary_path"]).read_text())
    steps0 = [h for h in s0["history"] if h["kind"] == "step"]
    assert [h["staleness"] for h in steps0] == [0, 0, 0]
    assert [h["batch_dropped"] for h in steps0] == [0, 1, 1]
