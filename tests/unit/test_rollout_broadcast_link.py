"""The rollout worker's side of the broadcast placement (:mod:`infra.rollout.broadcast_link`), with
the real worker in this process and trainer rank 0 played by a :class:`~infra.weightsync.broadcast.Sender`:
versions land bit-exact in the served model, the stale-weight rules of the object-store path hold
(older refused, the same one not applied again), a version the sender does not hold comes from the
store, a layout that does not fit is reported while the old version keeps serving, and bad input is
refused before any collective."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from infra.config import load_config  # noqa: E402
from infra.model import publishable_state  # noqa: E402
from infra.rollout.errors import BadRequest, ControlRefused  # noqa: E402
from infra.rollout.server import RolloutWorker  # noqa: E402
from infra.specs import RolloutSpec  # noqa: E402
from infra.storage import FileStore, run_key  # noqa: E402
from infra.weightsync import VersionPublisher  # noqa: E402
from infra.weightsync.broadcast import BroadcastGroup, Sender, open_rendezvous  # noqa: E402

OVERRIDES = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2",
             "model.tiny.intermediate_size=64", "rollout.threads=1", "weight_sync.placement=broadcast"]


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[RolloutWorker]:
    n = torch.get_num_threads()
    store = FileStore(tmp_path / "store")
    yield RolloutWorker(RolloutSpec.build(load_config(None, OVERRIDES), "r", store.uri))
    torch.set_num_threads(n)  # the worker set its process's thread count


def _states(worker: RolloutWorker, n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    out = [publishable_state(worker.engine.model)]
    for _ in range(n - 1):
        out.append({k: (t.float() + 0.02 * torch.randn(t.shape, generator=g)).to(torch.bfloat16)
                    for k, t in out[-1].items()})
    return out


def _served_is(worker: RolloutWorker, state: dict[str, Any]) -> bool:
    served = publishable_state(worker.engine.model)
    return all(torch.equal(served[k].view(torch.int16), state[k].view(torch.int16)) for k in state)


def _join(worker: RolloutWorker) -> Sender:
    rv = open_rendezvous("127.0.0.1", "127.0.0.1", 2, 20.0)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(worker.broadcast.join, rv.address.to_json(), 1)
        group = BroadcastGroup(rv.address, 0, "127.0.0.1", store=rv.store)
        assert fut.result()["joined"] is True
    return Sender(group, bucket_bytes=8192)


def _load(worker: RolloutWorker, sender: Sender, version: int, tensors: dict[str, Any] | None) -> Any:
    """The worker's load and the sender's send at the same time; the worker's answer (or its error)."""
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(worker.broadcast.load, version)
        sender.send(version, tensors)
        return fut.result()


def test_versions_rules_and_fallback(worker: RolloutWorker, tmp_path: Path) -> None:
    states = _states(worker, 4)
    sender = _join(worker)
    for v in (1, 2):
        res = _load(worker, sender, v, states[v - 1])
        assert res["applied"] is True and res["version"] == v and res["via"] == "broadcast"
        assert worker.version == v and _served_is(worker, states[v - 1])
    with pytest.raises(ControlRefused, match="older") as info:
        _load(worker, sender, 1, states[0])
    assert info.value.status == 409 and worker.refused_older == 1 and _served_is(worker, states[1])
    same = _load(worker, sender, 2, states[1])
    assert same["applied"] is False and same["version"] == 2

    # version 3 is not held by the sender (a resumed trainer): the worker takes it from the store
    pub = VersionPublisher(FileStore(tmp_path / "store"), run_key("r", None, "weights"))
    for s in states[:3]:
        pub.publish(s)
    res = _load(worker, sender, 3, None)
    assert res["applied"] is True and res["version"] == 3 and res["via"] == "object_store"
    assert _served_is(worker, states[2])


def test_a_layout_that_does_not_fit_keeps_the_served_version(worker: RolloutWorker) -> None:
    states = _states(worker, 2)
    sender = _join(worker)
    assert _load(worker, sender, 1, states[0])["applied"] is True
    wrong = {("renamed." + k if i == 0 else k): t for i, (k, t) in enumerate(states[1].items())}
    res = _load(worker, sender, 2, wrong)
    assert res["applied"] is False and res["version"] == 1 and res["retryable"] is False
    assert "do not fit this model" in res["error"] and worker.load_failures == 1 and _served_is(worker, states[0])
    res = _load(worker, sender, 2, states[1])  # the group is still in step: the right tensors land
    assert res["applied"] is True and _served_is(worker, states[1])


def test_bad_input_is_refused_before_any_collective(worker: RolloutWorker) -> None:
    with pytest.raises(ControlRefused, match="no broadcast group") as info:
        worker.broadcast.load(1)
    assert info.value.status == 409
    with pytest.raises(BadRequest, match="port"):
        worker.broadcast.join({"host": "127.0.0.1", "port": 0, "world": 2, "prefix": "ab", "timeout_s": 5}, 1)
    with pytest.raises(BadRequest, match="receiver rank 2 outside"):
        worker.broadcast.join({"host": "127.0.0.1", "port": 9, "world": 2, "prefix": "ab", "timeout_s": 5}, 2)


def test_broadcast_with_vllm_is_refused_at_config_validation() -> None:
    from infra.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="weight_sync.placement 'broadcast' needs rollout.type 'local'"):
        load_config(None, ["weight_sync.placement=broadcast", "rollout.type=vllm"])
