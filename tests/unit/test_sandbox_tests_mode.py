"""Tests mode of the sandbox (no sandbox needed): the literal codec, the call frames, the tester's
binding rules and the host's verdict rules.

The tester's logic (``run_tests``) runs here in-process against a real callee (``serve_call`` on
a program executed in a dict), with every value crossing through ``repr`` and ``decode_literal``
as it does between the two sandbox processes.
"""

from __future__ import annotations

import builtins
import json
import math
import os
from typing import Any, Callable

import pytest

from infra.sandbox import runner
from infra.sandbox.pool import _request_key
from infra.sandbox.protocol import run_tests_job, to_tests_result
from infra.sandbox.types import TestsRequest


# ------------------------------------------------------------------------------ literal codec
@pytest.mark.parametrize("value", [
    0, -7, 2**200, 1.5, -0.0, 1e-300, 3 + 4j, "", "a'b\"c\n\u00e9", b"\x00\xff", None, True, False,
    (1,), (), [1, [2, (3, {"k": {4, 5}})]], {"a": [1.25, None], 2: (b"x",)}, set(), frozenset({1}) and {1, 2},
])
def test_literals_round_trip_through_repr(value: Any) -> None:
    got = runner.decode_literal(repr(value))
    assert got == value and type(got) is type(value)


def test_inf_and_nan_decode_as_floats() -> None:
    got = runner.decode_literal(repr([float("inf"), -float("inf"), (float("nan"),)]))
    assert got[0] == math.inf and got[1] == -math.inf and math.isnan(got[2][0])


@pytest.mark.parametrize("text", [
    "__import__('os').system('id')", "open('/etc/passwd')", "x", "inf.real", "(lambda: 1)()",
    "[i for i in range(3)]", "a.b", "<__main__.A object at 0x7f>", "f'{1}'", "1 if 1 else 2",
    "[" * 5000 + "]" * 5000, "9" * 5000, "", "nan(1)", "{**{}}",
])
def test_non_literals_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        runner.decode_literal(text)


def test_oversized_text_is_refused() -> None:
    with pytest.raises(ValueError):
        runner.decode_literal("1" * 10 + " " * 100, cap=50)


# ------------------------------------------------------------------------------------ frames
def test_frames_round_trip_cap_and_eof() -> None:
    r, w = os.pipe()
    try:
        runner.send_frame(w, ["ok", "[1, 2]"])
        runner.send_frame(w, {"big": "x" * 100})
        assert runner.recv_frame(r) == ["ok", "[1, 2]"]
        with pytest.raises(ValueError):  # the tester then treats the channel as broken
            runner.recv_frame(r, cap=50)
    finally:
        os.close(r)
        os.close(w)
    r, w = os.pipe()
    os.write(w, b"\x05\x00")  # half a length prefix, then the callee is gone
    os.close(w)
    try:
        with pytest.raises(EOFError):
            runner.recv_frame(r)
    finally:
        os.close(r)


# ------------------------------------------------------------------------------ callee replies
def test_reply_value_decodes_only_literals() -> None:
    assert runner.reply_value(["ok", "(1, 'a')"]) == (1, "a")
    with pytest.raises(TypeError):
        runner.reply_value(["ok", "<object at 0x1>"])
    with pytest.raises(TypeError):
        runner.reply_value(["ok", 5])  # a value must come as text
    with pytest.raises(RuntimeError):
        runner.reply_value("garbage")


@pytest.mark.parametrize("name,cls", [
    ("ValueError", ValueError), ("ZeroDivisionError", ZeroDivisionError), ("KeyError", KeyError),
    ("SystemExit", RuntimeError), ("KeyboardInterrupt", RuntimeError), ("MyError", RuntimeError),
    ("__import__", RuntimeError), ("print", RuntimeError),
])
def test_program_exceptions_come_back_as_builtin_exceptions_only(name: str, cls: type) -> None:
    with pytest.raises(Exception) as info:
        runner.reply_value(["exc", name])
    assert type(info.value) is cls


