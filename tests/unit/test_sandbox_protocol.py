"""Host-side scoring rules of the sandbox protocol (no sandbox needed)."""

from __future__ import annotations

import json
import signal

import pytest

from infra.config import SandboxConfig
from infra.sandbox import RUNTIMES, create_runtime
from infra.sandbox.protocol import base_reason, to_exec_result, to_verify_result, values_equal
from infra.sandbox.types import TestCase, VerifyRequest


def _reply(**kw: object) -> dict:
    base = {"exit": 0, "signal": None, "timed_out": False, "output_limit": False, "oom": False,
            "anomaly": None, "stdout": "", "stderr": "", "payload": "", "run_s": 0.01}
    base.update(kw)
    return base


def _done(*values: object) -> str:
    return json.dumps({"phase": "done", "results": [["ok", v] for v in values]})


REQ = VerifyRequest("def f(x):\n    return 2*x+3\n", "f", [TestCase([0], 3), TestCase([1], 5), TestCase([2], 7)])


def test_values_equal_floats_tolerant_but_not_loose() -> None:
    assert values_equal(0.1 + 0.2, 0.3)
    assert values_equal([1.0, {"a": 2.0000000000001}], [1, {"a": 2}])
    assert not values_equal(1.001, 1.0)
    assert not values_equal("5", 5)
    assert not values_equal([1, 2], [1, 2, 3])
    assert values_equal(True, True) and not values_equal(True, 2)


def test_all_pass_is_ok_partial_is_wrong() -> None:
    r = to_verify_result(REQ, _reply(payload=_done(3, 5, 7)))
    assert (r.reason, r.reward, r.passed) == ("ok", 1.0, [True, True, True])
    r = to_verify_result(REQ, _reply(payload=_done(3, 5, 8)))
    assert r.reason == "wrong" and r.reward == pytest.approx(2 / 3)


def test_failures_score_zero_with_reason() -> None:
    cases = {
        "timeout": _reply(timed_out=True, exit=None, payload=_done(3, 5, 7)),
        "output_limit": _reply(output_limit=True, payload=_done(3, 5, 7)),
        "memory": _reply(exit=1, payload='{"phase":"memory"}'),
        "killed": _reply(exit=None, signal=int(signal.SIGKILL)),
        "error": _reply(exit=1, payload='{"phase":"load_error"}'),
        "syntax": _reply(payload='{"phase":"syntax","msg":"bad"}'),
    }
    for reason, reply in cases.items():
        r = to_verify_result(REQ, reply)
        assert (r.reason, r.reward) == (reason, 0.0), reason
        assert r.passed == [False, False, False]


def test_malformed_or_forged_payload_never_passes() -> None:
    for payload in ["", "not json", "[1,2,3]", '{"phase":"done","results":[["ok",3]]}',
                    '{"phase":"done","results":"all passed"}', '{"phase":"done"}', "[" * 100000]:
        r = to_verify_result(REQ, _reply(payload=payload))
        assert r.reward == 0.0 and r.reason == "error", payload[:40]


def test_exec_result_codes() -> None:
    assert to_exec_result(_reply(exit=3)).exit_code == 3
    assert to_exec_result(_reply(exit=3)).reason == "error"
    r = to_exec_result(_reply(exit=None, signal=int(signal.SIGSEGV)))
    assert (r.exit_code, r.reason) == (-int(signal.SIGSEGV), "killed")
    r = to_exec_result(_reply(exit=None, timed_out=True, signal=int(signal.SIGKILL)))
    assert (r.exit_code, r.reason) == (None, "timeout")
    assert base_reason(_reply(exit=None, signal=int(signal.SIGXCPU))) == "timeout"
    assert base_reason(_reply(fatal="boom")) == "error"


def test_unknown_runtime_lists_known() -> None:
    cfg = SandboxConfig().model_construct(runtime="vm")  # bypass the Literal to reach the registry
    with pytest.raises(ValueError, match="known: bwrap, docker, unsafe_local"):
        create_runtime(cfg)
    assert set(RUNTIMES) == {"bwrap", "docker", "unsafe_local"}


def test_unsafe_local_needs_explicit_opt_out() -> None:
    with pytest.raises(ValueError, match="allow_unsandboxed"):
        SandboxConfig(runtime="unsafe_local")
    with pytest.raises(ValueError, match="min_warm"):
        SandboxConfig(min_warm=5, max_warm=2)
