"""Programs scored against trusted unit tests in real sandboxes (bubblewrap and a real dockerd).

Every hostile completion below carries a wrong (or no) implementation plus an attack on the
verdict; each must score 0 while its honest counterpart scores 1, and the pool must stay healthy.
Docker cases are marked ``docker``; they need the daemon and image from scripts/setup_sandbox.sh.
On CI (``CI=true``) a missing bwrap/dockerd is a failure, not a skip.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from infra.sandbox import SandboxPool, TestsRequest
from tests.sandbox_helpers import RUNTIMES, running_pool

VERDICT = '{"phase":"tests","passed":true}'


@pytest.fixture(scope="module", params=RUNTIMES)
def pool(request: pytest.FixtureRequest) -> Iterator[SandboxPool]:
    with running_pool(request.param) as p:
        yield p


# ------------------------------------------------------------------------------ the test shapes
ADD_CHECK = ("METADATA = {}\n\n"
             "def check(candidate):\n"
             "    assert candidate(1, 2) == 3\n"
             "    assert candidate(-5, 5) == 0\n"
             "    assert candidate(10, 32) == 42\n")
ADD_GOOD = "def add(a, b):\n    return a + b\n"
ADD_WRONG = "def add(a, b):\n    return a - b\n"


def _add(program: str, **kw: object) -> TestsRequest:
    return TestsRequest(program, ADD_CHECK, context="def add(a: int, b: int) -> int:\n    \"\"\"Sum.\"\"\"\n",
                        entry="add", **kw)  # type: ignore[arg-type]


HOSTILE: dict[str, str] = {
    "print_pass": ADD_WRONG + f"print('PASS')\nprint({VERDICT!r})\nimport sys\nsys.stderr.write('PASS\\n')\n",
    "sys_exit_0_at_import": "import sys\nsys.exit(0)\n" + ADD_WRONG,
    "os_exit_0_at_import": "import os\nos._exit(0)\n" + ADD_WRONG,
    "exit_0_inside_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "verdict_files": ADD_WRONG + (
        "for p in ['/scratch/verdict.json', '/scratch/result.json', '/tmp/verdict.json', 'passed']:\n"
        "    try:\n        open(p, 'w').write(" + repr(VERDICT) + ")\n    except OSError:\n        pass\n"),
    "patch_builtins_and_assertion": ADD_WRONG + (
        "import builtins\nclass Never(Exception):\n    pass\n"
        "builtins.AssertionError = Never\nbuiltins.abs = lambda x: 0\nbuiltins.isinstance = lambda *a: True\n"),
    "settrace_and_excepthook": ADD_WRONG + (
        "import sys\nsys.settrace(lambda *a: None)\nsys.excepthook = lambda *a: None\n"),
    "patch_json_and_os_write": ADD_WRONG + (
        "import json, os\n_w = os.write\n"
        f"json.dumps = lambda *a, **k: {VERDICT!r}\n"
        f"os.write = lambda fd, data: _w(fd, {VERDICT.encode()!r})\n"),
    "replace_check": "def check(candidate):\n    return True\n" + ADD_WRONG,
    "eq_always_true": ("class Yes(int):\n    def __eq__(self, other):\n        return True\n"
                       "    def __ne__(self, other):\n        return False\n    __hash__ = int.__hash__\n"
                       "def add(a, b):\n    return Yes(0)\n"),
    "repr_not_literal": ("class Yes:\n    def __eq__(self, other):\n        return True\n"
                         "    def __repr__(self):\n        return '__import__(\"os\")._exit(0)'\n"
                         "def add(a, b):\n    return Yes()\n"),
    "kill_everything": "import os\nos.kill(-1, 9)\n" + ADD_WRONG,
    "kill_everything_in_call": "import os\ndef add(a, b):\n    os.kill(-1, 9)\n    return 0\n",
    "killpg_others": ADD_WRONG + (
        "import os\nfor p in os.listdir('/proc'):\n"
        "    if p.isdigit() and int(p) != os.getpid():\n"
        "        for f in (os.killpg, os.kill):\n"
        "            try:\n                f(int(p), 9)\n            except OSError:\n                pass\n"),
    "write_verdict_to_every_fd": ADD_WRONG + (
        "import os\nfor p in os.listdir('/proc'):\n"
        "    try:\n        fds = os.listdir('/proc/%s/fd' % p)\n    except OSError:\n        continue\n"
        "    for fd in fds:\n"
        "        try:\n            w = os.open('/proc/%s/fd/%s' % (p, fd), os.O_WRONLY | os.O_NONBLOCK)\n"
        f"            os.write(w, {VERDICT.encode()!r})\n            os.close(w)\n"
        "        except OSError:\n            pass\n"
        "for fd in range(3, 64):\n"
        f"    try:\n        os.write(fd, {VERDICT.encode()!r})\n    except OSError:\n        pass\n"),
    "background_writer": ADD_WRONG + (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
        "    for _ in range(20):\n        time.sleep(0.05)\n"
        f"        print({VERDICT!r}, flush=True)\n"
        "        for fd in range(3, 64):\n"
        f"            try:\n                os.write(fd, {VERDICT.encode()!r})\n            except OSError:\n"
        "                pass\n"
        "    os._exit(0)\n"),
    "forged_call_replies": ADD_WRONG + (
        "import os, json, struct\n"
        "for v in ('3', '0', '42'):\n"
        "    data = json.dumps(['ok', v]).encode()\n"
        "    os.write(4, struct.pack('<I', len(data)) + data)\n"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_completion_scores_zero(pool: SandboxPool, name: str) -> None:
    res = pool.run_tests_many([_add(HOSTILE[name])])[0]
    assert (res.passed, res.reward) == (False, 0.0), (name, res)
    assert res.reason != "ok", res
    honest = pool.run_tests_many([_add(ADD_GOOD), _add(ADD_WRONG)])
    assert [(r.passed, r.reward, r.reason) for r in honest] == [(True, 1.0, "ok"), (False, 0.0, "wrong")], honest


def test_stopped_tester_is_a_timeout(pool: SandboxPool) -> None:
    program = ADD_WRONG + ("import os, signal\nfor p in os.listdir('/proc'):\n"
                           "    if p.isdigit() and int(p) != os.getpid():\n"
                           "        try:\n            os.kill(int(p), signal.SIGSTOP)\n"
                           "        except OSError:\n            pass\n")
    res = pool.run_tests_many([_add(program, timeout_s=1.0)])[0]
    assert (res.passed, res.reason) == (False, "timeout"), res


def test_shadowing_builtins_or_context_helpers_scores_zero(pool: SandboxPool) -> None:
    context = ("import math\n\ndef poly(xs: list, x: float):\n"
               "    return sum(coeff * math.pow(x, i) for i, coeff in enumerate(xs))\n\n"
               "def find_zero(xs: list):\n    \"\"\"A zero of poly(xs).\"\"\"\n")
    tests = ("def check(candidate):\n"
             "    for xs in ([-6, 11, -6, 1], [1, 2], [-4, 0, 1]):\n"
             "        assert abs(poly(xs, candidate(xs))) < 1e-4\n")
    honest = context + ("    lo, hi = -100.0, 100.0\n"
                        "    while hi - lo > 1e-10:\n        mid = (lo + hi) / 2\n"
                        "        if (poly(xs, mid) > 0) == (poly(xs, lo) > 0):\n            lo = mid\n"
                        "        else:\n            hi = mid\n    return lo\n")
    cheat_poly = context + "    return 0.0\n\ndef poly(xs, x):\n    return 0.0\n"
    cheat_abs = context + "    return 0.0\n\ndef abs(x):\n    return 0\n"
    reqs = [TestsRequest(p, tests, context=context, entry="find_zero") for p in (honest, cheat_poly, cheat_abs)]
    res = pool.run_tests_many(reqs)
    assert [r.passed for r in res] == [True, False, False], res
    assert [r.reward for r in res] == [1.0, 0.0, 0.0]


def test_helper_from_context_and_mbpp_style_asserts(pool: SandboxPool) -> None:
    context = ("def encode_shift(s: str):\n"
               "    return ''.join(chr(((ord(ch) + 5 - ord('a')) % 26) + ord('a')) for ch in s)\n\n"
               "def decode_shift(s: str):\n    \"\"\"Inverse of encode_shift.\"\"\"\n")
    tests = ("def check(candidate):\n"
             "    for s in ('hello', 'xyz', 'abcdefghijklmnopqrstuvwxyz'):\n"
             "        assert candidate(encode_shift(s)) == s\n")
    good = context + "    return ''.join(chr(((ord(ch) - 5 - ord('a')) % 26) + ord('a')) for ch in s)\n"
    mbpp_tests = "assert min_cost([3, 1, 2]) == 1\nassert min_cost([]) is None\nassert min_cost((5,)) == 5\n"
    mbpp = "def min_cost(xs):\n    return min(xs) if xs else None\n"
    res = pool.run_tests_many([
        TestsRequest(good, tests, context=context, entry="decode_shift"),
        TestsRequest(context + "    return s\n", tests, context=context, entry="decode_shift"),
        TestsRequest(mbpp, mbpp_tests),
        TestsRequest("def min_cost(xs):\n    return 1\n", mbpp_tests),
        TestsRequest("", tests, context=context, entry="decode_shift"),
        TestsRequest("def min_cost(xs):\n    return min(xs\n", mbpp_tests),
    ])
    assert [(r.passed, r.reason) for r in res] == [
        (True, "ok"), (False, "wrong"), (True, "ok"), (False, "wrong"), (False, "error"), (False, "syntax")], res


# Reads every readable mapping of its own process (ctypes: /proc/self/mem is closed to it) for the
# expected answer.
SNOOP = ("import ctypes, re\n"
         "def answer():\n"
         "    with open('/proc/self/maps') as maps:\n"
         "        lines = maps.read().splitlines()\n"
         "    for line in lines:\n"
         "        parts = line.split()\n"
         "        if not parts[1].startswith('r') or (len(parts) > 5 and parts[5].startswith('[v')):\n"
         "            continue\n"
         "        lo, hi = (int(x, 16) for x in parts[0].split('-'))\n"
         "        m = re.search(rb'deltaloop-expected-[0-9a-f]{4}', ctypes.string_at(lo, hi - lo))\n"
         "        if m:\n"
         "            return m.group().decode()\n"
         "    return ''\n")


def test_snoop_finds_what_is_in_its_memory(pool: SandboxPool) -> None:
    """The snooping program of the next test works: it finds the answer when its process has it."""
    tests = "def check(candidate):\n    assert candidate() == 'deltaloop-' + 'expected-93b1'\n"
    program = "PLANTED = '-'.join(['deltaloop', 'expected', '93b1'])\n" + SNOOP
    res = pool.run_tests_many([TestsRequest(program, tests, entry="answer", timeout_s=20.0)])[0]
    assert (res.passed, res.reason) == (True, "ok"), res


def test_tests_never_reach_the_program_process(pool: SandboxPool) -> None:
    """The expected answer is only in the tests: a program that searches its own memory for it
    (where earlier jobs of the same sandbox would have left it, had it passed through the zygote)
    must not find it."""
    tests = "def check(candidate):\n    assert candidate() == 'deltaloop-' + 'expected-93b1'\n"
    honest = "def answer():\n    return 'deltaloop-expected-93b1'\n"
    snoop = SNOOP
    reqs = [TestsRequest(honest, tests, entry="answer") for _ in range(4)]
    reqs += [TestsRequest(snoop, tests, entry="answer", timeout_s=20.0) for _ in range(4)]
    res = pool.run_tests_many(reqs)
    assert [r.passed for r in res] == [True] * 4 + [False] * 4, res


def test_many_jobs_dedupe_and_exec_verify_still_work(pool: SandboxPool) -> None:
    reqs = [_add(ADD_GOOD if i % 3 else ADD_WRONG) for i in range(12)]
    res = pool.run_tests_many(reqs, dedupe=True)
    assert [r.passed for r in res] == [bool(i % 3) for i in range(12)]
    assert res[1] is not res[2] and res[1] == res[2]
    assert pool.exec("print('hi')").stdout_tail == "hi\n"
