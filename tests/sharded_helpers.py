"""A trainer rank of a sharded publish, for tests that run several in processes of their own
(:mod:`infra.train.sharded_publish` over gloo and a file store)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.rank_helpers import join_gloo

PREFIX = "runs/sharded/weights"


def sharded_rank(rank: int, world: int, rendezvous: str, root: str, parts: int, q: Any) -> None:
    """Publish six drifting versions from ``parts`` of ``world`` ranks; republish the sixth with the
    last part's store broken (it fails), and publish it again. Reports each record (or error) on
    ``q`` as ``(rank, what, value)``. The ranks meet through the file ``rendezvous`` (no port to race for)."""
    import torch.distributed as dist

    from infra.configs.services import WeightSyncConfig
    from infra.storage import FileStore
    from infra.train.sharded_publish import ShardedPublish
    from tests.weightsync_helpers import Drift

    class Breakable(FileStore):
        broken = False

        def put(self, key: str, data: bytes) -> None:
            if self.broken:
                raise OSError(f"injected: cannot write {key}")
            super().put(key, data)

    join_gloo(rank, world, rendezvous)
    try:
        store = Breakable(Path(root))
        drift = Drift(seed=7)
        ws = WeightSyncConfig(publish_ranks=parts, snapshot_chain_fraction=0.05)
        numels = {n: t.numel() for n, t in drift.bf16().items()}
        sp = ShardedPublish(store, PREFIX, ws, rank, world, numels)
        for v in range(1, 7):
            if v > 1:
                drift.step(1e-3)
            q.put((rank, "record", sp.publish({n: t for n, t in drift.bf16().items() if sp.keeps(n)})))
        mine = {n: t for n, t in drift.bf16().items() if sp.keeps(n)}
        q.put((rank, "part", None if sp.part is None else sp.part.index))
        store.broken = sp.part is not None and sp.part.index == parts - 1  # a full version's shards fail here
        try:
            q.put((rank, "republish", sp.republish(mine)))
        except Exception as exc:  # the test checks every rank heard it
            q.put((rank, "error", f"{type(exc).__name__}: {exc}"))
        store.broken = False
        q.put((rank, "record", sp.publish(mine)))  # the same weights again: a full version 6
        q.put((rank, "version", sp.version))
        sp.close()
    finally:
        dist.destroy_process_group()
