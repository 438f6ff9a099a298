"""Publishing each weight version from several trainer ranks: ``weight_sync.publish_ranks: P``.

With ``P = 1`` (the default) rank 0 gathers every tensor and one publisher encodes and uploads the
whole model. With ``P > 1`` the model's tensors are dealt by size
(:func:`infra.weightsync.parts.assign_parts`) to P ranks spread evenly over the world: ranks 0,
W/P, 2W/P, ... of W (torchrun numbers ranks node by node, so with P = the number of nodes that is
each node's first rank: one publisher per node, its cores and uplink). Each of them takes only its own tensors from the
engine (a local read for torch replicas and ZeRO-1/2, a gather per tensor kept by its owner under
ZeRO-3 and FSDP), and encodes and uploads them in parallel with the others; rank 0 then writes the
one manifest that commits the version (:mod:`infra.weightsync.parts` has the protocol). Encode
and upload scale with the publishing ranks, which on a model spread over many trainer nodes is the
difference between one node's cores and uplink and all of theirs.

Every rank calls every method here at the same point (they are collectives): the ranks agree on a
full or a delta version (``all_gather_object`` of each part's ``ready``), the parts' reports go to
rank 0 (``gather_object``) and its outcome comes back (``broadcast_object_list``). A version that
did not commit fails the op on every rank with :class:`ShardedPublishFailed` (retryable: the next
publish is a full version of the same weights).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from infra.errors import DeltaloopError
from infra.gcpause import deferred_gc
from infra.weightsync.parts import Outcome, PartPublisher, assign_parts

if TYPE_CHECKING:
    import torch

    from infra.configs.services import WeightSyncConfig
    from infra.storage import ObjectStore


class ShardedPublishFailed(DeltaloopError):
    """A part of a sharded publish failed, so the version was not committed (nothing is visible)."""

    retryable = True


class ShardedPublish:
    """The trainer ranks' side of a sharded publish (module docstring); ranks that publish nothing
    take part in the collectives with no part."""

    def __init__(self, store: "ObjectStore", prefix: str, ws: "WeightSyncConfig", rank: int, world: int,
                 numels: dict[str, int]) -> None:
        self.parts = ws.publish_ranks
        if self.parts > world:
            raise ValueError(f"weight_sync.publish_ranks={self.parts} but the trainer has {world} ranks")
        self.rank, self.world = rank, world
        stride = world // self.parts
        shares = assign_parts(numels, self.parts)
        self.owner = {n: p * stride for p, names in enumerate(shares) for n in names}  # name -> its rank
        part = rank // stride if rank % stride == 0 and rank // stride < self.parts else None
        self.part = (PartPublisher(store, prefix, part, self.parts, shares[part], **ws.publisher_kwargs())
                     if part is not None else None)
        dist.barrier()  # part 0 deleted what killed publishers left before any part uploads

    @property
    def version(self) -> int:
        """The newest committed version (every part agrees: they commit together)."""
        box = [self.part.version if self.part is not None else 0]
        dist.broadcast_object_list(box, src=0)
        return int(box[0])

    def keeps(self, name: str) -> bool:
        """Whether this rank publishes tensor ``name`` (``owner[name]`` is the rank that does)."""
        return self.owner.get(name) == self.rank

    def publish(self, tensors: dict[str, "torch.Tensor"], *, full: bool = False,
                t0: float | None = None) -> dict[str, Any]:
        """Collective: publish this rank's ``tensors`` (its share; empty on a rank with no part) as the next
        version; returns the record of it on rank 0 (``{}`` elsewhere; ``seconds`` from ``t0``, default
        now: :meth:`~infra.weightsync.publisher.PublishInfo.record`). Raises
        :class:`ShardedPublishFailed` on every rank when any part failed. Python's cyclic garbage
        collector is held off meanwhile, as one publisher's ``publish`` holds it."""
        with deferred_gc():
            return self._publish(tensors, full, time.perf_counter() if t0 is None else t0)

    def _publish(self, tensors: dict[str, "torch.Tensor"], full: bool, t0: float) -> dict[str, Any]:
        ready = self.part.ready(tensors) if self.part is not None else True
        flags: list[Any] = [None] * self.world
        dist.all_gather_object(flags, ready)
        full = full or not all(flags)
        report = self.part.prepare(tensors, full=full) if self.part is not None else None
        reports: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(report, reports, dst=0)
        box: list[Any] = [None]
        if self.rank == 0:
            assert self.part is not None and reports is not None
            box[0] = self.part.commit([r for r in reports if r is not None])
        dist.broadcast_object_list(box, src=0)
        outcome: Outcome = box[0]
        if self.part is not None:
            self.part.settle(outcome)
        if not outcome.committed:
            raise ShardedPublishFailed(f"weight version {outcome.version} not published: {outcome.error}")
        if self.rank != 0 or outcome.info is None:
            return {}
        return {**outcome.info.record(t0), "parts": self.parts}

    def republish(self, tensors: dict[str, "torch.Tensor"], *, t0: float | None = None) -> dict[str, Any]:
        """Collective: write the newest version again, as a full version of ``tensors`` (after a
        reader found one of its objects corrupt or missing)."""
        if self.part is not None:
            self.part.drop_newest()
        return self.publish(tensors, full=True, t0=t0)

    def close(self) -> None:
        """Stop this rank's part (its snapshot share in flight is abandoned)."""
        if self.part is not None:
            self.part.close()
