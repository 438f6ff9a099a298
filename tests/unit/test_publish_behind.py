"""The broadcast placement's publish after the send (:mod:`infra.train.publish_behind`): a version is
published exactly once whoever settles it first, a failed publish is tried again and a version that
cannot be published stays pending until it is, never skipped."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from infra.train.publish_behind import PublishBehind


class Store:
    """Records each publish; fails the first ``fail`` calls; each call may wait on ``gate``."""

    def __init__(self, fail: int = 0, gate: threading.Event | None = None) -> None:
        self.fail, self.gate = fail, gate
        self.calls: list[str] = []  # the thread each publish ran on

    def publish(self, tensors: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(10)
        if len(self.calls) <= self.fail:
            raise OSError(f"store down (call {len(self.calls)})")
        return {"version": tensors["v"], "bytes_written": 10}


def test_started_publish_runs_on_its_own_thread_and_settle_waits_for_it() -> None:
    gate = threading.Event()
    store = Store(gate=gate)
    behind = PublishBehind(3, {"v": 3}, store.publish)
    behind.start()
    done: list[dict[str, Any]] = []
    waiter = threading.Thread(target=lambda: done.append(behind.settle()))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not done  # settle waits while the upload is held
    gate.set()
    waiter.join(10)
    assert done == [{"version": 3, "bytes_written": 10}]
    assert store.calls == ["publish-behind-v3"]
    behind.start()  # settled: starting again publishes nothing more
    assert behind.settle() == done[0] and store.calls == ["publish-behind-v3"]


def test_settle_before_start_publishes_in_the_callers_thread_once() -> None:
    store = Store()
    behind = PublishBehind(1, {"v": 1}, store.publish)
    assert behind.settle()["version"] == 1
    behind.start()
    assert behind.settle()["version"] == 1
    assert store.calls == [threading.current_thread().name]


def test_failed_publish_is_tried_again_when_settled() -> None:
    store = Store(fail=1)
    behind = PublishBehind(2, {"v": 2}, store.publish)
    behind.start()
    assert behind.settle()["version"] == 2
    assert store.calls == ["publish-behind-v2", threading.current_thread().name]


def test_a_version_that_cannot_be_published_stays_pending_until_it_is() -> None:
    store = Store(fail=3)
    behind = PublishBehind(5, {"v": 5}, store.publish)
    behind.start()
    with pytest.raises(OSError, match="call 2"):  # the thread's try and the settle's try
        behind.settle()
    with pytest.raises(OSError, match="call 3"):  # still pending: the next settle tries once more
        behind.settle()
    assert behind.settle()["version"] == 5  # the store is back
    assert len(store.calls) == 4


class _Trainer:
    """The state :class:`~infra.train.broadcast_ops.BroadcastOps` reads on rank 0 of a one-rank group,
    with a store that is down for the first ``down`` publishes."""

    def __init__(self, down: int) -> None:
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(weight_sync=SimpleNamespace(placement="broadcast"))
        self.rank, self.world, self.down = 0, 1, down
        self.committed: list[list[str]] = []  # the tensor names of each publish that reached the store

    def _publish_tensors(self, tensors: dict[str, Any], t0: float) -> dict[str, Any]:
        if self.down:
            self.down -= 1
            raise OSError("store unreachable")
        self.committed.append(sorted(tensors))
        return {"kind": "delta", "bytes_written": 6}


def test_trainer_op_fails_retryably_and_the_version_is_published_on_a_later_op() -> None:
    from infra.errors import is_retryable
    from infra.train.broadcast_ops import BroadcastOps, PublishBehindFailed

    class Trainer(_Trainer, BroadcastOps):
        pass

    import torch

    trainer = Trainer(down=2)
    rec = trainer._bc_defer(4, {"w": torch.zeros(3, dtype=torch.bfloat16)}, 0.0)
    assert rec["kind"] == "behind" and rec["version"] == 4 and rec["bytes_written"] is None and rec["raw_bytes"] == 6
    trainer._bc_behind.start()  # after the send; it fails on its thread, and once more in settle
    with pytest.raises(PublishBehindFailed, match="weight version 4: OSError: store unreachable") as err:
        trainer._bc_settle()
    assert is_retryable(err.value) and trainer.committed == []
    assert trainer._bc_settle() == {"kind": "delta", "bytes_written": 6}  # the next op: the store is back
    assert trainer.committed == [["w"]] and trainer._bc_settle() is None  # nothing pending any more