# --------------------------------------------------------------------- the tester, in-process
def _callee(program: str) -> tuple[list[Any], Callable[[str, tuple, dict], Any]]:
    """A real callee in this process: the hello W1 would send and a call function whose values
    cross as text, as between W2 and W1."""
    glb: dict[str, Any] = {"__name__": "__program__", "__builtins__": builtins}
    exec(compile(program, "<program>", "exec"), glb)
    names = [k for k, v in glb.items() if runner.plain_name(k) and callable(v)]
    modules = {k: v.__name__ for k, v in glb.items() if runner.plain_name(k) and type(v).__name__ == "module"}

    def call(name: str, args: tuple, kwargs: dict) -> Any:
        reply = runner.serve_call(glb, json.loads(json.dumps([name, repr(args), repr(kwargs)])))
        return runner.reply_value(json.loads(json.dumps(reply)))

    return ["names", names, modules], call


def _verdict(program: str, tests: str, entry: str | None = "f", context: str = "") -> dict[str, Any]:
    hello, call = _callee(program)
    return runner.run_tests(context, tests, entry, hello, call)


CHECK = "def check(candidate):\n    assert candidate(2) == 7\n    assert candidate(-1) == 1\n"
GOOD = "def f(x):\n    return 2 * x + 3\n"


def test_honest_program_passes_check_asserts_and_test_functions() -> None:
    assert _verdict(GOOD, CHECK) == {"phase": "tests", "passed": True}
    assert _verdict(GOOD, "assert f(2) == 7\nassert f(0) == 3\n", entry=None)["passed"] is True
    assert _verdict(GOOD, "def test_a():\n    assert f(1) == 5\n", entry=None)["passed"] is True


def test_wrong_program_fails_with_the_failing_line() -> None:
    v = _verdict("def f(x):\n    return 2 * x\n", CHECK)
    assert v["passed"] is False and v["error"] == "AssertionError" and "candidate(2) == 7" in v["msg"]
    v = _verdict(GOOD, "def test_a():\n    assert f(1) == 6\n", entry=None)
    assert v["passed"] is False


def test_eq_always_true_object_does_not_cross() -> None:
    program = ("class Yes:\n    def __eq__(self, other):\n        return True\n"
               "    __hash__ = object.__hash__\n"
               "def f(x):\n    return Yes()\n")
    v = _verdict(program, CHECK)
    assert v["passed"] is False and v["error"] == "TypeError"


def test_program_cannot_shadow_builtins_context_helpers_or_check() -> None:
    # abs() in the tests stays the builtin.
    tests = "def check(candidate):\n    assert abs(candidate(1.0) - 5.0) < 1e-9\n"
    assert _verdict("def abs(x):\n    return 0\ndef f(x):\n    return 0.0\n", tests)["passed"] is False
    assert _verdict("def f(x):\n    return 2 * x + 3\n", tests)["passed"] is True
    # A helper of the trusted context stays the context's.
    context = "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n"
    tests = "def check(candidate):\n    assert abs(poly([-4, 0, 1], candidate([-4, 0, 1]))) < 1e-9\n"
    cheat = "def poly(xs, x):\n    return 0\ndef find_zero(xs):\n    return 0.0\n"
    honest = "def find_zero(xs):\n    return 2.0\n"
    assert _verdict(cheat, tests, entry="find_zero", context=context)["passed"] is False
    assert _verdict(honest, tests, entry="find_zero", context=context)["passed"] is True
    # The tests' own check is the one called.
    cheat = "def check(candidate):\n    return True\ndef f(x):\n    return 0\n"
    assert _verdict(cheat, CHECK)["passed"] is False


def test_tests_see_stdlib_modules_the_program_imported() -> None:
    program = "import math\ndef area(r):\n    return math.pi * r * r\n"
    tests = "assert math.isclose(area(2), 12.566, rel_tol=1e-3)\n"
    assert _verdict(program, tests, entry="area")["passed"] is True


