"""Capacity limits (``flows/capacity.py``) against a real Prefect server (``prefect_test_harness``).

Flows that hold capacity around a wait on an event stand in for training and gate runs, so the
order in which they get their slots is exact: a waiting eval-gate run goes before a training run
that waited longer; a missing limit is created with one slot; a limit of 0 fails at once; slots
come back when the block ends, also by an exception.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import pytest
from prefect import flow

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def harness() -> Iterator[None]:
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _limit(name: str) -> Any:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        return c.read_global_concurrency_limit_by_name(name)


def _set(name: str, size: int) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as c:
        try:
            c.read_global_concurrency_limit_by_name(name)
            c.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=size, active_slots=0))
        except ObjectNotFound:
            c.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=size))


def _until(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


@flow(name="capacity-holder")
def _holder(kind: str, label: str, go: Any, events: Any) -> None:  # Any: Prefect would copy a typed list
    from flows.capacity import hold_capacity

    with hold_capacity(kind, poll=0.2):
        events.append(("start", label))
        go.wait(60)
        events.append(("end", label))


def _start(kind: str, label: str, events: list[tuple[str, str]]) -> tuple[threading.Thread, threading.Event]:
    go = threading.Event()

    def run() -> None:
        try:
            _holder(kind, label, go, events)
        except BaseException as exc:  # shown in the assertion on the event order
            events.append(("error", f"{label}: {exc!r}"))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, go


def test_waiting_gate_goes_before_waiting_training(harness: None) -> None:
    from flows.capacity import GATES_WAITING, ROLLOUT_SLOTS, TRAINER_SLOTS

    _set(TRAINER_SLOTS, 1)
    _set(ROLLOUT_SLOTS, 1)
    events: list[tuple[str, str]] = []
    first, go_first = _start("train", "first", events)
    _until(lambda: ("start", "first") in events)
    train, go_train = _start("train", "train", events)
    _until(lambda: _limit(TRAINER_SLOTS).active_slots == 1 and len(events) == 1)
    time.sleep(1.0)  # the training run has polled and found the cluster full
    gate, go_gate = _start("gate", "gate", events)
    _until(lambda: _limit(GATES_WAITING).active_slots == 1)
    go_first.set()
    _until(lambda: ("start", "gate") in events)
    time.sleep(1.0)  # the training run keeps waiting while the gate holds rollout-slots
    assert ("start", "train") not in events
    assert _limit(GATES_WAITING).active_slots == 0  # the gate stopped counting as waiting
    go_gate.set()
    _until(lambda: ("start", "train") in events)
    go_train.set()
    for t in (first, train, gate):
        t.join(60)
    assert events == [("start", "first"), ("end", "first"), ("start", "gate"), ("end", "gate"),
                      ("start", "train"), ("end", "train")]
    assert _limit(TRAINER_SLOTS).active_slots == 0 and _limit(ROLLOUT_SLOTS).active_slots == 0


def test_gate_arriving_between_check_and_take_still_goes_first(harness: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The training run checks for waiting gates and then takes its slots, in two requests: a gate
    that begins to wait between them (forced here: its marker is taken just before the training
    run's take) still goes first; the training run gives its slots back and starts after the gate."""
    import flows.capacity as capacity
    from prefect.client.orchestration import get_client

    _set(capacity.TRAINER_SLOTS, 1)
    _set(capacity.ROLLOUT_SLOTS, 1)
    real_take = capacity._take
    markers: list[Any] = []

    def take_after_a_gate_arrives(client: Any, names: list[str], holder: Any) -> Any:
        if names != [capacity.GATES_WAITING] and not markers:
            markers.append(real_take(client, [capacity.GATES_WAITING], None))
        return real_take(client, names, holder)

    monkeypatch.setattr(capacity, "_take", take_after_a_gate_arrives)
    events: list[tuple[str, str]] = []
    train, go_train = _start("train", "train", events)
    _until(lambda: bool(markers))
    time.sleep(1.0)  # several polls with the gate waiting
    assert events == []
    assert _limit(capacity.TRAINER_SLOTS).active_slots == 0 and _limit(capacity.ROLLOUT_SLOTS).active_slots == 0
    with get_client(sync_client=True) as c:
        c.release_concurrency_slots_with_lease(markers[0])  # the gate got its capacity and ran
    _until(lambda: ("start", "train") in events)
    go_train.set()
    train.join(60)
    assert events == [("start", "train"), ("end", "train")]
    assert _limit(capacity.TRAINER_SLOTS).active_slots == 0 and _limit(capacity.ROLLOUT_SLOTS).active_slots == 0


def test_missing_limit_is_created_with_one_slot_and_released_on_error(harness: None) -> None:
    from prefect.client.orchestration import get_client

    from flows.capacity import ROLLOUT_SLOTS, hold_capacity

    with get_client(sync_client=True) as c:
        c.delete_global_concurrency_limit_by_name(ROLLOUT_SLOTS)

    @flow(name="capacity-fails")
    def fails() -> None:
        with hold_capacity("gate", poll=0.2):
            assert _limit(ROLLOUT_SLOTS).active_slots == 1
            raise RuntimeError("the run failed")

    with pytest.raises(RuntimeError, match="the run failed"):
        fails()
    limit = _limit(ROLLOUT_SLOTS)
    assert (limit.limit, limit.active_slots) == (1, 0)


def test_zero_slots_fails_at_once(harness: None) -> None:
    from flows.capacity import ROLLOUT_SLOTS, TRAINER_SLOTS, CapacityError, hold_capacity

    _set(ROLLOUT_SLOTS, 1)
    _set(TRAINER_SLOTS, 0)

    @flow(name="capacity-zero")
    def zero() -> None:
        with hold_capacity("train"):
            pass

    t0 = time.monotonic()
    with pytest.raises(CapacityError, match="trainer-slots.*0 slots"):
        zero()
    assert time.monotonic() - t0 < 60
    assert _limit(ROLLOUT_SLOTS).active_slots == 0
    _set(TRAINER_SLOTS, 1)
