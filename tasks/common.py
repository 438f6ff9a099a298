"""Shared task settings: retry only errors that say a retry can help."""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import NO_CACHE

from infra.errors import is_retryable


def retry_if_retryable(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry only a :class:`~infra.errors.DeltaloopError` whose
    ``retryable`` is true.

    Storage hiccups, a lost connection to a service and sandbox infrastructure errors are
    retryable; bad configs, corrupted weights and programming errors (any other exception) are not.
    """
    try:
        exc = state.result(raise_on_failure=False)
    except Exception as err:  # the result itself may re-raise
        exc = err
    return is_retryable(exc)


# Stages are idempotent through the object store (keyed by run and step), and their inputs include
# live service handles, so Prefect's input-hash caching is off.
TASK_DEFAULTS: dict[str, Any] = {
    "retries": 2,
    "retry_delay_seconds": 1,
    "retry_condition_fn": retry_if_retryable,
    "cache_policy": NO_CACHE,
}
