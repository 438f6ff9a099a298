"""Trigger a deployment through the Prefect REST API and wait for it — the documented Python example.

Plain ``httpx`` against the server's REST API (no Prefect client), so any service can copy it:
resolve ``<flow>/<deployment>`` to an id, ``POST /deployments/{id}/create_flow_run`` with
parameters, poll ``GET /flow_runs/{id}`` until the state is final. With
``PREFECT_SERVER_API_AUTH_STRING`` set on the server, pass the same ``user:password`` as ``auth``.
"""

from __future__ import annotations

import time
from typing import Any

FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _client(api_url: str, auth: str | None, timeout: float = 30.0) -> Any:
    import httpx

    basic = tuple(auth.split(":", 1)) if auth else None
    return httpx.Client(base_url=api_url.rstrip("/") + "/", auth=basic, timeout=timeout, trust_env=False)


def trigger(api_url: str, deployment: str, parameters: dict[str, Any], auth: str | None = None,
            name: str | None = None) -> dict[str, Any]:
    """Create a flow run of ``flow-name/deployment-name`` with ``parameters``; returns the run JSON."""
    flow, _, dep = deployment.partition("/")
    with _client(api_url, auth) as c:
        r = c.get(f"deployments/name/{flow}/{dep}")
        r.raise_for_status()
        body: dict[str, Any] = {"parameters": parameters}
        if name:
            body["name"] = name
        r = c.post(f"deployments/{r.json()['id']}/create_flow_run", json=body)
        r.raise_for_status()
        return r.json()


def wait(api_url: str, flow_run_id: str, timeout: float = 1800.0, auth: str | None = None,
         poll: float = 2.0) -> dict[str, Any]:
    """Poll a flow run until its state is final; returns the run JSON (raises TimeoutError)."""
    deadline = time.monotonic() + timeout
    with _client(api_url, auth) as c:
        while True:
            r = c.get(f"flow_runs/{flow_run_id}")
            r.raise_for_status()
            run = r.json()
            if run["state"]["type"] in FINAL:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"flow run {flow_run_id} still {run['state']['type']} after {timeout:.0f}s")
            time.sleep(poll)
