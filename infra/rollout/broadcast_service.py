"""The rollout service of ``weight_sync.placement: broadcast``: versions travel from trainer rank 0 to
the rollout worker as a collective of their own group (:mod:`infra.weightsync.broadcast`), not
through the object store.

- :meth:`BroadcastRolloutService.bind_trainer` (provision, and after a trainer restart): trainer rank
  0 hosts a fresh group (``broadcast_open``), then rank 0 (``broadcast_join``) and the worker
  (``POST /v1/broadcast/join``) join it at the same time. A bind that fails raises: the run's
  network does not let them meet.
- :meth:`BroadcastRolloutService.load` runs ``broadcast_send`` on the trainer and ``POST
  /v1/broadcast/load`` on the worker at the same time; the answer is the worker's, the record shape
  of the object-store placement (``version``, ``seconds``, ``applied``, and ``requested``, ``error``,
  ``retryable`` when not applied) plus ``via``, ``bytes`` (on the wire for this worker) and
  ``wall_seconds``. A version the trainer does not hold (a resumed run's first load) comes from the
  store.
- The trainer still publishes every version to the object store, right after sending it
  (:mod:`infra.train.publish_behind`): checkpoints and resume, ``deltaloop sync fetch`` and a
  replaced worker read them there. So when the group breaks (a worker or the trainer died
  mid-version; each side gives up after ``weight_sync.broadcast_timeout_s``), the version is loaded
  from the store instead, waiting up to that timeout for its upload to commit, the line is
  reported, and the next load binds a fresh group first. A dead worker is replaced as in the
  object-store placement (:meth:`~infra.rollout.service.RolloutService.restart`: the version the dead
  one served, from the store), and the next load forms a fresh group first.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from infra.errors import DeltaloopError
from infra.proc import ServiceDied, summarize
from infra.rollout.errors import RolloutError
from infra.rollout.service import RolloutService


class BroadcastBindFailed(RolloutError):
    """Trainer rank 0 and the rollout worker could not form their broadcast group (retryable: a
    fresh group may form once both answer)."""

    retryable = True


class BroadcastRolloutService(RolloutService):
    """One rollout worker fed by trainer rank 0 over a broadcast group."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trainer: Any = None
        self.bound = False
        self.broadcast_fallbacks = 0  # versions that came from the store because the group had broken

    @property
    def timeout_s(self) -> float:
        return float(self.cfg.weight_sync.broadcast_timeout_s)

    @property
    def store_wait_s(self) -> float:  # type: ignore[override]
        """A version reaches the store after it was sent: the store's copy may still be uploading."""
        return self.timeout_s

    def bind_trainer(self, trainer: Any) -> None:
        """Form a fresh group of ``trainer``'s rank 0 and the worker (raises :class:`BroadcastBindFailed`)."""
        self.trainer = trainer
        self.bound = False
        self._bind()

    def _bind(self) -> None:
        addr = self.trainer.call("broadcast_open", world=2, group_timeout_s=self.timeout_s)["address"]
        joined: dict[str, Any] = {}
        with ThreadPoolExecutor(1, thread_name_prefix="broadcast-join") as pool:
            fut = pool.submit(self.trainer.call, "broadcast_join", timeout_s=self.timeout_s + 60)
            try:
                joined = self._post("/v1/broadcast/join", {"address": addr, "rank": 1}, timeout=self.timeout_s + 60)
            finally:
                trainer_error = _error_of(fut)
        if not joined.get("joined"):
            raise BroadcastBindFailed(f"rollout worker could not join the broadcast group at {addr['host']}:"
                                      f"{addr['port']}: {joined.get('error')}")
        if trainer_error is not None:
            raise BroadcastBindFailed(f"trainer rank 0 could not join the broadcast group: {summarize(str(trainer_error))}")
        self.bound = True

    def restart(self, reason: str, generation: int | None = None) -> None:
        """Replace a dead worker (the version it served, from the store); the next :meth:`load` binds the
        new one. Not here: a rollout call may run while the trainer trains (``loop.mode: async``), and
        the trainer's control channel carries one call at a time; a load never overlaps a trainer call."""
        super().restart(reason, generation)
        self.bound = False

    def _try_bind(self, who: str) -> bool:
        try:
            self._bind()
            return True
        except (DeltaloopError, OSError) as exc:
            self.report(f"{who} could not join a broadcast group ({summarize(str(exc))}); "
                        "versions come from the object store until it can")
            return False

    def load(self, version: int | None = None) -> dict[str, Any]:
        """Make the worker serve ``version`` (received from trainer rank 0; see the module doc)."""
        if version is None or self.trainer is None:
            return super().load(version)
        if self.served is not None and version <= self.served:  # the worker answers (409 when older)
            return super().load(version) if version < self.served else \
                {"version": version, "seconds": 0.0, "applied": False, "via": "broadcast", "bytes": 0}
        while True:
            if not self.bound and not self._try_bind("the rollout worker"):
                return self._from_store(version, "no broadcast group")
            generation = self._generation
            t0 = time.perf_counter()
            try:
                res, sent = self._exchange(version)
            except ServiceDied as exc:  # the worker's call failed: replace a dead worker, then again
                self.bound = False
                if self._closed or not self._gone():
                    raise
                self.restart(str(exc), generation)
                continue
            if sent is None or (res.get("applied") is False and res.get("via") == "broadcast"
                                and res.get("error")):
                self.bound = False
                if int(res.get("version", -1)) != version:
                    return self._from_store(version, res.get("error") or "trainer rank 0 failed to send")
            self.served = int(res["version"])
            return {**res, "wall_seconds": time.perf_counter() - t0,
                    "sent_bytes": (sent or {}).get("bytes", 0)}

    def _exchange(self, version: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Trainer rank 0 sends while the worker receives; (the worker's answer, the sender's record or
        None when the send failed)."""
        with ThreadPoolExecutor(1, thread_name_prefix="broadcast-send") as pool:
            fut = pool.submit(self.trainer.call, "broadcast_send", version=version, timeout_s=3600.0)
            try:
                res = self._post("/v1/broadcast/load", {"version": version})
            finally:
                error = _error_of(fut)
        if error is not None:
            return res, None
        return res, fut.result()

    def _from_store(self, version: int, why: str) -> dict[str, Any]:
        """The version from the object store (the trainer published it there too)."""
        self.broadcast_fallbacks += 1
        self.report(f"weight version {version} from the object store: the broadcast group failed ({summarize(why)})")
        return {**RolloutService.load(self, version), "via": "object_store", "broadcast_error": why}


def _error_of(fut: "Future[Any]") -> BaseException | None:
    """Wait for ``fut``; the exception it ended with (a project error or a lost service), else None."""
    try:
        fut.result()
    except (DeltaloopError, OSError) as exc:
        return exc
    return None
