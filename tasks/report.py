"""Task *report*: the run's Prefect markdown artifact and its operations plots in MLflow.

Logic in :mod:`infra.ops.report` (markdown) and :mod:`infra.ops.plots` (PNG); this wrapper only
publishes them. Reporting never fails a finished run: a plotting or upload error is logged and the
markdown artifact is still created.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from infra.ops.links import run_link_markdown
from infra.ops.plots import plot_operations
from infra.ops.report import run_report
from infra.ops.utilisation_report import utilisation_markdown, utilisation_record
from infra.stages.context import RunContext


@task(name="report", cache_policy=NO_CACHE)
def report_run(ctx: RunContext, summary: dict[str, Any]) -> str:
    """Create the run's markdown artifact (step table, eval table, utilisation and cost, MLflow link);
    log the plots."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            png = plot_operations(ctx.history, Path(tmp) / "operations.png")
            ctx.tracker.log_artifact(png, "plots")
    except Exception as exc:  # a report must not fail a run that already finished
        get_run_logger().warning("operations plot failed: %s: %s", type(exc).__name__, exc)
    link = run_link_markdown(ctx.tracker.tracking_uri, ctx.tracker.experiment_id, ctx.tracker.run_id)
    md = run_report({**summary, "run_id": ctx.run_id}, ctx.history, link)
    if "utilisation" in summary:  # where every resource-second and dollar went
        md += "\n" + utilisation_markdown(utilisation_record({**summary, "run_id": ctx.run_id}))
    ctx.tracker.log_text(md, "report.md")
    key = "run-report-" + "".join(c if c.isalnum() else "-" for c in ctx.run_id.lower())[:80]
    create_markdown_artifact(md, key=key, description=f"deltaloop run {ctx.run_id}")
    return md
