"""Task wrapper for *promote* (logic in :func:`infra.stages.promote.promote`)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from infra.ops.report import gate_report
from infra.stages import promote as logic
from infra.stages.context import Cluster, RunContext
from tasks.common import TASK_DEFAULTS


@task(name="promote", **TASK_DEFAULTS)
def promote(ctx: RunContext, cluster: Cluster, final_eval_key: str, step: int) -> dict[str, Any]:
    """Register the final policy with lineage; move the alias only if the eval gate passes."""
    out = logic.promote(ctx, cluster, final_eval_key, step, sandbox_image=_image(ctx))
    link = f"{ctx.cfg.resolved_tracking_uri()} run {ctx.tracker.run_id}"
    create_markdown_artifact(
        gate_report(out["decision"], out["model_version"], out["champion_before"], link),
        key="promotion-gate", description="eval-gated promotion decision",
    )
    return out


def _image(ctx: RunContext) -> str:
    s = ctx.cfg.sandbox
    return s.image if s.runtime == "docker" else s.runtime
