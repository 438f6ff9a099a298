"""Host side of the verifier protocol: build job messages, turn runner replies into results.

The runner (``runner.py``) reports raw facts — exit status, signal, whether it hit the timeout or
the output cap, the values the program returned. Everything that decides a *score* happens here, in
the trusted process: the expected answers never enter the sandbox, and a reply that does not parse
is a failure, never a pass.
"""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path
from typing import Any

from infra.sandbox.types import ExecResult, TestsRequest, TestsResult, VerifyRequest, VerifyResult

RUNNER_PATH = Path(__file__).with_name("runner.py")
RUNNER_SOURCE = RUNNER_PATH.read_text()
BOOT = "import sys;exec(sys.argv[1])"
FLOAT_REL_TOL = 1e-9
FLOAT_ABS_TOL = 1e-9


def runner_argv(python: str, mode: str, opts: dict[str, Any]) -> list[str]:
    """Command line that starts the runner (``--runner``) or a one-job sandbox (``--oneshot``)."""
    return [python, "-I", "-S", "-B", "-c", BOOT, RUNNER_SOURCE, mode, json.dumps(opts)]


def verify_job(req: VerifyRequest, timeout_s: float) -> dict[str, Any]:
    """The job message for a verification: program, entry and the tests' *args* (not expected)."""
    return {
        "mode": "verify",
        "program": req.program,
        "entry": req.entry,
        "args": [list(t.args) for t in req.tests],
        "timeout": timeout_s,
    }


def exec_job(program: str, timeout_s: float) -> dict[str, Any]:
    """The job message for running ``program`` as ``__main__``."""
    return {"mode": "exec", "program": program, "entry": "", "args": [], "timeout": timeout_s}


def run_tests_job(req: TestsRequest, timeout_s: float) -> dict[str, Any]:
    """The job message for scoring a program against trusted tests (the runner hands the tests to
    the trusted tester only, never to the process that runs the program)."""
    return {
        "mode": "tests",
        "program": req.program,
        "tests": req.tests,
        "context": req.context or "",
        "entry": req.entry or "",
        "timeout": timeout_s,
    }


def values_equal(got: Any, expected: Any) -> bool:
    """Python ``==`` on JSON values, except that floats compare with a tiny tolerance."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return got == expected
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)):
        if isinstance(got, float) or isinstance(expected, float):
            try:
                return math.isclose(got, expected, rel_tol=FLOAT_REL_TOL, abs_tol=FLOAT_ABS_TOL)
            except OverflowError:
                return False
        return got == expected
    if isinstance(got, list) and isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(values_equal(a, b) for a, b in zip(got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k]) for k in got)
    try:
        return bool(got == expected)
    except Exception:
        return False


def _payload(reply: dict[str, Any]) -> dict[str, Any] | None:
    raw = reply.get("payload")
    if not raw:
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def base_reason(reply: dict[str, Any]) -> str:
    """The reason of a job from the runner's raw facts (before looking at test results)."""
    if reply.get("fatal"):
        return "error"
    if reply.get("timed_out"):
        return "timeout"
    if reply.get("output_limit"):
        return "output_limit"
    payload = _payload(reply)
    if (payload and payload.get("phase") == "memory") or reply.get("oom"):
        return "memory"
    sig = reply.get("signal")
    if sig:
        if sig in (signal.SIGXCPU, signal.SIGXFSZ):
            return "timeout" if sig == signal.SIGXCPU else "output_limit"
        return "killed"
    if reply.get("exit") is None:
        return "killed"
    return "ok" if reply.get("exit") == 0 else "error"


def to_exec_result(reply: dict[str, Any]) -> ExecResult:
    """Runner reply → :class:`ExecResult`."""
    reason = base_reason(reply)
    code: int | None = reply.get("exit")
    if code is None and reply.get("signal") and reason not in ("timeout", "output_limit"):
        code = -int(reply["signal"])
    if reply.get("timed_out") or reply.get("output_limit"):
        code = None
    return ExecResult(
        exit_code=code,
        reason=reason,
        stdout_tail=reply.get("stdout", ""),
        stderr_tail=reply.get("stderr", ""),
        wall_seconds=float(reply.get("run_s", 0.0)),
        extra={"anomaly": reply.get("anomaly")},
    )


