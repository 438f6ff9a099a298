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
    """Evaluate the served version (all suites before and after training, the main suite in between);
    a table artifact per problem group and suite."""
    report = logic.evaluate(ctx, cluster, step, all_suites=step in (0, ctx.cfg.trainer.steps))
    rows = [{"group": g, "score": round(s, 4)} for g, s in report["per_group"].items()]
    rows.append({"group": "ALL", "score": round(report["score"], 4)})
    rows += [{"group": f"suite {name}", "score": round(r["score"], 4)} for name, r in report.get("suites", {}).items()]
    create_table_artifact(rows, key=f"eval-{ctx.run_id.lower().replace('_', '-')[:50]}",
                          description=f"held-out eval at step {step} (version {report['version']})")
    return report
