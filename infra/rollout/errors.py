"""Errors of the rollout worker and its engines, in the project's family (:mod:`infra.errors`).

- :class:`BadRequest`: a request refused before any of its rows is admitted (a token id outside the
  vocabulary, a prompt longer than the model's positions, ...). Also a ``ValueError``, as the
  engine's argument checks always were; the HTTP layers answer it with 400. Not retryable.
- :class:`RequestFailed`: the engine raised while serving this request's rows, and the request was
  shown to be the cause (alone in its step, or failing again when served alone). Its batch mates
  were served again; the engine keeps serving. HTTP 500. Not retryable: the same request fails the
  same way.
- :class:`ControlRefused`: the worker refused a control call (``/v1/load``, ``/v1/rollout``): no or a
  wrong token, a store key outside the run's rollout prefixes, a version that does not exist (404),
  a version older than the one it serves (409). Not retryable.
- :class:`WeightsNotApplied`: the worker could not fetch a weight version for a reason a later try
  may not meet (the store unreachable) and still serves the one it had. Retryable.
"""

from __future__ import annotations

from infra.errors import DeltaloopError


class RolloutError(DeltaloopError):
    """Base of the rollout worker's errors."""


class BadRequest(RolloutError, ValueError):
    """A request refused before admission; the message names the field and the rule."""


class RequestFailed(RolloutError):
    """The engine failed while serving this request (and only this one); the message says how."""


class ControlRefused(RolloutError):
    """A control call the worker refused (HTTP 401, 403, 404 or 409); the message is the worker's reason."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class WeightsNotApplied(RolloutError):
    """The worker could not fetch a weight version (the store did not answer) and still serves the
    version it had; a later try may succeed."""

    retryable = True


__all__ = ["BadRequest", "ControlRefused", "RequestFailed", "RolloutError", "WeightsNotApplied"]
