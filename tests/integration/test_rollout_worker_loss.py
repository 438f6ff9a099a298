"""Rollout worker loss (issue #16): a worker that dies mid-batch is restarted with the weight version
it served, and the batch is requested again with the same seeds, so the step's samples are exactly
the ones it would have had; restarts are bounded.

The worker is the real process (``python -m infra.rollout.server``) killed with SIGKILL while it
holds a ``/v1/rollout`` request (``tests/integration/flowfaults`` stops it there), first under a bare
:class:`~infra.rollout.service.RolloutService`, then inside a whole run of the flow.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from infra.config import RunConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer, publishable_state  # noqa: E402
from infra.rollout.service import RolloutRestartsExhausted, RolloutService  # noqa: E402
from infra.storage import open_store, put_json, run_key  # noqa: E402
from infra.weightsync import VersionPublisher  # noqa: E402
from tests.flow_helpers import (assert_same_weights, final_weights, kill_tree, pause_env, reference,  # noqa: E402
                                run_id, start_paused, step_doc, trained)

pytestmark = pytest.mark.slow

RUN = "run1"
TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}
PROMPTS = {"prompts": [f"{a},{a + 3},{a + 6}=" for a in range(12)], "render": {"chat": "off"}, "stop": ["\n"]}


def _config(**rollout: Any) -> RunConfig:
    return RunConfig.model_validate({"model": {"tiny": TINY}, "rollout": rollout})


def _publish_two_versions(cfg: RunConfig, store: Any) -> None:
    """Versions 1 and 2 of the policy (different weights), as the trainer would publish them."""
    tok = build_tokenizer()
    pub = VersionPublisher(store, run_key(RUN, None, "weights"))
    for seed in (1, 2):
        pub.publish(publishable_state(build_tiny_model(cfg.model.tiny, tok, seed=seed)))


def _rollout(service: RolloutService, step: int) -> dict[str, Any]:
    put_json(service.store, run_key(RUN, step, "prompts.json"), PROMPTS)
    return service.rollout(run_key(RUN, step, "prompts.json"), run_key(RUN, step, "rollouts.json"), n=4,
                           temperature=1.0, max_new_tokens=12, seed=1234)


def _samples(service: RolloutService, step: int) -> list[dict[str, Any]]:
    from infra.storage import get_json

    return get_json(service.store, run_key(RUN, step, "rollouts.json"))["samples"]


def _wait(path: Path, timeout: float = 120.0) -> dict[str, Any]:
    import json

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear")


def test_worker_killed_mid_batch_is_restarted_and_the_batch_is_the_same(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Replays the fault "rollout worker dies mid-batch": the worker serving version 2 is SIGKILLed
    while it holds the rollout request of step 2. The call returns the batch a live worker returns
    for the same prompts and seed (sampled at temperature 1, token for token, log-probs and
    version included), from a new worker process that serves version 2 again."""
    for k, v in pause_env(["rollout@2"], tmp_path / "paused").items():
        monkeypatch.setenv(k, v)
    cfg = _config(max_restarts=2)
    store = open_store(str(tmp_path / "store"))
    _publish_two_versions(cfg, store)
    reports: list[str] = []
    service = RolloutService(cfg, RUN, store, tmp_path / "run", report=reports.append)
    service.start()
    try:
        assert service.load(2)["version"] == 2
        undisturbed = _rollout(service, 1)
        first_pid = service.pid
        got: dict[str, Any] = {}
        call = threading.Thread(target=lambda: got.update(_rollout(service, 2)))
        call.start()
        paused = _wait(tmp_path / "paused" / "rollout@2.json")
        assert paused["pid"] == first_pid
        assert not store.exists(run_key(RUN, 2, "rollouts.json"))  # nothing generated yet: mid-batch
        os.kill(first_pid, signal.SIGKILL)
        call.join(timeout=300)
        assert not call.is_alive()
        assert got["version"] == undisturbed["version"] == 2 and got["samples"] == undisturbed["samples"]
        assert _samples(service, 2) == _samples(service, 1)
        assert service.restarts == 1 and service.pid != first_pid
        assert service.version() == 2
        assert any("rollout worker died" in r and "restart 1/2" in r for r in reports), reports
    finally:
        service.close()


def test_worker_restarts_are_bounded(tmp_path: Path) -> None:
    """Replays the fault "rollout worker keeps dying": with ``rollout.max_restarts=1`` the first
    death is survived (the next call restarts it with its version) and the second fails the call
    with one line that says so, not retryable."""
    cfg = _config(max_restarts=1)
    store = open_store(str(tmp_path / "store"))
    _publish_two_versions(cfg, store)
    service = RolloutService(cfg, RUN, store, tmp_path / "run")
    service.start()
    try:
        service.load(2)
        os.kill(service.pid, signal.SIGKILL)
        assert _rollout(service, 1)["version"] == 2 and service.restarts == 1
        os.kill(service.pid, signal.SIGKILL)
        with pytest.raises(RolloutRestartsExhausted) as err:
            _rollout(service, 2)
        assert not err.value.retryable
        assert "max_restarts=1" in str(err.value) and "\n" not in str(err.value)
    finally:
        service.close()


def test_flow_survives_worker_killed_mid_batch(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Replays the fault inside a real run (sync mode): the worker is SIGKILLed while it holds step
    3's rollout request. The run finishes; step 3's samples are the undisturbed run's, token for
    token, and so is everything trained (per step records, final weights and optimizer state)."""
    ref = reference(tmp_path_factory, "sync")
    root = tmp_path / "runs"
    proc, pids = start_paused(root, "sync", ["rollout@3"], tmp_path / "paused")
    try:
        os.kill(pids["rollout@3"], signal.SIGKILL)  # the worker alone; the flow goes on
        assert proc.wait(timeout=600) == 0, (root.parent / "paused-rollout@3.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            kill_tree(proc, root)
    err = (root.parent / "paused-rollout@3.log").read_text()
    assert "rollout worker died" in err and "restart 1/" in err, err[-3000:]
    assert (root / run_id(root) / "summary.json").exists()
    assert step_doc(root, 3, "rollouts.json")["samples"] == step_doc(ref, 3, "rollouts.json")["samples"]
    assert trained(root) == trained(ref)
    assert_same_weights(final_weights(root), final_weights(ref))
