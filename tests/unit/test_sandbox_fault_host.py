"""Whose failure a dead sandbox is, on the host side (no sandbox needed; issue #16).

The handle is driven over a real :class:`PipeTransport` whose peer is a small stand-in process that
behaves as a runner does when something outside the job breaks it: it exits (killed), answers a line
that is not a reply, or never answers. Nothing untrusted runs here.
"""

from __future__ import annotations

import sys
import time

import pytest
from pydantic import ValidationError

from infra.config import SandboxConfig
from infra.sandbox.faults import death_reason
from infra.sandbox.handle import PipeTransport, RunnerHandle
from infra.sandbox.protocol import failure_exec, failure_tests, failure_verify
from infra.sandbox.types import REASONS, SandboxDied, TestCase, VerifyRequest

HELLO = 'import sys\nsys.stdout.write(\'{"ready": true}\\n\'); sys.stdout.flush()\n'


def _handle(body: str) -> RunnerHandle:
    """A handle on a stand-in runner: says ready, then runs ``body`` (after reading one job line)."""
    code = HELLO + "sys.stdin.readline()\n" + body
    handle = RunnerHandle(PipeTransport([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin"}), "stand-in")
    handle.wait_ready(30)
    return handle


@pytest.mark.parametrize(("body", "kind", "reason"), [
    ("import os\nos._exit(0)\n", "gone", "infra"),  # the runner vanished (killed from outside)
    ("sys.stdout.write('not json\\n'); sys.stdout.flush()\nimport time\ntime.sleep(30)\n", "garbled", "infra"),
    ("sys.stdout.write('[1, 2]\\n'); sys.stdout.flush()\nimport time\ntime.sleep(30)\n", "garbled", "infra"),
    ("import time\ntime.sleep(30)\n", "timeout", "timeout"),  # no answer: counted as the job's
])
def test_what_the_host_saw_decides_whose_failure(body: str, kind: str, reason: str) -> None:
    handle = _handle(body)
    try:
        with pytest.raises(SandboxDied) as info:
            handle.call({"mode": "exec", "timeout": 0.1}, timeout=1.0)
        assert info.value.kind == kind
        assert death_reason(info.value, handle) == reason
    finally:
        handle.close()


def test_a_write_to_a_closed_handle_is_gone_not_a_crash() -> None:
    handle = _handle("import time\ntime.sleep(30)\n")
    handle.transport.kill()  # the sandbox was killed while idle: the stream is closed under the handle
    with pytest.raises(SandboxDied) as info:
        handle.call({"mode": "exec", "timeout": 0.1}, timeout=1.0)
    assert info.value.kind == "gone" and death_reason(info.value, handle) == "infra"
    handle.close()


def test_idle_check_sees_a_sandbox_that_died_while_idle() -> None:
    alive = _handle("import time\ntime.sleep(30)\n")
    dying = RunnerHandle(PipeTransport([sys.executable, "-c", HELLO], env={"PATH": "/usr/bin:/bin"}), "dying")
    try:
        dying.wait_ready(30)
        assert alive.idle_ok()
        deadline = time.monotonic() + 10
        while dying.idle_ok() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not dying.idle_ok(), "a runner whose stream ended must not be handed a job"
        assert alive.idle_ok(), "the check must not consume or disturb a live runner"
    finally:
        alive.close()
        dying.close()


def test_infra_results_say_so_and_score_nothing() -> None:
    assert "infra" in REASONS
    req = VerifyRequest("def f(x):\n    return x\n", "f", [TestCase([1], 1), TestCase([2], 2)])
    v = failure_verify(req, "infra", "sandbox lost", 0.5, infra=True)
    t = failure_tests("infra", "sandbox lost", infra=True)
    e = failure_exec("infra", "sandbox lost", infra=True)
    assert (v.reward, v.passed, v.infra, v.to_dict()["infra"]) == (0.0, [False, False], True, True)
    assert (t.reward, t.passed, t.infra, t.to_dict()["infra"]) == (0.0, False, True, True)
    assert (e.exit_code, e.infra, e.to_dict()["infra"]) == (None, True, True)
    own = failure_verify(req, "timeout", "runner did not answer in time")
    assert own.infra is False and own.to_dict()["infra"] is False


def test_retry_settings_are_bounded() -> None:
    cfg = SandboxConfig()
    assert (cfg.infra_retries, cfg.infra_backoff_s) == (2, 0.5)
    for bad in ({"infra_retries": -1}, {"infra_retries": 21}, {"infra_backoff_s": -0.1}):
        with pytest.raises(ValidationError):
            SandboxConfig(**bad)  # type: ignore[arg-type]
