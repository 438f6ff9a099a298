"""Task wrapper for the *eval gate* (logic in :func:`infra.stages.gate.run_eval_gate`)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from infra.config import RunConfig
from infra.stages import gate as logic


@task(name="eval-gate", cache_policy=NO_CACHE)
def gate_version(cfg: RunConfig, version: str) -> dict[str, Any]:
    """Evaluate candidate and champion on the same suites; move the alias only if the gate passes.

    Not retried: evaluation reports are cached per version, so re-running the flow is the retry.
    """
    out = logic.run_eval_gate(cfg, version)
    create_markdown_artifact(out["markdown"], key=f"eval-gate-v{version}",
                             description=f"eval gate for model version {version}")
    return out
