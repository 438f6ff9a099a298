"""The rollout worker's side of ``weight_sync.placement: broadcast`` (``POST /v1/broadcast/join`` and
``POST /v1/broadcast/load`` of :mod:`infra.rollout.server`).

The worker joins the group trainer rank 0 hosts (:mod:`infra.weightsync.broadcast`) as a receiver;
joining again drops the previous group (a replaced trainer, a rebind after a failure). A load
receives the version into the receiver's flat bf16 buffer, checks every bucket's digest and hands
views of it to the engine, which copies them into the served model between requests (as a version
from the object store: :meth:`~infra.rollout.local.LocalEngine.load_weights`). The same stale-weight
rules hold: a version older than the one served is refused (409, after the collective, which every
rank must finish), the one served already is not applied again, and a version that fails (the group
broke, bits differ) leaves the served one in place and says so (``applied: false``, ``error``,
``retryable``). When the trainer does not hold the requested version (a resumed run's first load),
the worker loads it from the object store instead (``via: object_store``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from infra.rollout.errors import ControlRefused

log = logging.getLogger(__name__)


def device_host(bind: str) -> str:
    """The address a broadcast group member's connections use: loopback when its service binds
    loopback (a local cluster), else the host's own address (:func:`infra.rpc.host_address`, as for
    the trainer's control channel). Trainer rank 0 and the rollout worker both use it."""
    from infra.rpc import host_address

    return "127.0.0.1" if bind in ("127.0.0.1", "localhost") else host_address()


class BroadcastLink:
    """The worker's membership of a broadcast group (at most one at a time)."""

    def __init__(self, worker: Any, bind: str, max_bytes: int) -> None:
        """``worker``: the :class:`~infra.rollout.server.RolloutWorker` whose engine is fed."""
        self.worker, self.bind, self.max_bytes = worker, bind, max_bytes
        self.receiver: Any = None
        self._lock = threading.Lock()  # join and load, one at a time (the worker lock guards the engine)

    def join(self, address: Any, rank: int) -> dict[str, Any]:
        """Join the group at ``address`` as ``rank`` (blocks until every rank joined, or its timeout)."""
        from infra.rollout.errors import BadRequest
        from infra.weightsync.broadcast import (BadGroupAddress, BroadcastFailed, BroadcastGroup, GroupAddress,
                                                Receiver)

        if self.worker.remote_weights:
            raise ControlRefused("this engine applies versions in its own process: weight_sync.placement "
                                 "'broadcast' needs rollout.type 'local'", 409)
        try:
            addr = GroupAddress.from_json(address)
            if not 1 <= int(rank) < addr.world:
                raise BadGroupAddress(f"receiver rank {rank} outside 1..{addr.world - 1}")
        except BadGroupAddress as exc:
            raise BadRequest(str(exc)) from None
        with self._lock:
            self._drop()
            try:
                group = BroadcastGroup(addr, int(rank), device_host(self.bind))
            except BroadcastFailed as exc:
                return {"joined": False, "error": str(exc), "retryable": True}
            self.receiver = Receiver(group, self.max_bytes)
        return {"joined": True, "rank": int(rank), "world": addr.world}

    def _drop(self) -> None:
        if self.receiver is not None:
            self.receiver.group.close()
            self.receiver = None

    def load(self, version: int) -> dict[str, Any]:
        """Receive ``version`` from the group and serve it (see the module doc for every outcome)."""
        from infra.weightsync.errors import WeightSyncError

        worker = self.worker
        with self._lock:
            if self.receiver is None:
                raise ControlRefused("no broadcast group joined (POST /v1/broadcast/join first)", 409)
            with worker._lock:
                started = time.perf_counter()
                current = worker.version
                try:
                    got = self.receiver.receive(version, self._expected(), drain=bool(current) and version <= current)
                except WeightSyncError as exc:  # the group broke, the layout differs or bits differ
                    return self._failed(version, current, exc, started)
                if got.held and got.tensors is None:  # drained: older than or equal to the one served
                    if version < current:
                        worker._refuse_older(version, current)
                    return {"version": current, "seconds": time.perf_counter() - started, "applied": False,
                            "via": "broadcast", "bytes": got.bytes}
                if got.held:
                    worker._tensors = None  # the store path's base is these views from now on
                    worker.engine.load_weights(got.tensors, version)
                    worker._tensors = got.tensors
                    return {"version": version, "seconds": time.perf_counter() - started, "applied": True,
                            "via": "broadcast", "bytes": got.bytes, "receive_seconds": got.seconds}
        # the trainer does not hold this version: the object store has it (worker lock released)
        return {**worker.load(version), "via": "object_store"}

    def _failed(self, version: int, current: int, exc: Exception, started: float) -> dict[str, Any]:
        """A version that could not be received: the served one stays, the answer says why."""
        from infra.weightsync.broadcast import BroadcastFailed

        worker = self.worker
        worker._tensors = None  # the receive buffer (the store path's base) may be half-written
        if isinstance(exc, BroadcastFailed):
            self._drop()
        worker.load_failures += 1
        worker.last_load_error = str(exc)
        log.warning("rollout worker: broadcast of weight version %d failed, still serving version %d: %s",
                    version, current, exc)
        return {"version": current, "requested": version, "applied": False, "error": str(exc),
                "retryable": bool(getattr(exc, "retryable", False)), "via": "broadcast",
                "seconds": time.perf_counter() - started}

    def _expected(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """What the served model takes: every parameter as bf16, by name."""
        return {n: ("bfloat16", tuple(p.shape)) for n, p in self.worker.engine.model.named_parameters()}
