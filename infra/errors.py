"""The one root of every deltaloop exception, and what ``retryable`` means.

Every error the project raises on purpose derives from :class:`DeltaloopError`, so two decisions
are made by type instead of by a list of modules:

- the CLI prints a ``DeltaloopError`` as one ``error:`` line (it describes the input, the
  environment or an infrastructure failure), while any other exception is a bug and keeps its
  traceback (``deltaloop/cli.py``);
- Prefect retries a task only when it failed with a ``DeltaloopError`` whose ``retryable`` is
  true (``tasks/common.py``).

This module is a leaf: it imports nothing from the project, so any module can import it.
"""

from __future__ import annotations

from typing import ClassVar


class DeltaloopError(Exception):
    """Base of every project exception.

    ``retryable`` says whether a fresh attempt of the same task may succeed: true for failures of
    the infrastructure or transient I/O (a storage hiccup, a service that died, a sandbox that could
    not start), false for bad input, a corrupt artefact or a bug, where the same attempt would fail
    the same way. Each subclass states it at class level; the default is false. The one
    per-instance value is :class:`infra.rpc.RemoteError`, which carries the flag of the exception
    raised inside a service process.
    """

    retryable: ClassVar[bool] = False


def is_retryable(exc: object) -> bool:
    """True when ``exc`` is a project error that says a fresh attempt may succeed (anything else,
    including a bug's exception or a non-exception value, is not retried)."""
    return isinstance(exc, DeltaloopError) and exc.retryable


__all__ = ["DeltaloopError", "is_retryable"]
