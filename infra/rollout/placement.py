"""The rollout side of ``weight_sync.placement``: which service the flow talks to for generation.

Every placement gives the stages the same interface (:class:`~infra.rollout.service.RolloutService`'s
``launch``, ``wait_ready``, ``url``, ``load``, ``rollout``, ``restarts``, ``close``), so the flow, its
metrics and its staleness rules do not depend on where the weights travel:

- ``object_store``: one rollout worker process that pulls each version from the run's store;
- ``broadcast``: the same worker, receiving each version from trainer rank 0 as a collective;
- ``colocated``: no worker; the trainer ranks generate with the parameters they train.

:meth:`bind_trainer` is called after the trainer group is up (and again after it was replaced), for
placements that need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from infra.config import RunConfig
from infra.storage import ObjectStore


def create_rollout_service(cfg: RunConfig, run_id: str, store: ObjectStore, run_dir: Path,
                           init_dir: str | None = None, report: Callable[[str], None] | None = None) -> Any:
    """The rollout service for ``cfg.weight_sync.placement`` (not launched yet)."""
    if cfg.weight_sync.placement == "colocated":
        from infra.rollout.colocated import ColocatedRollout

        return ColocatedRollout(cfg, run_id, store, run_dir, init_dir, report=report)
    if cfg.weight_sync.placement == "broadcast":
        from infra.rollout.broadcast_service import BroadcastRolloutService

        return BroadcastRolloutService(cfg, run_id, store, run_dir, init_dir, report=report)
    from infra.rollout.service import RolloutService

    return RolloutService(cfg, run_id, store, run_dir, init_dir, report=report)
