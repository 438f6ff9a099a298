"""Trainer ops of the ``broadcast`` weight placement (mixed into :class:`infra.train.worker.Trainer`).

Trainer rank 0 is rank 0 of a second, small process group with the rollout workers
(:mod:`infra.weightsync.broadcast`); the trainer's own group is not touched. The flow's rollout
service (:class:`infra.rollout.broadcast_service.BroadcastRolloutService`) drives it:

- ``broadcast_open``: rank 0 drops any previous group and hosts the rendezvous of a new one
  (loopback on a local cluster, the host's address otherwise); returns its address;
- ``broadcast_join``: rank 0 joins it as the sender, while the workers join on their side;
- ``broadcast_send``: send weight version ``version``, the bf16 cast of the current weights (the bits
  the object store has for it); if the trainer holds another version (a resumed run's first load),
  the receivers are told so and take it from the store.

Versions are still published to the object store (checkpoints, resume, a replaced rollout worker's
exact version and ``deltaloop sync fetch`` read them there), but after they are sent: ``train_step``
keeps the version's bf16 tensors on rank 0, ``broadcast_send`` sends them and then starts their
publish on a thread of its own, and every later op that touches the store waits for it first
(:mod:`infra.train.publish_behind`). A broadcast failure (a worker died mid-version) is raised as
:class:`~infra.weightsync.broadcast.BroadcastFailed`, an error of this op: the trainer group itself
keeps running, and the version is published all the same.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from infra.errors import DeltaloopError

if TYPE_CHECKING:
    import torch

    from infra.train.publish_behind import PublishBehind

log = logging.getLogger(__name__)


class PublishBehindFailed(DeltaloopError):
    """The object-store publish of a version already broadcast failed twice. Retryable: the version
    stays pending, and the retried task's first op publishes it again."""

    retryable = True


