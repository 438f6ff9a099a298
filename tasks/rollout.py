"""Task wrapper for *rollout batch* (logic in :func:`infra.stages.steps.rollout_batch`)."""

from __future__ import annotations

from typing import Any

from prefect import task

from infra.stages import steps
from infra.stages.context import Cluster, RunContext
from tasks.common import TASK_DEFAULTS


@task(name="rollout-batch", **TASK_DEFAULTS)
def rollout_batch(ctx: RunContext, cluster: Cluster, step: int) -> dict[str, Any]:
    """Sample group_size completions for each fresh training prompt of ``step``."""
    return steps.rollout_batch(ctx, cluster, step)
