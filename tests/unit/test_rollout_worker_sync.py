"""The rollout worker's weight load: deltas patched into its own tensors, recovery after a failure,
and the stale-weight rules of issue #16 (a version it cannot apply is reported while it keeps serving
the one it has; it never moves to an older version)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from infra.config import load_config  # noqa: E402
from infra.model import publishable_state  # noqa: E402
from infra.rollout.server import RolloutWorker  # noqa: E402
from infra.specs import RolloutSpec  # noqa: E402
from infra.storage import FileStore, run_key  # noqa: E402
from infra.weightsync import VersionPublisher  # noqa: E402
from infra.weightsync.layout import version_dir  # noqa: E402

OVERRIDES = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
             "model.tiny.intermediate_size=64", "rollout.threads=1"]


def _states(worker: RolloutWorker, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` successive published states: the worker's model, then small sparse updates of it."""
    g = torch.Generator().manual_seed(0)
    cur = publishable_state(worker.engine.model)
    out = [cur]
    for _ in range(n - 1):
        nxt = {}
        for k, t in cur.items():
            f = t.float()
            mask = torch.rand(f.shape, generator=g) < 0.05
            nxt[k] = (f + mask * 0.05 * torch.randn(f.shape, generator=g)).to(torch.bfloat16)
        out.append(nxt)
        cur = nxt
    return out


