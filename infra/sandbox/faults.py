"""Whose failure is it: the job's own, or the infrastructure's (issue #16).

A job that timed out, ran out of memory or output, crashed, or killed or exhausted its own sandbox
failed by itself: reward 0 with that reason. A sandbox that vanished under a job for any other
reason failed the job from outside: the pool retries it on a fresh sandbox, and when every attempt
fails so, the result has ``infra=True`` (reason ``infra``) — no score, to be masked. The line is drawn
on what the job can do: the runner is PID 1 of its namespace and ignores every catchable signal,
and the job holds none of its fds, so only the runner's own reply, the host's backstop timeout, or
the runtime's OOM record can be the job's doing.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.sandbox.handle import RunnerHandle
from infra.sandbox.types import SandboxDied


@dataclass
class Failure:
    """A job that got no usable reply: the ``reason`` and one-line ``message`` of its result.

    ``infra``: the infrastructure failed it, not the job; ``final``: a fresh attempt cannot help
    (the pool is closed or the runtime unusable)."""

    reason: str
    message: str
    wall: float = 0.0
    infra: bool = False
    final: bool = False


def death_reason(exc: SandboxDied, handle: RunnerHandle) -> str:
    """Whose failure a sandbox that died under a job is.

    ``timeout``: the runner did not answer within the job's timeout plus the grace (counted as the
    job's: a job may make its runner slow, and calling it infrastructure would let a policy turn its
    own failures into masked samples). ``memory``: the runtime says the sandbox was OOM-killed (the
    job's). ``infra``: anything else — the stream ended, the connection broke or the reply was
    garbled, none of which the job can cause.
    """
    if exc.kind == "timeout":
        return "timeout"
    if exc.kind == "gone" and handle.transport.death_reason() == "memory":
        return "memory"
    return "infra"
