"""The ``eval-gate`` flow: evaluate a registered model version against the champion and promote or reject.

Both models are evaluated on the same eval suites by the same code (``infra/stages/gate.py``); the
decision is a Prefect markdown artifact of this run and an MLflow artifact of the gate run. The gate
holds one ``rollout-slots`` slot while it evaluates and goes before waiting training runs
(:mod:`flows.capacity`).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.capacity import hold_capacity
from flows.guard import check_deployment_request
from infra.config import load_config
from tasks.gate import gate_version


@flow(name="eval-gate", log_prints=False)
def eval_gate(version: str, config: str = "configs/demo.yaml", overrides: list[str] | None = None) -> dict[str, Any]:
    """Gate model VERSION of the configured registered model against its champion.

    A run created from a deployment may only name project configs and allowed override keys."""
    check_deployment_request(config, overrides)
    cfg = load_config(config, list(overrides or []))
    with hold_capacity("gate"):  # rollout-slots only, and ahead of waiting training runs
        return gate_version(cfg, str(version))
