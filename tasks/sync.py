"""Task wrapper for *sync weights* (logic in :func:`infra.stages.steps.sync_weights`)."""

from __future__ import annotations

from typing import Any

from prefect import task

from infra.stages import steps
from infra.stages.context import Cluster, RunContext
from tasks.common import TASK_DEFAULTS


@task(name="sync-weights", **TASK_DEFAULTS)
def sync_weights(ctx: RunContext, cluster: Cluster, version: int) -> dict[str, Any]:
    """Rollout worker pulls ``version`` (delta chain from the object store) and applies it in place."""
    return steps.sync_weights(ctx, cluster, version)
