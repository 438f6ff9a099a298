"""Task wrapper for *evaluate* (logic in :func:`infra.stages.evaluate.evaluate`)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact

from infra.stages import evaluate as logic
from infra.stages.context import Cluster, RunContext
from tasks.common import TASK_DEFAULTS


@task(name="evaluate", **TASK_DEFAULTS)
def evaluate(ctx: RunContext, cluster: Cluster, step: int) -> dict[str, Any]:
    """Greedy held-out eval of the served version, scored in sandboxes; a table artifact per family."""
    report = logic.evaluate(ctx, cluster, step)
    rows = [{"family": f, "score": round(s, 4)} for f, s in report["per_family"].items()]
    rows.append({"family": "ALL", "score": round(report["score"], 4)})
    create_table_artifact(rows, key=f"eval-{ctx.run_id.lower().replace('_', '-')[:50]}",
                          description=f"held-out eval at step {step} (version {report['version']})")
    return report