def to_verify_result(req: VerifyRequest, reply: dict[str, Any]) -> VerifyResult:
    """Runner reply → :class:`VerifyResult`; the comparison with expected values happens here."""
    n = len(req.tests)
    failed = [False] * n
    common = {
        "stdout_tail": reply.get("stdout", ""),
        "stderr_tail": reply.get("stderr", ""),
        "wall_seconds": float(reply.get("run_s", 0.0)),
    }
    reason = base_reason(reply)
    payload = _payload(reply)
    phase = payload.get("phase") if payload else None
    if phase == "syntax" and reason == "ok":
        msg = str(payload.get("msg", ""))[:500] if payload else ""
        return VerifyResult(failed, 0.0, "syntax", common["stdout_tail"], common["stderr_tail"] or msg,
                            common["wall_seconds"])
    if reason != "ok" or phase != "done":
        return VerifyResult(failed, 0.0, "error" if reason == "ok" else reason, **common)
    results = payload.get("results") if payload else None
    if not isinstance(results, list) or len(results) != n:
        return VerifyResult(failed, 0.0, "error", **common)
    passed: list[bool] = []
    for item, test in zip(results, req.tests):
        ok = (
            isinstance(item, list)
            and len(item) == 2
            and item[0] == "ok"
            and values_equal(item[1], json.loads(json.dumps(test.expected)))
        )
        passed.append(bool(ok))
    reward = sum(passed) / n if n else 0.0
    return VerifyResult(passed, reward, "ok" if all(passed) else "wrong", **common)


#: Tester phases that mean the program or the request could not be tested at all.
_UNTESTABLE = {"syntax": "syntax", "load_error": "error", "no_entry": "error", "bad_tests": "error"}


def to_tests_result(reply: dict[str, Any]) -> TestsResult:
    """Runner reply → :class:`TestsResult`. Passed only on the tester's own verdict
    ``{"phase": "tests", "passed": true}`` with exit status 0 and no timeout, output cap, memory
    kill or runner error; anything else (no verdict, a garbled one, a dead tester) fails."""
    common = (reply.get("stdout", ""), reply.get("stderr", ""), float(reply.get("run_s", 0.0)))
    reason = base_reason(reply)
    payload = _payload(reply)
    phase = payload.get("phase") if payload else None
    if reason != "ok":
        return TestsResult(False, 0.0, reason, *common)
    if phase == "tests" and payload is not None and payload.get("passed") is True:
        return TestsResult(True, 1.0, "ok", *common)
    if phase == "tests" and payload is not None:
        return TestsResult(False, 0.0, "memory" if payload.get("error") == "MemoryError" else "wrong", *common)
    return TestsResult(False, 0.0, _UNTESTABLE.get(str(phase), "error"), *common)


def failure_tests(reason: str, message: str, wall: float = 0.0, infra: bool = False) -> TestsResult:
    """A failure for a tests job whose sandbox died or could not run it (``infra``: not the job's doing)."""
    return TestsResult(False, 0.0, reason, "", message, wall, infra=infra)


def failure_verify(req: VerifyRequest, reason: str, message: str, wall: float = 0.0,
                   infra: bool = False) -> VerifyResult:
    """A failure for a job whose sandbox died or could not run it (``infra``: not the job's doing)."""
    return VerifyResult([False] * len(req.tests), 0.0, reason, "", message, wall, infra=infra)


def failure_exec(reason: str, message: str, wall: float = 0.0, infra: bool = False) -> ExecResult:
    """An :class:`ExecResult` for a job whose sandbox died or could not run it (``infra``: not the job's doing)."""
    return ExecResult(None, reason, "", message, wall, infra=infra)
