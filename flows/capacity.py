"""Cluster capacity as Prefect global concurrency limits: a run queues for its slots, visibly.

A training run (``rl-train``, also as the subflow of ``retrain``) holds one slot of ``trainer-slots``
and one of ``rollout-slots``; an ``eval-gate`` run holds one of ``rollout-slots`` (it only runs
inference). The slots are taken before the run creates anything (run folder, MLflow run, services)
and given back after teardown, on success, failure or cancellation.

Leak-proof: slots are taken with a **lease** (``POST /v2/concurrency_limits/increment-with-lease``,
``LEASE_SECONDS``) that a thread of the run renews (Prefect's ``maintain_concurrency_lease``). A run
that dies without releasing (SIGKILL, OOM, host lost) stops renewing; the server's repossessor
service frees the slots when the lease expires (after ``LEASE_SECONDS`` + its loop, 15 s by
default). A failed renewal only warns: a long training run is not killed for a server hiccup.

Priority: eval-gate runs go before training. A gate that has to wait holds a slot of
``eval-gates-waiting`` (a leased counter, visible on the Concurrency page) until it gets its
capacity; a training run does not try to take slots while that counter is above zero, and gives
back at once slots it took while a gate began to wait (the check and the take are two requests, so
a gate that arrives between them still goes first). A gate never preempts a running training run;
it is next.

Waiting is visible: the acquisition is a task run named after what it waits for
(``waiting for capacity: trainer-slots 1/1 in use``), the flow run carries the tag
``waiting-for-capacity`` while it waits, and a progress line (Prefect log + ``deltaloop`` stderr)
repeats every ``REPORT_SECONDS``.

Sizes are the operator's (``prefect gcl update trainer-slots --limit 2``). A missing limit is
created with 1 slot (one run at a time: the safe default for one cluster); a limit of 0 fails the
run at once (``CapacityError``: it could never start); a disabled limit is not enforced. Without a
Prefect server (``PREFECT_API_URL`` unset: ``deltaloop run`` on Prefect's ephemeral server, which
keeps leases in its own memory and runs no repossessor) capacity is not enforced and one line says so.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator
from uuid import UUID

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.concurrency._leases import maintain_concurrency_lease
from prefect.context import FlowRunContext
from prefect.exceptions import MissingContextError, ObjectAlreadyExists, ObjectNotFound, PrefectHTTPStatusError
from prefect.settings import get_current_settings

from infra.errors import DeltaloopError
from infra.stages.context import console

TRAINER_SLOTS = "trainer-slots"
ROLLOUT_SLOTS = "rollout-slots"
GATES_WAITING = "eval-gates-waiting"
NEEDS: dict[str, tuple[str, ...]] = {"train": (TRAINER_SLOTS, ROLLOUT_SLOTS), "gate": (ROLLOUT_SLOTS,)}
LEASE_SECONDS = 60.0  # the server's minimum lease: a dead run's slots come back soonest
POLL_SECONDS = 5.0
REPORT_SECONDS = 30.0
WAITING_TAG = "waiting-for-capacity"


class CapacityError(DeltaloopError):
    """A capacity limit no run can ever get (size 0): fail now instead of waiting forever."""


def enforced() -> bool:
    """True when runs talk to a Prefect server (``PREFECT_API_URL``), where limits are shared."""
    return bool(get_current_settings().api.url)


@contextmanager
def hold_capacity(kind: str, poll: float = POLL_SECONDS) -> Iterator[list[str]]:
    """Wait for and hold the slots a ``kind`` run needs (``train`` or ``gate``, see ``NEEDS``).

    Yields the limit names held (empty when not enforced); releases them on exit, however the
    block ends. Raises :class:`CapacityError` for a limit of size 0."""
    if kind not in NEEDS:
        raise ValueError(f"unknown capacity kind {kind!r}; known: {sorted(NEEDS)}")
    if not enforced():
        _say("capacity: not enforced (no Prefect server: PREFECT_API_URL is unset)")
        yield []
        return
    with get_client(sync_client=True) as client:
        names = _enforced_limits(client, NEEDS[kind])
        usage = _usage(client, names)
    if not names:
        yield []
        return
    busy = any(used >= size for used, size in usage.values())
    title = f"waiting for capacity: {_describe(usage)}" if busy else f"capacity: {', '.join(names)}"
    lease = acquire_capacity.with_options(task_run_name=title)(kind, names, poll)
    try:
        with maintain_concurrency_lease(lease, LEASE_SECONDS, raise_on_lease_renewal_failure=False):
            yield names
    finally:
        with get_client(sync_client=True) as client:
            client.release_concurrency_slots_with_lease(lease)
        _say(f"capacity released: {', '.join(names)}")


@task(name="acquire-capacity", cache_policy=NO_CACHE)
def acquire_capacity(kind: str, names: list[str], poll: float = POLL_SECONDS) -> UUID:
    """Take one slot of each limit in ``names`` with a lease, waiting (and saying so) while they are
    in use or, for training, while an eval-gate run waits; returns the lease id."""
    with get_client(sync_client=True) as client:
        marker = _take(client, [GATES_WAITING], _holder()) if kind == "gate" else None
        waited, last = False, float("-inf")
        try:
            while True:
                gates = 0 if kind == "gate" else _gates_waiting(client)
                lease = None if gates else _take(client, names, _holder())
                late = _gates_waiting(client) if lease is not None and kind != "gate" else 0
                if late:  # a gate began waiting between the check and the take (two requests):
                    client.release_concurrency_slots_with_lease(lease)  # undone; the gate goes first
                    lease, gates = None, late
                if lease is not None:
                    _say(f"capacity acquired: {', '.join(names)}")
                    return lease
                if not waited:
                    _tag_waiting(client, True)
                    waited = True
                if time.monotonic() - last >= REPORT_SECONDS:
                    ahead = f"; {gates} eval-gate run(s) ahead" if gates else ""
                    _say(f"waiting for capacity: {_describe(_usage(client, names))}{ahead}")
                    last = time.monotonic()
                if marker is not None:
                    client.renew_concurrency_lease(marker, LEASE_SECONDS)
                time.sleep(poll)
        finally:
            if marker is not None:
                client.release_concurrency_slots_with_lease(marker)
            if waited:
                _tag_waiting(client, False)


def _enforced_limits(client: Any, names: tuple[str, ...]) -> list[str]:
    """The limits among ``names`` that are enforced; creates missing ones (1 slot) and the gate counter."""
    _ensure(client, GATES_WAITING, 10_000, quiet=True)
    kept = []
    for name in names:
        limit = _ensure(client, name, 1)
        if not limit.active:
            _say(f"capacity: limit {name} is disabled, not enforced")
        elif limit.limit == 0:
            raise CapacityError(f"capacity limit {name!r} has 0 slots, so no run can ever start; "
                                f"set a size: prefect gcl update {name} --limit 1")
        else:
            kept.append(name)
    return kept


def _ensure(client: Any, name: str, size: int, quiet: bool = False) -> Any:
    """The limit ``name``, created with ``size`` slots when missing."""
    try:
        return client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=size))
            if not quiet:
                _say(f"capacity: created limit {name} with {size} slot(s); resize: prefect gcl update {name} --limit N")
        except ObjectAlreadyExists:  # another run created it first
            pass
        return client.read_global_concurrency_limit_by_name(name)


def _take(client: Any, names: list[str], holder: ConcurrencyLeaseHolder | None) -> UUID | None:
    """One slot of each limit under one lease, or None when any is full (the server's 423)."""
    try:
        r = client.increment_concurrency_slots_with_lease(names, 1, "concurrency", LEASE_SECONDS, holder)
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code == 423:
            return None
        raise
    return UUID(r.json()["lease_id"])


def _usage(client: Any, names: list[str]) -> dict[str, tuple[int, int]]:
    """``name -> (slots in use, size)``."""
    out = {}
    for name in names:
        limit = client.read_global_concurrency_limit_by_name(name)
        out[name] = (limit.active_slots, limit.limit)
    return out


def _gates_waiting(client: Any) -> int:
    """How many eval-gate runs wait for capacity now (slots of ``GATES_WAITING`` in use)."""
    return _usage(client, [GATES_WAITING])[GATES_WAITING][0]


def _describe(usage: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{name} {used}/{size} in use" for name, (used, size) in usage.items())


def _holder() -> ConcurrencyLeaseHolder | None:
    ctx = FlowRunContext.get()
    return ConcurrencyLeaseHolder(type="flow_run", id=ctx.flow_run.id) if ctx and ctx.flow_run else None


def _tag_waiting(client: Any, on: bool) -> None:
    """Add or remove the ``waiting-for-capacity`` tag of this flow run (shown in the UI's run lists)."""
    ctx = FlowRunContext.get()
    if not (ctx and ctx.flow_run):
        return
    tags = set(client.read_flow_run(ctx.flow_run.id).tags)
    client.update_flow_run(ctx.flow_run.id, tags=sorted(tags | {WAITING_TAG} if on else tags - {WAITING_TAG}))


def _say(msg: str) -> None:
    """A progress line on ``deltaloop``'s stderr and in the run's Prefect log (the UI)."""
    console(msg)
    try:
        get_run_logger().info(msg)
    except MissingContextError:  # outside a flow or task run: the stderr line is enough
        pass