def _served(worker: RolloutWorker) -> dict[str, torch.Tensor]:
    return publishable_state(worker.engine.model)


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    """The worker sets torch's thread count for its process; give the next tests theirs back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_worker_applies_deltas_in_place_and_recovers_from_a_failed_fetch(tmp_path: Path,
                                                                        keep_torch_threads: None) -> None:
    cfg = load_config(None, OVERRIDES)
    store_dir = tmp_path / "store"
    store = FileStore(store_dir)
    worker = RolloutWorker(RolloutSpec.build(cfg, "r", store.uri))
    prefix = run_key("r", None, "weights")
    # small delta shards: the corruption below needs a shard object (the last frames ride in the manifest)
    pub = VersionPublisher(store, prefix, snapshot_chain_fraction=100, delta_shard_bytes=1 << 10)
    states = _states(worker, 5)

    pub.publish(states[0])
    assert worker.load(None)["version"] == 1
    held = worker._tensors
    assert held is not None
    ptrs = {k: t.data_ptr() for k, t in held.items()}

    pub.publish(states[1])
    res = worker.load(None)
    assert res["version"] == 2 and res["applied"] and worker.version == 2
    # the delta went into the tensors the worker already held: no new model-sized buffers
    assert {k: t.data_ptr() for k, t in worker._tensors.items()} == ptrs
    for k, t in _served(worker).items():
        assert torch.equal(t, states[1][k]), k

    # version 3's delta is corrupt: every path to it fails, the half-patched tensors are dropped, and
    # the answer says the worker still serves version 2 and why
    pub.publish(states[2])
    shard = next(k for k in store.list(version_dir(prefix, 3) + "/") if k.rsplit("/", 1)[1].startswith("d-"))
    blob = bytearray(store.get(shard))
    blob[len(blob) // 2] ^= 0xFF
    store.put(shard, bytes(blob))
    res = worker.load(3)
    assert res["version"] == 2 and res["requested"] == 3 and not res["applied"]
    assert "version 3" in res["error"] and shard in res["error"]
    assert worker._tensors is None
    assert worker.version == 2  # the engine still serves the last good version
    for k, t in _served(worker).items():
        assert torch.equal(t, states[1][k]), k

    # a snapshot after it loads exactly (the chain through version 3 is broken), and the next delta
    # is in place again
    assert pub.publish(states[3], snapshot=True).snapshot_started
    pub.wait_snapshot()
    assert worker.load(None)["version"] == 4
    ptrs = {k: t.data_ptr() for k, t in worker._tensors.items()}
    pub.publish(states[4])
    assert worker.load(None)["version"] == 5
    assert {k: t.data_ptr() for k, t in worker._tensors.items()} == ptrs
    for k, t in _served(worker).items():
        assert torch.equal(t, states[4][k]), k


def test_worker_reports_a_version_it_cannot_apply_and_never_moves_backwards(
        tmp_path: Path, keep_torch_threads: None, caplog: pytest.LogCaptureFixture) -> None:
    """Replays the stale-weight faults of issue #16 on the worker's real app: the newest version's
    manifest is corrupt (one byte flipped) -> ``/v1/load`` answers 200 with the version still served
    and the reason, a log line says so, and the worker serves on; a load of an older version than
    the one served is refused (409) and counted, and the served version never goes backwards. On the
    code before, the first was an HTTP 500 without the version served, and the second moved the
    worker back."""
    testclient = pytest.importorskip("fastapi.testclient")
    from infra.rollout.guard import control_token
    from infra.rollout.server import build_app

    cfg = load_config(None, OVERRIDES)
    store = FileStore(tmp_path / "store")
    worker = RolloutWorker(RolloutSpec.build(cfg, "r", store.uri))
    token = control_token(bytes(range(32)))
    client = testclient.TestClient(build_app(worker, token))
    auth = {"Authorization": f"Bearer {token}"}
    prefix = run_key("r", None, "weights")
    pub = VersionPublisher(store, prefix, snapshot_chain_fraction=100)
    states = _states(worker, 4)
    for st in states[:3]:
        pub.publish(st)
    assert client.post("/v1/load", json={"version": 3}, headers=auth).json()["version"] == 3

    pub.publish(states[3])
    key = f"{version_dir(prefix, 4)}/manifest.json.zst"
    blob = bytearray(store.get(key))
    blob[6] ^= 0x01
    store.put(key, bytes(blob))
    for body in ({"version": 4}, {"version": None}):
        with caplog.at_level(logging.WARNING, logger="infra.rollout.server"):
            resp = client.post("/v1/load", json=body, headers=auth)
        assert any("cannot apply weight version 4" in r.getMessage() and "serving version 3" in r.getMessage()
                   for r in caplog.records)
        caplog.clear()
        assert resp.status_code == 200, resp.text
        ans = resp.json()
        assert ans["version"] == 3 and ans["requested"] == 4 and ans["applied"] is False
        assert "version 4" in ans["error"] and key in ans["error"]
    assert worker.version == 3
    for k, t in _served(worker).items():
        assert torch.equal(t, states[2][k]), k

    for older in (1, 2):
        resp = client.post("/v1/load", json={"version": older}, headers=auth)
        assert resp.status_code == 409 and f"version {older}" in resp.text and "version 3" in resp.text
    assert worker.version == 3
    health = client.get("/health").json()
    assert health["version"] == 3 and health["refused_older"] == 2 and health["load_failures"] == 2
    assert key in health["last_load_error"]
    assert client.get("/v1/version").json() == {"version": 3}
    client.close()


def test_worker_waits_for_a_version_still_uploading_when_told_to(tmp_path: Path, keep_torch_threads: None) -> None:
    """The broadcast placement publishes a version after sending it: a replaced worker told to load it
    (``wait_s``) waits for its commit; without ``wait_s``, or past it, the version is refused (404)."""
    import threading

    from infra.rollout.errors import ControlRefused

    store = FileStore(tmp_path / "store")
    worker = RolloutWorker(RolloutSpec.build(load_config(None, OVERRIDES), "r", store.uri))
    pub = VersionPublisher(store, run_key("r", None, "weights"))
    states = _states(worker, 2)
    with pytest.raises(ControlRefused, match="not committed"):
        worker.load(1)
    late = threading.Timer(0.5, pub.publish, args=(states[0],))
    late.start()
    try:
        res = worker.load(1, wait_s=30)
    finally:
        late.join()
    assert res["version"] == 1 and res["applied"]
    for k, t in _served(worker).items():
        assert torch.equal(t, states[0][k]), k
    with pytest.raises(ControlRefused, match="version 2 is not committed"):
        worker.load(2, wait_s=0.3)  # never published: refused once the wait is over
    assert worker.version == 1
