"""What a flow run started through a deployment may ask for: checked first, before anything starts.

A run created from a deployment (the REST API, the UI, a schedule, an automation) carries the
parameters of whoever could reach the Prefect server, so each flow's entry calls
:func:`check_deployment_request` before reading its config: the config file must be one of the
project's (or an operator-listed path) and every override key must be on the allow-list
(:func:`infra.config.check_api_request`; the list and how operators change it are documented
there and in docs/operations.md). A refused request fails the flow run with one line naming the
key and the allow-list; no run folder, MLflow run or service exists yet.

A flow called from Python (``deltaloop run``, ``deltaloop gate``) or as a subflow is not checked:
its own flow run has no deployment, and a parent flow that forwards its parameters has checked
them already (``retrain`` checks its request before it starts ``rl-train``).
"""

from __future__ import annotations

from infra.config import check_api_request


def deployment_triggered() -> bool:
    """Whether the current flow run was created from a deployment (not a subflow, not a local call)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    run = getattr(ctx, "flow_run", None)
    return getattr(run, "deployment_id", None) is not None


def check_deployment_request(config: str | None, overrides: list[str] | None, resume: str | None = None) -> None:
    """Raise :class:`infra.config.OverrideRefused` when a deployment-triggered run asks for too much."""
    if deployment_triggered():
        check_api_request(config, list(overrides or []), resume)
