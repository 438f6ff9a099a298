"""Trigger a deployment through the Prefect REST API and wait for it — the documented Python example.

Plain ``httpx`` against the server's REST API (no Prefect client), so any service can copy it:
resolve ``<flow>/<deployment>`` to an id, ``POST /deployments/{id}/create_flow_run`` with
parameters, poll ``GET /flow_runs/{id}`` until the state is final. With
``PREFECT_SERVER_API_AUTH_STRING`` set on the server, pass the same ``user:password`` as ``auth``.

A Prefect server on SQLite answers ``503 Service Unavailable`` when its database is busy (another
writer holds the lock; the request was rolled back), and a proxy in front may answer 502/504 or 429.
Those are retried with exponential backoff (honouring ``Retry-After``), as Prefect's own client does.
The run is created with an idempotency key, so a retry after a lost response never makes a second run.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
RETRY_STATUS = frozenset({429, 502, 503, 504})


def _client(api_url: str, auth: str | None, timeout: float = 30.0) -> Any:
    import httpx

    basic = tuple(auth.split(":", 1)) if auth else None
    return httpx.Client(base_url=api_url.rstrip("/") + "/", auth=basic, timeout=timeout, trust_env=False)


def request(client: Any, method: str, path: str, *, attempts: int = 6, backoff: float = 0.5,
            **kwargs: Any) -> Any:
    """``client.request`` that retries transient server answers and connection errors, then raises.

    Retries ``RETRY_STATUS`` answers and dropped connections up to ``attempts`` times, sleeping
    ``backoff * 2**i`` seconds (or the server's ``Retry-After``, capped at 30 s) between tries.
    Returns the ``httpx.Response`` of the first non-transient answer after ``raise_for_status``.
    """
    import httpx

    for i in range(attempts):
        last = i == attempts - 1
        try:
            r = client.request(method, path, **kwargs)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            if last:
                raise
        else:
            if r.status_code not in RETRY_STATUS or last:
                r.raise_for_status()
                return r
            after = r.headers.get("retry-after", "")
            if after.replace(".", "", 1).isdigit():
                time.sleep(min(float(after), 30.0))
                continue
        time.sleep(backoff * 2 ** i)
    raise AssertionError("unreachable")  # pragma: no cover


def trigger(api_url: str, deployment: str, parameters: dict[str, Any], auth: str | None = None,
            name: str | None = None, idempotency_key: str | None = None) -> dict[str, Any]:
    """Create a flow run of ``flow-name/deployment-name`` with ``parameters``; returns the run JSON.

    ``idempotency_key`` (a fresh UUID by default) makes the create safe to retry: the server returns
    the run already made under that key instead of a second one.
    """
    flow, _, dep = deployment.partition("/")
    with _client(api_url, auth) as c:
        found = request(c, "GET", f"deployments/name/{flow}/{dep}").json()
        body: dict[str, Any] = {"parameters": parameters, "idempotency_key": idempotency_key or uuid.uuid4().hex}
        if name:
            body["name"] = name
        run: dict[str, Any] = request(c, "POST", f"deployments/{found['id']}/create_flow_run", json=body).json()
        return run


def wait(api_url: str, flow_run_id: str, timeout: float = 1800.0, auth: str | None = None,
         poll: float = 2.0) -> dict[str, Any]:
    """Poll a flow run until its state is final; returns the run JSON (raises TimeoutError)."""
    deadline = time.monotonic() + timeout
    with _client(api_url, auth) as c:
        while True:
            run: dict[str, Any] = request(c, "GET", f"flow_runs/{flow_run_id}").json()
            if run["state"]["type"] in FINAL:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"flow run {flow_run_id} still {run['state']['type']} after {timeout:.0f}s")
            time.sleep(poll)
