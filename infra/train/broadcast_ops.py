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

Versions are still published to the object store by ``train_step`` (checkpoints, resume, a replaced
rollout worker's exact version and ``deltaloop sync fetch`` read them there). A broadcast failure
(a worker died mid-version) is raised as :class:`~infra.weightsync.broadcast.BroadcastFailed`, an
error of this op: the trainer group itself keeps running.
"""

from __future__ import annotations

from typing import Any


class BroadcastOps:
    """Ops a trainer rank runs for ``weight_sync.placement: broadcast`` (state on rank 0 only)."""

    _bc_rendezvous: Any = None
    _bc_sender: Any = None

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
        """Collective on the trainer ranks (their weights are gathered to rank 0 with FSDP/ZeRO-3), then
        rank 0 sends ``version`` to the group: the current weights if they are that version, else a
        header saying it is not held here."""
        import torch

        from infra.weightsync.broadcast import BroadcastFailed

        held = int(version) == self.weights_version  # type: ignore[attr-defined]
        tensors = None
        if held:  # every rank takes part in the gather
            lora = self.cfg.trainer.lora.enabled  # type: ignore[attr-defined]
            tensors = self._publishable() if lora else self.engine.full_params()  # type: ignore[attr-defined]
        if self.rank != 0:  # type: ignore[attr-defined]
            return {}
        if self._bc_sender is None:
            raise BroadcastFailed("no broadcast group: the rollout workers have not joined one (bind_trainer)")
        if tensors is not None:  # the sender casts into its flat bf16 buffer: the published bits
            tensors = {n: t.detach() for n, t in tensors.items()}
        try:
            return self._bc_sender.send(int(version), tensors, cast=torch.bfloat16)
        except BroadcastFailed:
            self._bc_close()
            raise

    def op_broadcast_close(self) -> dict[str, Any]:
        """Rank 0: drop the group (the workers' side fails its next collective, or is rebound)."""
        if self.rank == 0:  # type: ignore[attr-defined]
            self._bc_close()
        return {}
