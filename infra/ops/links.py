"""Links from a run to the MLflow UI.

A tracking URI that is an MLflow server (``http(s)://``) is also its UI. With a file or sqlite
store there is no UI unless one serves it; ``deltaloop serve`` starts one and exports its address
as ``DELTALOOP_MLFLOW_UI_URL`` to the flows it runs, so reports can link to it.
"""

from __future__ import annotations

import os

UI_ENV = "DELTALOOP_MLFLOW_UI_URL"


def mlflow_ui_base(tracking_uri: str) -> str | None:
    """Base URL of an MLflow UI showing ``tracking_uri``'s runs, if one is known."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    env = os.environ.get(UI_ENV, "").strip()
    return env.rstrip("/") or None


def mlflow_run_url(tracking_uri: str, experiment_id: str | None, run_id: str | None) -> str | None:
    """``<ui>/#/experiments/<exp>/runs/<run>`` or None when no UI is known."""
    base = mlflow_ui_base(tracking_uri)
    if base is None or not experiment_id or not run_id:
        return None
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def mlflow_model_url(tracking_uri: str, name: str, version: str | None = None) -> str | None:
    """Link to a registered model (or one version of it) in the MLflow UI."""
    base = mlflow_ui_base(tracking_uri)
    if base is None:
        return None
    return f"{base}/#/models/{name}" + (f"/versions/{version}" if version else "")


def run_link_markdown(tracking_uri: str, experiment_id: str | None, run_id: str | None) -> str:
    """A markdown link to the MLflow run, or how to open one when no UI is running."""
    url = mlflow_run_url(tracking_uri, experiment_id, run_id)
    if url:
        return f"[MLflow run {run_id}]({url})"
    return f"MLflow run `{run_id}` in `{tracking_uri}` (open with `mlflow ui --backend-store-uri {tracking_uri}`)"
