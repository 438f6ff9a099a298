"""Task wrapper for the staleness check of asynchronous RL (logic in :mod:`infra.stages.staleness`)."""

from __future__ import annotations

from typing import Any

from prefect import task

from infra.stages import steps
from infra.stages.context import Cluster, RunContext
from infra.stages.staleness import enforce_staleness
from tasks.common import TASK_DEFAULTS


@task(name="check-staleness", **TASK_DEFAULTS)
def check_staleness(ctx: RunContext, cluster: Cluster, step: int, roll: dict[str, Any],
                    score: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Drop and regenerate a batch older than ``loop.max_staleness`` (or keep it, as configured)."""
    return enforce_staleness(
        ctx, cluster, step, roll, score,
        regenerate=lambda: (steps.rollout_batch(ctx, cluster, step), steps.score_batch(ctx, cluster, step)),
    )