class BroadcastOps:
    """Ops a trainer rank runs for ``weight_sync.placement: broadcast`` (state on rank 0 only)."""

    _bc_rendezvous: Any = None
    _bc_sender: Any = None
    _bc_behind: "PublishBehind | None" = None  # rank 0: the version sent (or to send) before its publish

    def _bc_defer(self, version: int, tensors: "dict[str, torch.Tensor]", t0: float) -> dict[str, Any]:
        """Rank 0: keep ``version``'s bf16 ``tensors`` to send, publishing them after the send."""
        from infra.train.publish_behind import PublishBehind

        self._bc_behind = PublishBehind(version, tensors,
                                        lambda ts: self._publish_tensors(ts, time.perf_counter()))  # type: ignore[attr-defined]
        return {"version": version, "kind": "behind", "bytes_written": None,
                "raw_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                "seconds": time.perf_counter() - t0, "changed_fraction": None}

    def _bc_settle(self) -> dict[str, Any] | None:
        """Collective (broadcast placement only): wait until the version published behind its broadcast
        is committed; its publish record, or None when none was pending. Every rank raises
        :class:`PublishBehindFailed` when rank 0's publish failed again, so the ranks stay in step."""
        if self.cfg.weight_sync.placement != "broadcast":  # type: ignore[attr-defined]
            return None
        import torch.distributed as dist

        box: list[Any] = [None, None]  # (record, error)
        behind = self._bc_behind
        if behind is not None:
            try:
                box[0] = behind.settle()
                self._bc_behind = None
            except Exception as exc:
                box[1] = f"weight version {behind.version}: {type(exc).__name__}: {exc}"
        if self.world > 1:  # type: ignore[attr-defined]
            dist.broadcast_object_list(box, src=0)
        if box[1] is not None:
            raise PublishBehindFailed(f"broadcast, then not published to the object store (tried twice): {box[1]}")
        return box[0]

    def bc_settle_quietly(self) -> None:
        """Rank 0 at shutdown: finish the pending publish if it can; a failure is logged (no collective)."""
        if self._bc_behind is not None:
            try:
                self._bc_behind.settle()
            except Exception as exc:
                log.error("weight version %d was broadcast but not published before shutdown: %s",
                          self._bc_behind.version, exc)
            self._bc_behind = None

    def _bc_bind(self) -> str:
        return "127.0.0.1" if self.cfg.cluster.type == "local" else "0.0.0.0"  # type: ignore[attr-defined]

    def _bc_close(self) -> None:
        if self._bc_sender is not None:
            self._bc_sender.group.close()
        if self._bc_rendezvous is not None:
            self._bc_rendezvous.close()
        self._bc_sender = self._bc_rendezvous = None

    def op_broadcast_open(self, world: int, group_timeout_s: float) -> dict[str, Any]:
        """Rank 0: host the rendezvous of a fresh group of ``world`` ranks (this one + the workers)."""
        from infra.rollout.broadcast_link import device_host
        from infra.weightsync.broadcast import open_rendezvous

        if self.rank != 0:  # type: ignore[attr-defined]
            return {}
        self._bc_close()
        bind = self._bc_bind()
        self._bc_rendezvous = open_rendezvous(bind, device_host(bind), int(world), float(group_timeout_s))
        return {"address": self._bc_rendezvous.address.to_json()}

    def op_broadcast_join(self) -> dict[str, Any]:
        """Rank 0: join the opened group as its sender; returns once every worker joined (or raises
        :class:`~infra.weightsync.broadcast.BroadcastFailed` after the group's timeout)."""
        from infra.rollout.broadcast_link import device_host
        from infra.weightsync.broadcast import BroadcastFailed, BroadcastGroup, Sender

        if self.rank != 0:  # type: ignore[attr-defined]
            return {}
        rv = self._bc_rendezvous
        if rv is None:
            raise BroadcastFailed("broadcast_join before broadcast_open: no group to join")
        try:
            group = BroadcastGroup(rv.address, 0, device_host(self._bc_bind()), store=rv.store)
        except BroadcastFailed:
            self._bc_close()
            raise
        self._bc_sender = Sender(group)
        return {"joined": True, "world": rv.address.world}

    def op_broadcast_send(self, version: int) -> dict[str, Any]:
        """Collective on the trainer ranks, then rank 0 sends ``version`` to the group: the bf16 tensors
        ``train_step`` kept for it (then starts their publish to the store), or the current weights
        gathered to rank 0 if they are that version and nothing was kept, else a header saying it is
        not held here."""
        import torch
        import torch.distributed as dist

        from infra.weightsync.broadcast import BroadcastFailed

        held = int(version) == self.weights_version  # type: ignore[attr-defined]
        behind = self._bc_behind if self._bc_behind is not None and self._bc_behind.version == int(version) else None
        kept = [behind is not None]
        if self.world > 1:  # type: ignore[attr-defined]
            dist.broadcast_object_list(kept, src=0)
        tensors = behind.tensors if behind is not None else None
        if held and not kept[0]:  # every rank takes part in the gather
            lora = self.cfg.trainer.lora.enabled  # type: ignore[attr-defined]
            tensors = self._publishable() if lora else self.engine.full_params()  # type: ignore[attr-defined]
        if self.rank != 0:  # type: ignore[attr-defined]
            return {}
        try:
            if self._bc_sender is None:
                raise BroadcastFailed("no broadcast group: the rollout workers have not joined one (bind_trainer)")
            if tensors is not None:  # the sender casts into its flat bf16 buffer: the published bits
                tensors = {n: t.detach() for n, t in tensors.items()}
            sent = self._bc_sender.send(int(version), tensors, cast=torch.bfloat16)
            if behind is not None:  # publish from the sender's buffer (untouched until the next send,
                behind.tensors = self._bc_sender.sent_tensors()  # which waits for this publish): one copy less
            return sent
        except BroadcastFailed:
            self._bc_close()
            raise
        finally:  # sent or not, the version goes to the store now (a worker that missed it reads it there)
            if behind is not None:
                behind.start()

    def op_broadcast_close(self) -> dict[str, Any]:
        """Rank 0: drop the group (the workers' side fails its next collective, or is rebound)."""
        if self.rank == 0:  # type: ignore[attr-defined]
            self._bc_close()
        return {}