def test_untestable_requests_are_not_passes() -> None:
    assert _verdict(GOOD, "x = 1\n")["phase"] == "bad_tests"  # nothing to run would pass anything
    assert _verdict(GOOD, CHECK, entry=None)["phase"] == "bad_tests"  # check needs an entry
    assert _verdict(GOOD, "assert f(1) ==\n")["phase"] == "bad_tests"
    assert _verdict(GOOD, CHECK, context="raise ValueError\n")["phase"] == "bad_tests"
    assert _verdict("def g(x):\n    return x\n", CHECK)["phase"] == "no_entry"
    assert runner.run_tests("", CHECK, "f", ["syntax", "bad"], lambda *a: 1)["phase"] == "syntax"
    assert runner.run_tests("", CHECK, "f", ["load_error", "SystemExit"], lambda *a: 1)["phase"] == "load_error"
    assert runner.run_tests("", CHECK, "f", "garbage", lambda *a: 1)["phase"] == "load_error"


def test_program_exception_reaches_the_tests_as_its_builtin_type() -> None:
    program = "def f(x):\n    if x < 0:\n        raise ValueError('neg')\n    return x\n"
    tests = ("def check(candidate):\n    try:\n        candidate(-1)\n    except ValueError:\n        pass\n"
             "    else:\n        assert False\n    assert candidate(3) == 3\n")
    assert _verdict(program, tests)["passed"] is True


# --------------------------------------------------------------------------- host-side verdict
def _reply(payload: object, **kw: object) -> dict[str, Any]:
    base: dict[str, Any] = {"exit": 0, "signal": None, "timed_out": False, "output_limit": False, "oom": False,
                            "anomaly": None, "stdout": "", "stderr": "", "run_s": 0.01,
                            "payload": payload if isinstance(payload, str) else json.dumps(payload)}
    base.update(kw)
    return base


PASSED = {"phase": "tests", "passed": True}


def test_host_passes_only_a_clean_verdict() -> None:
    r = to_tests_result(_reply(PASSED))
    assert (r.passed, r.reward, r.reason) == (True, 1.0, "ok")
    fails = {
        "timeout": _reply(PASSED, timed_out=True, exit=None),
        "output_limit": _reply(PASSED, output_limit=True),
        "killed": _reply(PASSED, exit=None, signal=9),
        "error": _reply(PASSED, exit=1),
        "memory": _reply({"phase": "memory"}, exit=1),
    }
    for reason, reply in fails.items():
        r = to_tests_result(reply)
        assert (r.passed, r.reward, r.reason) == (False, 0.0, reason), reason
    for payload, reason in [("", "error"), ("PASS", "error"), ('{"phase":"tests","passed":"true"}', "wrong"),
                            ('{"phase":"tests","passed":1}', "wrong"), ("[true]", "error"),
                            ({"phase": "tests", "passed": False, "error": "AssertionError"}, "wrong"),
                            ({"phase": "tests", "passed": False, "error": "MemoryError"}, "memory"),
                            ({"phase": "syntax"}, "syntax"), ({"phase": "no_entry"}, "error"),
                            ({"phase": "bad_tests"}, "error"), ({"phase": "done", "passed": True}, "error")]:
        r = to_tests_result(_reply(payload))
        assert (r.passed, r.reward, r.reason) == (False, 0.0, reason), payload
    assert to_tests_result({"fatal": "tests jobs need a warm runner"}).reason == "error"


def test_job_message_and_dedupe_key() -> None:
    req = TestsRequest("def f(x): return x", "assert f(1) == 1", context="import math", entry="f", timeout_s=3)
    job = run_tests_job(req, 3.0)
    assert job["mode"] == "tests" and job["tests"] == req.tests and job["context"] == "import math"
    other = TestsRequest(req.program, req.tests, context="", entry="f", timeout_s=3)
    assert _request_key(req) != _request_key(other)
    assert _request_key(req) == _request_key(TestsRequest(**vars(req)))
