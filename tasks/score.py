"""Task wrapper for *score in sandboxes* (logic in :func:`infra.stages.steps.score_batch`)."""

from __future__ import annotations

from typing import Any

from prefect import task

from infra.stages import steps
from infra.stages.context import Cluster, RunContext
from tasks.common import TASK_DEFAULTS


@task(name="score-in-sandboxes", **TASK_DEFAULTS)
def score_batch(ctx: RunContext, cluster: Cluster, step: int) -> dict[str, Any]:
    """Run each rollout's program against hidden tests in the sandbox pool; rewards to the store."""
    return steps.score_batch(ctx, cluster, step)
