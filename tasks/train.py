"""Task wrapper for *train step* (logic in :func:`infra.stages.steps.train_step`)."""

from __future__ import annotations

from typing import Any

from prefect import task

from infra.stages import steps
from infra.stages.context import Cluster, RunContext
from tasks.common import TASK_DEFAULTS


@task(name="train-step", **TASK_DEFAULTS)
def train_step(ctx: RunContext, cluster: Cluster, step: int) -> dict[str, Any]:
    """One GRPO update on every rank; idempotent per (run, step) inside the trainer."""
    return steps.train_step(ctx, cluster, step)
