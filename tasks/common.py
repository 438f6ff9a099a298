"""Shared task settings: retry only errors that say a retry can help."""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import NO_CACHE


def retry_if_retryable(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry when the exception has ``retryable = True``.

    Storage hiccups, a lost connection to a service and sandbox infrastructure errors are
    retryable; bad configs, corrupted weights and programming errors are not.
    """
    try:
        exc = state.result(raise_on_failure=False)
    except Exception as err:  # the result itself may re-raise
        exc = err
    return bool(getattr(exc, "retryable", False))


# Stages are idempotent through the object store (keyed by run and step), and their inputs include
# live service handles, so Prefect's input-hash caching is off.
TASK_DEFAULTS: dict[str, Any] = {
    "retries": 2,
    "retry_delay_seconds": 1,
    "retry_condition_fn": retry_if_retryable,
    "cache_policy": NO_CACHE,
}
